"use strict";
// Placement: for each model, one bar per plan (the serving one, and a standby loading beside it) over
// its layers, with a segment per stage coloured by the agent that holds it.

import { agentColour, agentLabel, el, fmtBytes, fmtClock, stateClass, svg } from "./dom.js";
import { numLayersOf } from "./state.js";

const BAR_H = 30;
const AXIS_H = 16;
const CHAR_W = 6.3;     // rough width of a label character at the bar's font size

export class Placement {
  constructor(root) {
    this.root = root;
    this.signature = "";
    this.width = 0;
  }

  update(view) {
    const width = this.root.clientWidth;
    const models = modelsOf(view);
    const signature = JSON.stringify([models, view.agents.map((a) => [a.agent_id, a.name, a.state]), width]);
    if (signature === this.signature) return;
    this.signature = signature;
    if (!models.length) {
      this.root.replaceChildren(el("p", { class: "empty", text: "No model deployed." }));
      return;
    }
    this.root.replaceChildren(...models.map((m) => renderModel(m, view, width)), legend(models, view));
  }
}

/** [{model_id, state, plans: [plan + num_layers]}], active plans first. */
function modelsOf(view) {
  const byModel = new Map();
  for (const model of view.models) {
    byModel.set(model.model_id, { model_id: model.model_id, state: model.state, plans: [] });
  }
  for (const plan of view.plans) {
    if (!byModel.has(plan.model_id)) byModel.set(plan.model_id, { model_id: plan.model_id, state: "", plans: [] });
    byModel.get(plan.model_id).plans.push({ ...plan, num_layers: numLayersOf(plan, view.models) });
  }
  const rank = (p) => (p.state === "active" ? 0 : 1);
  for (const m of byModel.values()) {
    m.plans.sort((a, b) => (a.replica || 0) - (b.replica || 0) || rank(a) - rank(b) || a.created - b.created);
  }
  return [...byModel.values()];
}

function renderModel(model, view, width) {
  const plans = model.plans.length ? model.plans.map((p) => renderPlan(p, view, width))
    : [el("p", { class: "empty", text: `No plan yet${model.state ? ` (${model.state})` : ""}.` })];
  return el("div", { class: "placement-model", "data-testid": "placement-model", "data-model-id": model.model_id },
    el("div", { class: "placement-title" }, el("b", { text: model.model_id }),
      model.state ? el("span", { class: `badge ${stateClass(model.state)}`, text: model.state }) : null),
    ...plans);
}

function renderPlan(plan, view, width) {
  const stages = [...plan.stages].sort((a, b) => a.start_layer - b.start_layer);
  const bar = svg("svg", { class: "placement-bar", width: "100%", height: BAR_H + AXIS_H,
    "data-testid": "placement-bar", "data-plan-id": plan.plan_id, "data-plan-state": plan.state },
    defs(), ...stages.map((s, i) => segment(s, i, plan, view, width)), axis(plan.num_layers, width));
  return el("div", { class: `placement-plan ${plan.state}` },
    el("div", { class: "plan-meta" },
      el("span", { class: `badge ${plan.state === "active" ? "healthy" : "warn"}`, text: plan.state }),
      el("span", { class: "badge", "data-testid": "plan-replica",
        text: plan.canary ? `canary ${String(plan.revision || "").slice(0, 12)}` : `replica ${plan.replica || 0}` }),
      plan.role ? el("span", { class: "badge", "data-testid": "plan-role", title: "prefill/decode disaggregation: "
        + "a prefill replica prefills long prompts, whose KV then moves to a decode replica", text: plan.role }) : null,
      el("span", { class: "mono muted", text: `plan ${plan.plan_id}` }),
      el("span", { class: "muted", text: `${stages.length} stage${stages.length === 1 ? "" : "s"} · `
        + `${plan.num_layers} layers · ${fmtClock(plan.created)}` })),
    bar,
    stageList(stages, view),
    plan.reason ? el("details", { class: "plan-reason" }, el("summary", { text: "why this plan" }),
      el("p", { text: plan.reason })) : null);
}

