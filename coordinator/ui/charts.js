"use strict";
// Live line charts over the last five minutes of /stats points: axes, gaps where there was no sample,
// and a crosshair that reads out every series at the hovered second.

import { el, fmtClock, fmtNumber, fmtSeconds, niceTicks, svg } from "./dom.js";
import { STATS_WINDOW_S } from "./state.js";

const HEIGHT = 128;
const MARGIN = { left: 46, right: 8, top: 8, bottom: 18 };

const count = (v) => fmtNumber(v, 0);
/** Axis ticks of a latency: "25 ms", "1.5 s". */
const latencyTick = (v) => (v < 1 ? `${+(v * 1e3).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`);

const CHARTS = [
  { id: "throughput", title: "Throughput", format: (v) => fmtNumber(v), series: [
    { key: "tokens_per_s", label: "tokens/s", colour: "#2f6fd6", area: true },
    { key: "requests_per_s", label: "req/s", colour: "#7a6b58", hidden: true },
  ] },
  { id: "ttft", title: "Time to first token", format: fmtSeconds, tick: latencyTick, series: [
    { key: "ttft_p50_s", label: "p50", colour: "#2a9d6a", area: true },
    { key: "ttft_p99_s", label: "p99", colour: "#d9622b" },
  ] },
  { id: "itl", title: "Inter-token latency", format: fmtSeconds, tick: latencyTick, series: [
    { key: "itl_p50_s", label: "p50", colour: "#168aa3", area: true },
    { key: "itl_p99_s", label: "p99", colour: "#d43f6a" },
  ] },
  { id: "queue", title: "Sequences", format: count, minStep: 1, series: [
    { key: "running", label: "running", colour: "#5b5fd6", area: true },
    { key: "waiting", label: "waiting", colour: "#c4a21b" },
  ] },
];

export class Charts {
  constructor(root) {
    this.charts = CHARTS.map((spec) => new LineChart(root, spec));
  }

  update(view) {
    for (const chart of this.charts) chart.draw(view.stats, view.now);
  }
}

class LineChart {
  constructor(root, spec) {
    this.spec = spec;
    this.points = [];
    this.hoverX = null;
    this.values = el("div", { class: "chart-values" });
    this.svg = svg("svg", { class: "chart-svg", height: HEIGHT });
    this.tooltip = el("div", { class: "tooltip", hidden: true });
    this.plot = el("div", { class: "chart-plot" }, this.svg, this.tooltip);
    root.append(el("div", { class: "chart", "data-testid": "chart", "data-chart": spec.id },
      el("div", { class: "chart-head" }, el("h3", { text: spec.title }), this.values), this.plot));
    this.plot.addEventListener("pointermove", (e) => this.hover(e.clientX - this.plot.getBoundingClientRect().left));
    this.plot.addEventListener("pointerleave", () => this.hover(null));
  }

  draw(points, nowS) {
    this.points = points;
    this.nowS = nowS;
    this.width = Math.max(160, this.plot.clientWidth || 300);
    this.svg.setAttribute("width", this.width);
    this.svg.setAttribute("viewBox", `0 0 ${this.width} ${HEIGHT}`);
    const shown = this.spec.series.filter((s) => !s.hidden);
    const max = Math.max(0, ...points.flatMap((p) => shown.map((s) => p[s.key] ?? 0)));
    this.ticks = niceTicks(0, max || 1, 3, this.spec.minStep || 0);
    this.yMax = this.ticks[this.ticks.length - 1];
    this.svg.replaceChildren(this.axes(), ...shown.map((s) => this.line(s)),
      (this.hoverLayer = svg("g", { class: "hover" })));
    this.drawValues(points[points.length - 1]);
    if (this.hoverX !== null) this.hover(this.hoverX);
  }

  x(t) {
    const inner = this.width - MARGIN.left - MARGIN.right;
    return MARGIN.left + ((t - (this.nowS - STATS_WINDOW_S)) / STATS_WINDOW_S) * inner;
  }

  y(v) {
    const inner = HEIGHT - MARGIN.top - MARGIN.bottom;
    return MARGIN.top + inner - (v / this.yMax) * inner;
  }

