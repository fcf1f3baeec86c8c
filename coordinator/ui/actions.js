"use strict";
// What an operator can do: deploy a model, re-plan one, drain an agent. Results and errors show as
// toasts (a 403 too: its message says which role was needed); the drain asks first, in a dialog that says
// what will happen. A viewer gets none of these controls: the panels ask canOperate before drawing them.

import { postJson, seg } from "./api.js";
import { agentLabel, el, fmtSeconds, shorten, stateClass, svg } from "./dom.js";

const TOAST_MS = { ok: 6000, info: 6000, error: 12000 };

export class Actions {
  constructor({ toasts, dialog, onChange }) {
    this.toasts = toasts;
    this.dialog = dialog;
    this.onChange = onChange;   // after an action: refresh the state now
    this.view = null;           // the newest view, set by the app on every render
    this.noteDrain = () => {};  // the app records a drain it started, until the snapshot carries it
    this.role = null;           // the signed-in user's role
    this.canOperate = false;    // an operator's controls are drawn only when true
  }

  setRole(role) {
    this.role = role;
    this.canOperate = role === "operator";
  }

  /** An action failed: say why, unless it was a 401 (then the login form is back, and says so). */
  failed(prefix, err) {
    if (err.status === 401) return;
    this.toast(`${prefix}: ${err.message}`, "error");
  }

  toast(message, kind = "info") {
    const node = el("div", { class: `toast ${kind}`, role: kind === "error" ? "alert" : "status",
      "data-testid": "toast", "data-kind": kind },
      el("span", { class: "toast-text", text: message }),
      el("button", { class: "toast-close", type: "button", "aria-label": "dismiss",
        onclick: () => node.remove() }, "×"));
    this.toasts.append(node);
    setTimeout(() => node.remove(), TOAST_MS[kind] || 6000);
  }

  /** Resolves true when the operator confirms. */
  confirm(title, body, okLabel) {
    const dialog = this.dialog;
    dialog.querySelector("#confirm-title").textContent = title;
    dialog.querySelector("#confirm-body").textContent = body;
    dialog.querySelector("#confirm-ok").textContent = okLabel;
    dialog.returnValue = "";
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.showModal();
    });
  }

  async drain(agentId) {
    const view = this.view;
    const agent = view && view.agentsById.get(agentId);
    const name = agentLabel(agent, agentId);
    const stages = (view && view.serving.get(agentId)) || [];
    const what = stages.map((s) => `${s.model_id} layers [${s.start_layer}, ${s.end_layer})`).join(", ");
    const ok = await this.confirm(`Drain ${name}?`,
      `Its stages (${what || "none"}) move to spare agents and its live sessions follow with their KV cache; `
      + "then the agent exits. Requests keep streaming.", "Drain");
    if (!ok) return;
    try {
      const { drain } = await postJson(`/agents/${seg(agentId)}/drain`);
      this.noteDrain(drain);
      this.toast(`Draining ${name}: ${drain.state.replace("_", " ")}`, "info");
      this.onChange();
    } catch (err) {
      this.failed(`Drain of ${name} refused`, err);
    }
  }

  async replan(modelId, numStages) {
    try {
      const { replan } = await postJson(`/models/${seg(modelId)}/replan`, { num_stages: numStages || null });
      const kind = replan.outcome === "unchanged" ? "info" : "ok";
      const gist = (replan.reason || "").split(". ")[0];   // the first sentence; the plan's full reason is in Placement
      this.toast(`Re-plan of ${modelId}: ${replan.outcome}${gist ? ` — ${gist}` : ""}`, kind);
      this.onChange();
    } catch (err) {
      this.failed(`Re-plan of ${modelId} failed`, err);
    }
  }

  mountDeployForm(form) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const data = new FormData(form);
      const text = (name) => String(data.get(name) || "").trim() || null;
      const body = { path: text("path"), model_id: text("model_id"), num_stages: Number(data.get("num_stages")),
        first_site: text("first_site"), last_site: text("last_site") };
      const button = form.querySelector("button[type=submit]");
      button.disabled = true;
      try {
        const { model } = await postJson("/models", body);
        this.toast(`Deploying ${model.model_id} on ${model.num_stages} stage(s): ${model.state}`, "ok");
        form.reset();
        this.onChange();
      } catch (err) {
        this.failed("Deploy failed", err);
      } finally {
        button.disabled = false;
      }
    });
  }
}

/** Deployed models with their state, and a Re-plan button each for an operator. */
export class ModelsTable {
  constructor(tbody, actions) {
    this.tbody = tbody;
    this.actions = actions;
    this.signature = "";
  }

  update(view) {
    const models = modelRows(view);
    const signature = JSON.stringify([this.actions.canOperate, models]);
    if (signature === this.signature) return;
    this.signature = signature;
    const empty = el("tr", { class: "empty-row" }, el("td", { colspan: 9,
      text: this.actions.canOperate ? "No model deployed yet: use the form below." : "No model deployed yet." }));
    this.tbody.replaceChildren(...(models.length ? models.map((m) => this.row(m)) : [empty]));
  }