/** The stages as rows: agent, layers, tensor-parallel degree, state; readable where a segment is narrow. */
function stageList(stages, view) {
  return el("table", { class: "stage-list" }, el("tbody", {}, ...stages.map((s, i) => {
    const agent = view.agentsById.get(s.agent_id);
    return el("tr", {},
      el("td", { class: "muted", text: `stage ${i}` }),
      el("td", {}, el("i", { class: "swatch", style: `background:${agentColour(s.agent_id)}` }), " ",
        el("span", { title: s.agent_id, text: agentLabel(agent, s.agent_id) })),
      el("td", { class: "mono", text: `[${s.start_layer}, ${s.end_layer})` }),
      el("td", { class: "muted", text: `TP=${s.tp_degree || 1}` }),
      el("td", { class: "muted mono", "data-testid": "stage-link-codec",
        title: "how activations reach this stage from the one before: raw in its dtype, float16, or int8 with "
          + "per-token scales on a slow link", text: i === 0 ? "" : `← ${s.link_codec || s.dtype || "raw"}` }),
      el("td", { class: "muted mono", "data-testid": "stage-device", text: `${s.device || "cpu"} ${s.dtype || ""}${s.quantize ? ` ${s.quantize} weights` : ""}${s.runtime === "onnxruntime" ? " onnxruntime" : ""}` }),
      el("td", { class: "muted", "data-testid": "stage-kv", title: "the KV cache its plan reserved for it: a CPU "
          + "stage holds that (at least 0.5 GiB) unless its agent's --kv-cache-gib says otherwise; a GPU stage, what "
          + "its share of the GPU leaves", text: s.kv_cache_bytes ? `KV ${fmtBytes(s.kv_cache_bytes)} planned` : "" }),
      el("td", { class: "muted", "data-testid": "stage-cached", title: "KV blocks its prefix cache holds, as its agent reported them to the router",
        text: `${s.cached_blocks || 0} blocks cached` }),
      el("td", { class: "muted" }, s.weights ? weightsCell(s.weights) : null),
      el("td", { class: "muted" }, s.experts ? expertsCell(s.experts) : null),
      el("td", {}, el("span", { class: `badge ${stateClass(s.state)}`, text: s.state })));
  })));
}

/** How the agent's fetch of the stage's tensors goes (or went): a progress bar, the bytes, corrupt chunks. */
function weightsCell(w) {
  const have = w.fetched_bytes + w.reused_bytes;
  const text = w.done
    ? `weights fetched: ${fmtBytes(w.fetched_bytes)}` + (w.reused_bytes ? `, ${fmtBytes(w.reused_bytes)} on disk` : "")
    : `weights ${w.total_bytes ? Math.floor((100 * have) / w.total_bytes) : 100}% · `
      + `${fmtBytes(have)} of ${fmtBytes(w.total_bytes)}`;
  return el("span", { "data-testid": "stage-weights", title: `latest chunk from ${w.source || "-"}; its tensors: `
      + fmtBytes(w.tensor_bytes) },
    el("progress", { max: w.total_bytes || 1, value: have }), " ",
    el("span", { text: text + (w.num_corrupt ? ` · ${w.num_corrupt} corrupt chunk(s) fetched again` : "") }));
}

const EXPERT_BAR_W = 3;
const EXPERT_CHART_H = 14;

/** A mixture of experts' stage: a bar per expert (its tokens since the stage loaded), the last step's imbalance,
 * and, where an expert-parallel group splits them, the straggler: the rank whose experts got the most tokens. */
function expertsCell(x) {
  const most = Math.max(1, ...x.tokens);
  const chart = svg("svg", { class: "expert-chart", width: x.tokens.length * EXPERT_BAR_W, height: EXPERT_CHART_H },
    ...x.tokens.map((n, e) => {
      const h = Math.max(1, Math.round((EXPERT_CHART_H * n) / most));
      return svg("rect", { x: e * EXPERT_BAR_W, y: EXPERT_CHART_H - h, width: EXPERT_BAR_W - 1, height: h },
        svg("title", { text: `expert ${e}: ${n} tokens` }));
    }));
  const total = x.rank_tokens.reduce((a, b) => a + b, 0);
  const straggler = x.straggler_rank === null || x.straggler_rank === undefined ? ""
    : ` · rank ${x.straggler_rank} straggles: ${Math.round((100 * x.rank_tokens[x.straggler_rank]) / (total || 1))}%`
      + ` of tokens on ${x.rank_tokens.length} ranks`;
  return el("span", { "data-testid": "stage-experts", "data-straggler-rank": x.straggler_rank ?? "",
    title: "tokens its routers sent each expert since it loaded (over its sparse layers); imbalance: the last "
      + "step's most tokens an expert got over the mean (1: even); an expert-parallel group waits every step for "
      + "the rank holding the busiest experts" },
  chart, " ", el("span", { "data-testid": "stage-experts-summary", text: `${x.tokens.length} experts · imbalance ${x.imbalance.toFixed(2)}×${straggler}` }));
}

