"use strict";
// Recent requests, and the trace of the one picked as a timeline: a row per stage (and the origin),
// a bar per span (queue, compute, send ...), hover for its attributes, drag to zoom into a range.

import { getJson, seg } from "./api.js";
import { agentLabel, el, fmtClock, fmtNumber, fmtSeconds, niceTicks, shorten, stateClass, svg } from "./dom.js";

const LABEL_W = 150;
const ROW_H = 22;
const AXIS_H = 20;
const KINDS = ["request", "open", "queue", "compute", "send"];

export class RequestsPanel {
  constructor(tbody, traceRoot) {
    this.tbody = tbody;
    this.traceRoot = traceRoot;
    this.view = null;
    this.selected = null;
    this.selectedRunning = false;
    this.timeline = null;
  }

  setView(view) {
    this.view = view;
  }

  /** Signed out: no rows, no trace. */
  clear() {
    this.selected = null;
    this.selectedRunning = false;
    this.timeline = null;
    this.tbody.replaceChildren();
    this.traceRoot.replaceChildren(el("p", { class: "empty", text: "Pick a request to see its timeline." }));
  }

  async refresh() {
    let requests;
    try {
      requests = (await getJson("/requests?limit=40")).requests;
    } catch (err) {
      return;   // the connection indicator already says the coordinator is unreachable
    }
    this.renderRows(requests);
    if (this.selected && this.selectedRunning) this.select(this.selected, true);
  }

  renderRows(requests) {
    if (!requests.length) {
      this.tbody.replaceChildren(el("tr", { class: "empty-row" }, el("td", { colspan: 7, text: "No requests yet." })));
      return;
    }
    this.tbody.replaceChildren(...requests.map((r) => this.row(r)));
  }

  row(r) {
    const startS = r.start_unix_ns / 1e9;
    const endS = r.end_unix_ns ? r.end_unix_ns / 1e9 : Date.now() / 1000;
    const tr = el("tr", { class: `clickable${r.request_id === this.selected ? " selected" : ""}`,
      "data-testid": "request-row", "data-request-id": r.request_id, title: r.error || r.request_id, tabindex: 0,
      onclick: () => this.select(r.request_id), onkeydown: (e) => { if (e.key === "Enter") this.select(r.request_id); } },
      el("td", { class: "mono small", text: fmtClock(startS) }),
      el("td", { class: "mono small", text: shorten(r.request_id.replace(/^(chat)?cmpl-/, ""), 12) }),
      el("td", {}, el("span", { class: `badge ${stateClass(r.state)}`, text: r.state })),
      el("td", { class: "num", text: fmtNumber(r.num_prompt_tokens, 0) }),
      el("td", { class: "num", text: fmtNumber(r.num_tokens, 0) }),
      el("td", { class: "num", text: fmtSeconds(endS - startS) }),
      el("td", { class: "num small", text: `${r.num_failovers || 0}/${r.num_moves || 0}/${r.num_preemptions || 0}` }));
    tr.dataset.state = r.state;
    return tr;
  }

  async select(requestId, quiet = false) {
    this.selected = requestId;
    for (const tr of this.tbody.children) tr.classList.toggle("selected", tr.dataset.requestId === requestId);
    try {
      const trace = await getJson(`/requests/${seg(requestId)}/trace`);
      if (this.selected !== requestId) return;   // another row was picked meanwhile
      this.selectedRunning = trace.state === "running";
      if (quiet && this.timeline && this.timeline.zoomed()) return;   // don't yank a zoomed view
      this.timeline = new Timeline(trace, this.view);
      this.traceRoot.replaceChildren(this.timeline.root);
      this.timeline.draw();
    } catch (err) {
      this.selectedRunning = false;
      if (!quiet) this.traceRoot.replaceChildren(el("p", { class: "error-text", text: `No trace: ${err.message}` }));
    }
  }
}

/** Rows of the timeline: the request, the origin, each stage; labels name the agent and its layers. */
function rowsOf(trace, view) {
  const rows = new Map();
  const add = (key, label, sub) => {
    if (!rows.has(key)) rows.set(key, { key, label, sub, spans: [] });
    return rows.get(key);
  };
  add("request", "request", "");
  add("origin", "origin", "coordinator");
  for (const hop of trace.route || []) add(`s${hop.stage}`, `stage ${hop.stage}`, stageAgent(hop, trace, view));
  trace.spans.forEach((span, i) => {
    const key = span.stage === null || span.stage === undefined ? (span.name === "request" ? "request" : "other")
      : span.stage === "origin" ? "origin" : `s${span.stage}`;
    const row = add(key, key === "other" ? "other" : `stage ${span.stage}`, "");
    if (!row.sub && key.startsWith("s")) row.sub = agentFromSpan(span);
    row.spans.push({ ...span, i });
  });
  const order = (k) => (k === "request" ? -2 : k === "origin" ? -1 : k === "other" ? 1e9 : Number(k.slice(1)));
  return [...rows.values()].filter((r) => r.spans.length || r.key.startsWith("s"))
    .sort((a, b) => order(a.key) - order(b.key));
}

