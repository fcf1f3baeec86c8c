"use strict";
// The agents table: a page of agents at a time from the agents API (behind a search box and site and state
// filters), one row per agent with its devices, live load and, for an operator, a Drain action. Rows take the live
// stream's record of an agent where it has one (it is newer), and the page is fetched again every few seconds for
// the others. Rows and cells are kept and only changed cells rebuilt, so a button under the pointer survives the
// next update.

import { agentColour, agentLabel, el, fmtAgo, fmtBytes, fmtNumber, stateClass, DOWN_STATES } from "./dom.js";
import { AgentPager } from "./pager.js";
import { deviceSummary } from "./topology.js";

const STALE_S = 10;   // telemetry older than this is shown as stale
const PAGE_SIZE = 50;
const SEARCH_DELAY_MS = 250;
const STATES = ["online", "connected", "disconnected", "resting", "drained", "dead"];

const COLUMNS = [agentCell, siteCell, stateCell, deviceCell, ramCell, kvCell, tpsCell, queueCell, servesCell, drainCell];

export class AgentsTable {
  constructor({ tbody, hint, filters, pager }, actions) {
    this.tbody = tbody;
    this.hint = hint;
    this.filters = filters;     // the form: q, site, state
    this.pagerRoot = pager;
    this.actions = actions;
    this.view = null;
    this.sites = "";            // the site names the filter offers, joined
    this.pager = new AgentPager(PAGE_SIZE, () => this.draw());
    filters.state.replaceChildren(el("option", { value: "" }, "any state"),
      ...STATES.map((state) => el("option", { value: state }, state)));
    let typing = 0;
    filters.addEventListener("submit", (event) => event.preventDefault());
    filters.addEventListener("change", () => this.pager.show(this.chosen()));
    filters.q.addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => this.pager.show(this.chosen()), SEARCH_DELAY_MS);
    });
  }

  /** Signed in: the first page. */
  start() {
    this.pager.show(this.chosen());
  }

  /** Signed out: no rows, and no answer still to come is shown. */
  stop() {
    this.pager.stop();
    this.draw();
  }

  /** The page shown, fetched again: the newest state and load of agents the live stream does not hold. */
  refresh() {
    if (this.pager.page) this.pager.reload();
  }

  update(view) {
    this.view = view;
    this.offerSites(view.sites.map((s) => s.site));
    this.draw();
  }

  /** The filters as the agents API takes them (null: any); the site menu's "(no site)" is "". */
  chosen() {
    const site = this.filters.site.selectedOptions[0];
    return { q: this.filters.q.value.trim() || null, state: this.filters.state.value || null,
      site: !site || site.dataset.all !== undefined ? null : site.value };
  }

  offerSites(names) {
    const joined = names.join("\n");
    if (joined === this.sites) return;
    this.sites = joined;
    const select = this.filters.site;
    const current = select.selectedOptions[0];
    const keep = current && current.dataset.all === undefined ? current.value : null;
    select.replaceChildren(el("option", { value: "", "data-all": "" }, "all sites"),
      ...names.map((name) => el("option", { value: name, selected: name === keep }, name || "(no site)")));
  }

  draw() {
    const view = this.view;
    const page = this.pager.page;
    if (!view || !page) {
      this.tbody.replaceChildren();
      this.pagerRoot.replaceChildren();
      return;
    }
    const agents = page.agents.map((a) => view.agentsById.get(a.agent_id) || a);
    const rows = new Map([...this.tbody.children].map((tr) => [tr.dataset.agentId, tr]));
    const wanted = agents.map((agent) => this.row(rows.get(agent.agent_id), agent, view));
    if (!agents.length) {
      const filtered = Object.values(this.chosen()).some((v) => v !== null);
      wanted.push(el("tr", { class: "empty-row" }, el("td", { colspan: COLUMNS.length,
        text: filtered ? "No agent matches." : "No agents." })));
    }
    const same = wanted.length === this.tbody.children.length && wanted.every((tr, i) => this.tbody.children[i] === tr);
    if (!same) this.tbody.replaceChildren(...wanted);
    this.pagerRoot.replaceChildren(this.pager.controls("agents"));
    const gpus = view.sites.reduce((n, s) => n + (s.num_gpus || 0), 0);
    const plural = (n, word) => `${n.toLocaleString("en")} ${word}${n === 1 ? "" : "s"}`;
    this.hint.textContent = `${plural(view.num_agents, "agent")} · ${plural(gpus, "GPU")}`;
  }

  row(tr, agent, view) {
    if (!tr) {
      tr = el("tr", { "data-testid": "agent-row", "data-agent-id": agent.agent_id },
        ...COLUMNS.map(() => el("td")));
    }
    tr.dataset.state = agent.state;
    tr.classList.toggle("down", DOWN_STATES.has(agent.state));
    const ctx = { agent, view, actions: this.actions, caps: agent.capabilities || {},
      telemetry: liveTelemetry(agent, view) };
    COLUMNS.forEach((column, i) => {
      const { sig, cls, make } = column(ctx);
      const td = tr.children[i];
      if (td.dataset.sig === sig) return;
      td.dataset.sig = sig;
      td.className = cls || "";
      td.replaceChildren(...[make()].flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
    });
    return tr;
  }
}