  row(m) {
    const sites = [m.first_site && `first ${m.first_site}`, m.last_site && `last ${m.last_site}`]
      .filter(Boolean).join(" · ");
    return el("tr", { "data-testid": "model-row", "data-model-id": m.model_id },
      el("td", {}, el("div", { class: "strong", text: m.model_id }),
        el("div", { class: "mono muted small", title: m.path || "", text: m.path || "" })),
      el("td", {}, el("span", { class: `badge ${stateClass(m.state)}`, text: m.state || "?" }),
        ...(m.load_errors || []).map((e) => el("div", { class: "small load-error", "data-testid": "load-error",
          title: e.error, text: `${e.agent_id} could not load its stage: ${e.error}` }))),
      el("td", { class: "num", text: m.num_layers ?? "–" }),
      el("td", { class: "num", text: m.num_stages ?? "–" }),
      el("td", { class: "small", text: sites || "any" }),
      el("td", { class: "small" }, m.plans.map((p) => el("div", {},
        el("span", { class: `badge ${stateClass(p.state)}`, text: p.state }),
        el("span", { class: "mono muted", text: ` ${p.plan_id}` })))),
      el("td", { class: "small", "data-testid": "model-replicas" }, ...replicasCell(m)),
      el("td", { class: "small", "data-testid": "model-speculation", text: draftsKept(m.speculation) }),
      el("td", { class: "actions" }, this.actions.canOperate ? el("button", { class: "btn small", type: "button",
        "data-testid": "replan-button", "data-model-id": m.model_id,
        title: "weigh the serving plan against the best plan for the agents now",
        onclick: () => this.actions.replan(m.model_id) }, "Re-plan") : null));
  }
}

/** "2 of 3 ready", and for an autoscaled model its bounds, its replicas over time (a step chart: wanted dashed,
 * ready solid), the autoscaler's last decision and its last cold start. */
function replicasCell(m) {
  const count = el("div", { "data-testid": "replicas-count",
    text: `${m.ready_replicas ?? 0} of ${m.num_replicas ?? 0} ready` });
  const rollout = m.rollout ? [rolloutLine(m.rollout)] : [];
  const auto = m.autoscale;
  if (!auto) return [count, ...rollout];
  count.textContent += ` · autoscaled ${auto.min_replicas}–${auto.max_replicas}`;
  const cells = [count];
  if (auto.history && auto.history.length > 1) cells.push(replicasChart(auto.history, auto.max_replicas));
  if (auto.last_decision) {
    cells.push(el("div", { class: "muted small", "data-testid": "autoscale-decision", title: auto.last_decision,
      text: shorten(auto.last_decision, 120) }));
  }
  if (auto.last_cold_start_s !== null && auto.last_cold_start_s !== undefined) {
    cells.push(el("div", { class: "muted small", "data-testid": "cold-start",
      text: `last cold start: ${fmtSeconds(auto.last_cold_start_s)}` }));
  }
  return [...cells, ...rollout];
}

/** A rollout's progress: the canary's share of the requests (a bar) while it runs, how it ended after; its last
 * comparison with the serving revision in the tooltip and below. */
function rolloutLine(r) {
  const revision = String(r.revision || "").slice(0, 12);
  let text;
  if (r.state === "canary") {
    text = `rollout ${revision}: canary ${r.canary_ready ? "serving" : "loading"} · ${r.share}% of requests`;
  } else if (r.state === "promoted") {
    text = `rollout ${revision}: promoted`;
  } else {
    text = `rollout ${revision}: rolled back`;
  }
  return el("div", { class: "small rollout", "data-testid": "rollout-progress", "data-state": r.state,
    title: r.reason || "" },
  el("span", { text }),
  r.state === "canary" ? el("progress", { max: 100, value: r.share, "aria-label": "canary share" }) : null,
  r.reason ? el("div", { class: "muted small", "data-testid": "rollout-reason", text: shorten(r.reason, 120) }) : null);
}

const CHART_W = 140;
const CHART_H = 30;

function replicasChart(history, most) {
  const t0 = history[0].t;
  const span = Math.max(history[history.length - 1].t - t0, 1);
  const x = (t) => (((t - t0) / span) * CHART_W).toFixed(1);
  const y = (n) => (CHART_H - 2 - (n / Math.max(most, 1)) * (CHART_H - 4)).toFixed(1);
  const path = (key) => history.map((p, i) => (i === 0 ? `M${x(p.t)} ${y(p[key])}` : `H${x(p.t)} V${y(p[key])}`))
    .join(" ");
  const peak = Math.max(...history.map((p) => p.ready));
  return svg("svg", { class: "replicas-chart", "data-testid": "replicas-chart", width: CHART_W, height: CHART_H,
    "data-peak-ready": peak, role: "img", "aria-label": `replicas over the last ${Math.round(span)} s` },
  svg("title", {}, `replicas over the last ${Math.round(span)} s: wanted (dashed) and ready; at most ${peak} ready`),
  svg("path", { class: "wanted", d: path("desired") }), svg("path", { class: "ready", d: path("ready") }));
}

/** "60% of 800 drafted": what the model's last stages kept of the tokens drafted for them; "–" before any. */
function draftsKept(speculation) {
  if (!speculation || !speculation.draft_tokens) return "–";
  return `${Math.round(100 * speculation.acceptance_rate)}% of ${speculation.draft_tokens} drafted`;
}

/** Models from /models, or from the plans alone when the coordinator sends no model list. */
function modelRows(view) {
  const plansOf = (id) => view.plans.filter((p) => p.model_id === id)
    .map((p) => ({ plan_id: p.plan_id, state: p.state }));
  const rows = view.models.map((m) => ({ ...m, plans: plansOf(m.model_id) }));
  for (const id of new Set(view.plans.map((p) => p.model_id))) {
    if (!rows.some((m) => m.model_id === id)) {
      const active = view.plans.find((p) => p.model_id === id && p.state === "active");
      rows.push({ model_id: id, state: active ? "ready" : "loading", num_layers: active && active.num_layers,
        num_stages: active && active.stages.length, plans: plansOf(id) });
    }
  }
  return rows;
}