function stageAgent(hop, trace, view) {
  const assignment = view && view.assignments.get(hop.assignment_id);
  if (assignment) {
    const agent = view.agentsById.get(assignment.agent_id);
    return `${agentLabel(agent, assignment.agent_id)} · L${assignment.start_layer}-${assignment.end_layer}`;
  }
  const compute = trace.spans.find((s) => s.stage === hop.stage && s.name === "compute");
  return compute ? agentFromSpan(compute) : hop.address;
}

function agentFromSpan(span) {
  const a = span.attributes || {};
  const id = a["stratamesh.agent"];
  return id ? `${shorten(id, 14)}${a["stratamesh.layers"] ? ` · L${a["stratamesh.layers"]}` : ""}` : "";
}

class Timeline {
  constructor(trace, view) {
    this.trace = trace;
    this.rows = rowsOf(trace, view);
    const starts = trace.spans.map((s) => s.start_unix_ns);
    const ends = trace.spans.map((s) => s.end_unix_ns || s.start_unix_ns);
    this.t0 = Math.min(trace.start_unix_ns || Infinity, ...starts);
    this.t1 = Math.max(trace.end_unix_ns || 0, ...ends, this.t0 + 1e6);
    this.range = [this.t0, this.t1];
    this.svg = svg("svg", { class: "timeline-svg", "data-testid": "trace-timeline" });
    this.tooltip = el("div", { class: "tooltip wide", hidden: true });
    this.plot = el("div", { class: "timeline-plot" }, this.svg, this.tooltip);
    this.root = el("div", { class: "trace" }, this.header(), this.plot, spanLegend(), this.breakdown());
    this.listen();
  }

  zoomed() {
    return this.range[0] !== this.t0 || this.range[1] !== this.t1;
  }

  header() {
    const t = this.trace;
    const firstToken = t.spans.filter((s) => s.attributes && s.attributes["stratamesh.to"] === "origin")
      .reduce((m, s) => Math.min(m, s.end_unix_ns), Infinity);
    const facts = [["request", t.request_id], ["trace", t.trace_id], ["duration", fmtSeconds(t.duration_s)],
      ["first token", isFinite(firstToken) ? `+${fmtSeconds((firstToken - this.t0) / 1e9)}` : "–"],
      ["spans", String(t.spans.length)]];
    return el("div", { class: "trace-head" },
      el("span", { class: `badge ${stateClass(t.state)}`, text: t.state }),
      ...facts.map(([k, v]) => el("span", { class: "fact" },
        el("span", { class: "muted", text: `${k} ` }), el("b", { class: "mono", text: v }))),
      (t.unreachable || []).length ? el("div", { class: "error-text small",
        text: `no spans from: ${t.unreachable.map((u) => (typeof u === "string" ? u : JSON.stringify(u))).join(", ")}`,
      }) : null);
  }

  draw() {
    const width = Math.max(360, this.plot.clientWidth || 600);
    const height = AXIS_H + this.rows.length * ROW_H + 4;
    this.width = width;
    this.svg.setAttribute("width", width);
    this.svg.setAttribute("height", height);
    this.svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const [z0, z1] = this.range;
    const plotW = width - LABEL_W - 8;
    this.x = (ns) => LABEL_W + ((ns - z0) / (z1 - z0)) * plotW;
    this.nsAt = (px) => z0 + ((px - LABEL_W) / plotW) * (z1 - z0);
    const bars = svg("svg", { x: LABEL_W, y: 0, width: plotW, height, overflow: "hidden" });
    const g = svg("g", { transform: `translate(${-LABEL_W},0)` });
    bars.append(g);
    const lanes = [];
    this.rows.forEach((row, r) => {
      const y = AXIS_H + r * ROW_H;
      lanes.push(svg("rect", { class: `lane ${r % 2 ? "odd" : ""}`, x: 0, y, width, height: ROW_H }),
        svg("text", { class: "lane-label", x: 6, y: y + 14, text: row.label }),
        svg("text", { class: "lane-sub", x: 62, y: y + 14, text: shorten(row.sub, 15) }));
      for (const span of row.spans) {
        const x0 = this.x(span.start_unix_ns);
        const x1 = this.x(span.end_unix_ns || span.start_unix_ns);
        const kind = KINDS.includes(span.name) ? span.name : "other";
        const inset = span.name === "request" ? 6 : 4;
        g.append(svg("rect", { class: `span span-${kind}`, x: x0, y: y + inset, width: Math.max(1, x1 - x0),
          height: ROW_H - 2 * inset, "data-i": span.i }));
      }
    });
    this.svg.replaceChildren(...lanes, this.axis(plotW, height), bars,
      (this.brush = svg("rect", { class: "brush", x: 0, y: AXIS_H, width: 0, height: height - AXIS_H,
        visibility: "hidden" })));
  }