/** The newest telemetry, or null when there is none or it is stale (then live columns show "–"). */
function liveTelemetry(agent, view) {
  const t = agent.telemetry;
  if (!t) return null;
  const age = view.now - (t.received || t.unix_s || 0);
  return age > STALE_S || DOWN_STATES.has(agent.state) ? null : t;
}

/** A thin bar with its text; levels=false for GPU memory, which inference engines fill on purpose. */
function meter(fraction, text, title, levels = true) {
  const pct = Math.max(0, Math.min(1, fraction || 0)) * 100;
  const level = !levels ? "" : pct >= 90 ? "high" : pct >= 70 ? "mid" : "";
  return el("div", { class: "meter-cell", title: title || "" },
    el("div", { class: `meter ${level}` }, el("span", { style: `width:${pct.toFixed(1)}%` })),
    el("span", { class: "meter-text", text }));
}

function agentCell({ agent }) {
  const name = agentLabel(agent, agent.agent_id);
  return { sig: `${name}|${agent.address}`, make: () => el("div", { class: "agent-name" },
    el("i", { class: "swatch", style: `background:${agentColour(agent.agent_id)}` }),
    el("div", {}, el("div", { class: "strong", "data-testid": "agent-name", text: name }),
      el("div", { class: "mono muted small", title: agent.address || "", text: agent.agent_id }))) };
}

function siteCell({ caps }) {
  const tier = caps.tier || "edge";
  return { sig: `${caps.site}|${tier}`, cls: "nowrap", make: () => [el("span", { text: caps.site || "—" }), " ",
    el("span", { class: `tag tier-${tier === "cloud" ? "cloud" : "edge"}`, text: tier })] };
}

function stateCell({ agent, view }) {
  const since = agent.state_since ? fmtAgo(agent.state_since, view.now) : "";
  const coarse = since.endsWith("s") ? "<1m" : since;   // seconds would rebuild the cell every snapshot
  return { sig: `${agent.state}|${coarse}`, cls: "nowrap", make: () => [
    el("span", { class: `badge ${stateClass(agent.state)}`, "data-testid": "agent-state", text: agent.state }),
    el("span", { class: "muted small", title: "in this state for", text: ` ${coarse}` })] };
}

function deviceCell({ caps, telemetry }) {
  const gpus = gpusOf(caps, telemetry);
  if (!gpus.length) {
    return { sig: `cpu|${caps.num_cpus}|${caps.cpu_model}`, make: () => [
      el("div", { text: deviceSummary(caps) }), el("div", { class: "muted small", text: caps.cpu_model || "" })] };
  }
  return { sig: JSON.stringify(gpus), make: () => gpus.length > 1 ? gpuSummary(gpus) : gpuLine(gpus[0]) };
}

/** Capability GPUs with the live readings from telemetry laid over them (matched by index). */
function gpusOf(caps, telemetry) {
  const live = new Map(((telemetry && telemetry.gpus) || []).map((g) => [g.index, g]));
  return (caps.gpus || []).map((g) => ({ ...g, ...(live.get(g.index) || {}) }));
}

function gpuReadings(g) {
  return [g.utilization_pct != null ? `${fmtNumber(g.utilization_pct, 0)}%` : null,
    g.temperature_c != null ? `${fmtNumber(g.temperature_c, 0)}°C` : null,
    g.power_w != null ? `${fmtNumber(g.power_w, 0)} W` : null].filter(Boolean).join(" · ");
}

function gpuLine(g) {
  const used = g.mem_total_bytes - g.mem_free_bytes;
  return el("div", { class: "gpu", "data-testid": "gpu" },
    el("div", { class: "gpu-head" }, el("span", { text: String(g.name || "GPU").replace(/^NVIDIA\s+/i, "") }),
      el("span", { class: "muted small", text: gpuReadings(g) })),
    meter(used / g.mem_total_bytes, `${fmtBytes(used)} / ${fmtBytes(g.mem_total_bytes)}`, "GPU memory used", false));
}