  axes() {
    const g = svg("g", { class: "axes" });
    const right = this.width - MARGIN.right;
    for (const tick of this.ticks) {
      const y = this.y(tick);
      g.append(svg("line", { class: "grid", x1: MARGIN.left, x2: right, y1: y, y2: y }),
        svg("text", { class: "tick", x: MARGIN.left - 5, y: y + 3, "text-anchor": "end",
          text: tick === 0 ? "0" : (this.spec.tick || this.spec.format)(tick) }));
    }
    for (let m = 5; m >= 0; m -= 1) {
      const x = this.x(this.nowS - m * 60);
      g.append(svg("text", { class: "tick", x, y: HEIGHT - 4, "text-anchor": m === 0 ? "end" : "middle",
        text: m === 0 ? "now" : `-${m}m` }));
    }
    return g;
  }

  /** One series as a path broken where a value is missing or seconds were skipped. */
  line(series) {
    const runs = [];
    let run = [];
    let prevT = null;
    for (const p of this.points) {
      const v = p[series.key];
      const gap = prevT !== null && p.t - prevT > 5;
      if (v === null || v === undefined || gap) { if (run.length) runs.push(run); run = []; }
      if (v !== null && v !== undefined) run.push([this.x(p.t), this.y(v)]);
      prevT = p.t;
    }
    if (run.length) runs.push(run);
    const g = svg("g", { class: "series" });
    const base = this.y(0);
    for (const r of runs) {
      const d = r.map(([x, y], i) => `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`).join("");
      if (series.area) {
        g.append(svg("path", { class: "area", fill: series.colour,
          d: `M${r[0][0].toFixed(1)},${base}${d.replace(/^M/, "L")}L${r[r.length - 1][0].toFixed(1)},${base}Z` }));
      }
      g.append(r.length > 1 ? svg("path", { class: "stroke", stroke: series.colour, d })
        : svg("circle", { cx: r[0][0], cy: r[0][1], r: 2, fill: series.colour }));   // a lone sample
    }
    return g;
  }

  drawValues(last) {
    this.values.replaceChildren(...this.spec.series.map((s) => el("span", { class: "chart-value" },
      s.hidden ? null : el("i", { class: "swatch", style: `background:${s.colour}` }),
      el("span", { class: "muted", text: `${s.label} ` }),
      el("b", { text: last ? this.spec.format(last[s.key]) : "–" }))));
  }

  /** Crosshair and read-out at the point nearest to pixel x; null hides them. */
  hover(px) {
    this.hoverX = px;
    const nearest = px === null ? null : this.nearest(px);
    this.hoverLayer.replaceChildren();
    if (!nearest) { this.tooltip.hidden = true; return; }
    const x = this.x(nearest.t);
    this.hoverLayer.append(svg("line", { class: "crosshair", x1: x, x2: x, y1: MARGIN.top, y2: HEIGHT - MARGIN.bottom }));
    for (const s of this.spec.series.filter((s) => !s.hidden && nearest[s.key] != null)) {
      this.hoverLayer.append(svg("circle", { cx: x, cy: this.y(nearest[s.key]), r: 3, fill: s.colour }));
    }
    this.tooltip.replaceChildren(el("div", { class: "muted", text: fmtClock(nearest.t) }),
      ...this.spec.series.map((s) => el("div", {}, `${s.label}: `, el("b", { text: this.spec.format(nearest[s.key]) }))));
    this.tooltip.hidden = false;
    const left = x + 12 + 130 > this.width ? x - 140 : x + 12;
    this.tooltip.style.left = `${Math.max(0, left)}px`;
    this.tooltip.style.top = `${MARGIN.top}px`;
  }

  /** The point nearest to pixel x; null left of the first point (no data there). */
  nearest(px) {
    if (!this.points.length || px < this.x(this.points[0].t) - 12) return null;
    let best = null;
    let bestDist = Infinity;
    for (const p of this.points) {
      const d = Math.abs(this.x(p.t) - px);
      if (d < bestDist) { best = p; bestDist = d; }
    }
    return best;
  }
}