  axis(plotW, height) {
    const [z0, z1] = this.range;
    const toMs = (ns) => (ns - this.t0) / 1e6;
    const ticks = niceTicks(toMs(z0), toMs(z1), Math.max(2, Math.floor(plotW / 90)))
      .filter((ms) => ms >= toMs(z0) - 1e-9 && ms <= toMs(z1) + 1e-9);
    const g = svg("g", { class: "axes" });
    for (const ms of ticks) {
      const x = this.x(this.t0 + ms * 1e6);
      g.append(svg("line", { class: "grid", x1: x, x2: x, y1: AXIS_H - 4, y2: height }),
        svg("text", { class: "tick", x, y: AXIS_H - 7, "text-anchor": "middle", text: `${+ms.toFixed(3)} ms` }));
    }
    return g;
  }

  breakdown() {
    const stats = this.rows.filter((r) => r.key !== "request").map((row) => {
      const total = (name) => row.spans.filter((s) => s.name === name).reduce((n, s) => n + (s.duration_s || 0), 0);
      return { row, queue: total("queue"), compute: total("compute"), send: total("send"),
        steps: new Set(row.spans.map((s) => s.step).filter((s) => s !== null && s !== undefined)).size };
    });
    return el("table", { class: "table compact breakdown" },
      el("thead", {}, el("tr", {}, ...["lane", "steps", "queue", "compute", "send"]
        .map((h, i) => el("th", { class: i ? "num" : "", text: h })))),
      el("tbody", {}, ...stats.map((s) => el("tr", {},
        el("td", {}, `${s.row.label} `, el("span", { class: "muted small", text: s.row.sub })),
        el("td", { class: "num", text: String(s.steps) }),
        el("td", { class: "num", text: fmtSeconds(s.queue) }),
        el("td", { class: "num", text: fmtSeconds(s.compute) }),
        el("td", { class: "num", text: fmtSeconds(s.send) })))));
  }

  listen() {
    let dragFrom = null;
    const px = (e) => e.clientX - this.svg.getBoundingClientRect().left;
    this.svg.addEventListener("pointerdown", (e) => {
      if (px(e) < LABEL_W) return;
      dragFrom = px(e);
      this.svg.setPointerCapture(e.pointerId);
    });
    this.svg.addEventListener("pointermove", (e) => {
      if (dragFrom !== null) {
        const [a, b] = [Math.min(dragFrom, px(e)), Math.max(dragFrom, px(e))];
        this.brush.setAttribute("x", a);
        this.brush.setAttribute("width", b - a);
        this.brush.setAttribute("visibility", "visible");
        return;
      }
      this.showSpan(e);
    });
    this.svg.addEventListener("pointerup", (e) => {
      if (dragFrom === null) return;
      const [a, b] = [Math.min(dragFrom, px(e)), Math.max(dragFrom, px(e))];
      dragFrom = null;
      this.brush.setAttribute("visibility", "hidden");
      if (b - a > 4) { this.range = [this.nsAt(Math.max(a, LABEL_W)), this.nsAt(b)]; this.draw(); }
    });
    this.svg.addEventListener("dblclick", () => { this.range = [this.t0, this.t1]; this.draw(); });
    this.svg.addEventListener("pointerleave", () => { this.tooltip.hidden = true; });
  }

  showSpan(e) {
    const i = e.target.dataset && e.target.dataset.i;
    if (i === undefined) { this.tooltip.hidden = true; return; }
    const span = this.trace.spans[Number(i)];
    const attrs = Object.entries(span.attributes || {}).map(([k, v]) => `${k.replace(/^stratamesh\./, "")}: ${v}`);
    this.tooltip.replaceChildren(
      el("div", {}, el("b", { text: span.name }), el("span", { class: "muted",
        text: ` · ${span.stage ?? "—"}${span.step !== null && span.step !== undefined ? ` · step ${span.step}` : ""}`,
      })),
      el("div", { text: `+${fmtSeconds((span.start_unix_ns - this.t0) / 1e9)} for ${fmtSeconds(span.duration_s)}` }),
      ...attrs.map((a) => el("div", { class: "mono small", text: a })));
    this.tooltip.hidden = false;
    const box = this.plot.getBoundingClientRect();
    const x = e.clientX - box.left;
    this.tooltip.style.left = `${Math.min(Math.max(0, x + 14), Math.max(0, box.width - 280))}px`;
    this.tooltip.style.top = `${e.clientY - box.top + 14}px`;
  }
}

function spanLegend() {
  return el("div", { class: "legend" }, ...KINDS.concat("other").map((k) => el("span", { class: "legend-item" },
    el("i", { class: `sw span-${k}` }), k)));
}