function gpuSummary(gpus) {
  const total = gpus.reduce((n, g) => n + g.mem_total_bytes, 0);
  const used = gpus.reduce((n, g) => n + g.mem_total_bytes - g.mem_free_bytes, 0);
  const utils = gpus.map((g) => g.utilization_pct).filter((v) => v != null);
  const temps = gpus.map((g) => g.temperature_c).filter((v) => v != null);
  const readings = [utils.length ? `avg ${fmtNumber(utils.reduce((a, b) => a + b, 0) / utils.length, 0)}%` : null,
    temps.length ? `max ${fmtNumber(Math.max(...temps), 0)}°C` : null].filter(Boolean).join(" · ");
  const title = gpus.map((g) => `#${g.index} ${g.name}: ${gpuReadings(g)}`).join("\n");
  return el("div", { class: "gpu", "data-testid": "gpu", title },
    el("div", { class: "gpu-head" }, el("span", { text: deviceSummary({ gpus }) }),
      el("span", { class: "muted small", text: readings })),
    meter(used / total, `${fmtBytes(used)} / ${fmtBytes(total)}`, "GPU memory used, all GPUs", false));
}

function ramCell({ caps }) {
  const total = caps.ram_total_bytes || 0;
  const used = total - (caps.ram_available_bytes || 0);
  const text = total ? `${fmtBytes(used)} / ${fmtBytes(total)}` : "–";
  return { sig: text, make: () => (total ? meter(used / total, text, "RAM used") : text) };
}

function kvCell({ telemetry }) {
  const stages = (telemetry && telemetry.stages) || [];
  const used = stages.reduce((n, s) => n + (s.kv_blocks_used || 0), 0);
  const total = stages.reduce((n, s) => n + (s.kv_blocks_total || 0), 0);
  if (!total) return { sig: "none", make: () => el("span", { class: "muted", text: "–" }) };
  const pct = (100 * used) / total;
  const text = `${pct < 10 && pct > 0 ? pct.toFixed(1) : pct.toFixed(0)}%`;
  return { sig: `${used}/${total}`, make: () => meter(used / total, text, `${used} of ${total} KV blocks in use`) };
}

function tpsCell({ telemetry }) {
  const text = telemetry ? fmtNumber(telemetry.tokens_per_s) : "–";
  return { sig: text, cls: "num", make: () => el("span", { "data-testid": "agent-tps", text }) };
}

function queueCell({ telemetry }) {
  if (!telemetry) return { sig: "–", cls: "num", make: () => "–" };
  const running = (telemetry.stages || []).reduce((n, s) => n + (s.num_running || 0), 0);
  const waiting = (telemetry.stages || []).reduce((n, s) => n + (s.num_waiting || 0), 0);
  return { sig: `${telemetry.queue_depth}|${running}|${waiting}`, cls: "num", make: () => el("span",
    { title: `queue depth ${telemetry.queue_depth}: ${running} running · ${waiting} waiting in the stage schedulers` },
    fmtNumber(telemetry.queue_depth, 0),
    running ? el("span", { class: "muted small", text: ` · ${running} run` }) : null) };
}

function servesCell({ agent, view }) {
  const stages = view.serving.get(agent.agent_id) || [];
  const items = stages.map((s) => `${s.model_id} [${s.start_layer}, ${s.end_layer})`
    + (s.tp_degree > 1 ? ` TP=${s.tp_degree}` : "") + (s.plan_state === "active" ? "" : ` (${s.plan_state})`));
  return { sig: items.join("|"), make: () => (items.length
    ? items.map((t) => el("div", { class: "mono small", text: t }))
    : el("span", { class: "muted", text: "spare" })) };
}

function drainCell({ agent, view, actions }) {
  const drain = view.drains.get(agent.agent_id);
  const busy = drain && ["moving_stages", "moving_sessions"].includes(drain.state);
  const serving = (view.serving.get(agent.agent_id) || []).length > 0;
  const disabled = busy || !serving || DOWN_STATES.has(agent.state);
  const why = busy ? "a drain is under way" : DOWN_STATES.has(agent.state) ? `agent is ${agent.state}`
    : !serving ? "serves no stage" : "move its stages and sessions to spares, then let it exit";
  const status = drain ? drainText(drain) : "";
  const button = actions.canOperate;    // a viewer sees how a drain goes, not a button to start one
  return { sig: `${button}|${disabled}|${why}|${status}`, cls: "actions", make: () => [
    button && el("button", { class: "btn small danger-outline", type: "button", "data-testid": "drain-button",
      "data-agent-id": agent.agent_id, disabled, title: why, onclick: () => actions.drain(agent.agent_id) }, "Drain"),
    status ? el("div", { class: `small drain-${drain.state}`, "data-testid": "drain-status",
      "data-drain-state": drain.state, title: drain.error || "", text: status }) : null] };
}

function drainText(drain) {
  const moved = (drain.stages || []).length;
  switch (drain.state) {
    case "moving_stages": return "moving stages…";
    case "moving_sessions": return `moving sessions (${drain.sessions_asked || 0})…`;
    case "drained": return `${drain.rest ? `resting (${drain.rest})` : "drained"} · ${moved} stage${moved === 1 ? "" : "s"} moved`;
    case "failed": return `drain failed: ${drain.error || "?"}`;
    default: return drain.state;
  }
}