function defs() {
  // Stages still loading are hatched.
  return svg("defs", {}, svg("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
    patternTransform: "rotate(45)" }, svg("rect", { width: 3, height: 6, fill: "rgba(255,255,255,0.35)" })));
}

function segment(stage, index, plan, view, width) {
  const agent = view.agentsById.get(stage.agent_id);
  const name = agentLabel(agent, stage.agent_id);
  const x = (100 * stage.start_layer) / plan.num_layers;
  const w = (100 * (stage.end_layer - stage.start_layer)) / plan.num_layers;
  const range = `[${stage.start_layer}, ${stage.end_layer})`;
  const full = `${name} · ${range} · TP=${stage.tp_degree || 1}`;
  const pixels = (w / 100) * (width || 400) - 10;
  const text = [full, `${name} · ${range}`, name, `${stage.start_layer}`].find((t) => t.length * CHAR_W <= pixels) || "";
  const ready = stage.state === "ready";
  return svg("g", { class: `segment ${ready ? "ready" : "loading"}`, "data-testid": "placement-segment",
    "data-agent-id": stage.agent_id, "data-stage": index, "data-start": stage.start_layer, "data-end": stage.end_layer,
    "data-model-id": plan.model_id, "data-plan-state": plan.state, "data-stage-state": stage.state },
    svg("title", { text: [`stage ${index}: ${full}`, `agent ${stage.agent_id}`, `assignment ${stage.assignment_id}`,
      `state ${stage.state}`].join("\n") }),
    svg("rect", { x: `${x}%`, y: 0, width: `${w}%`, height: BAR_H, fill: agentColour(stage.agent_id) }),
    ready ? null : svg("rect", { x: `${x}%`, y: 0, width: `${w}%`, height: BAR_H, fill: "url(#hatch)" }),
    svg("line", { class: "segment-edge", x1: `${x}%`, x2: `${x}%`, y1: 0, y2: BAR_H }),
    svg("svg", { x: `${x}%`, y: 0, width: `${w}%`, height: BAR_H },   // clips the label to its segment
      svg("text", { class: "segment-label", x: 6, y: BAR_H / 2 + 4, text })));
}

/** Layer ticks under the bar: every layer when there are few, else about ten. */
function axis(numLayers, width) {
  const g = svg("g", { class: "axes" });
  const every = Math.max(1, Math.ceil(numLayers / Math.max(2, Math.floor((width || 400) / 40))));
  for (let layer = 0; layer <= numLayers; layer += every) {
    const x = `${(100 * layer) / numLayers}%`;
    const anchor = layer === 0 ? "start" : layer === numLayers ? "end" : "middle";
    g.append(svg("line", { class: "grid", x1: x, x2: x, y1: BAR_H, y2: BAR_H + 3 }),
      svg("text", { class: "tick", x, y: BAR_H + AXIS_H - 2, "text-anchor": anchor, text: String(layer) }));
  }
  if (numLayers % every) {
    g.append(svg("text", { class: "tick", x: "100%", y: BAR_H + AXIS_H - 2, "text-anchor": "end",
      text: String(numLayers) }));
  }
  return g;
}

function legend(models, view) {
  const ids = [...new Set(models.flatMap((m) => m.plans.flatMap((p) => p.stages.map((s) => s.agent_id))))];
  return el("div", { class: "legend", "data-testid": "placement-legend" },
    ...ids.map((id) => el("span", { class: "legend-item", title: id },
      el("i", { class: "sw", style: `background:${agentColour(id)}` }), agentLabel(view.agentsById.get(id), id))),
    el("span", { class: "legend-item" }, el("i", { class: "sw hatched" }), "loading"));
}
