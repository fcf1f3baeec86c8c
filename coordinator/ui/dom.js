"use strict";
// DOM and SVG builders, formatters and agent colours shared by every panel.
// Every string that came from the API reaches the page through text nodes or attributes set here,
// never through innerHTML, so an agent named "<img onerror=...>" is shown, not run.

const SVG_NS = "http://www.w3.org/2000/svg";

/** Sets attributes, listeners (onclick: fn) and children on a node made by el() or svg(). */
function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** el("td", {class: "num", "data-testid": "x"}, "text", otherNode) */
export function el(tag, attrs = {}, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** svg("rect", {x: 1, y: 2}); an SVG <title> child gives a native tooltip. */
export function svg(tag, attrs = {}, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

// ---- formatting -------------------------------------------------------------------------------

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined || !isFinite(bytes)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let v = bytes;
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

/** A link's bandwidth: MB/s below 1 Gbit/s, Gbit/s above. */
export function fmtBandwidth(bytesPerS) {
  if (!bytesPerS || !isFinite(bytesPerS)) return "–";
  const gbit = (bytesPerS * 8) / 1e9;
  if (gbit >= 1) return `${gbit >= 10 ? gbit.toFixed(0) : gbit.toFixed(1)} Gbit/s`;
  const mb = bytesPerS / 1e6;
  return `${mb >= 10 ? mb.toFixed(0) : mb.toFixed(1)} MB/s`;
}

/** Seconds as a latency: "850 µs", "3.2 ms", "1.25 s". */
export function fmtSeconds(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) { const ms = s * 1e3; return `${ms >= 100 ? ms.toFixed(0) : ms.toFixed(ms >= 10 ? 1 : 2)} ms`; }
  return `${s.toFixed(s >= 100 ? 0 : 2)} s`;
}

export function fmtNumber(v, digits = 1) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  if (Math.abs(v) >= 1e6) return `${(v / 1e6).toFixed(1)}M`;
  if (Math.abs(v) >= 1e4) return `${(v / 1e3).toFixed(1)}k`;
  return Number.isInteger(v) ? String(v) : v.toFixed(digits);
}

export function fmtClock(unixS) {
  if (!unixS) return "–";
  return new Date(unixS * 1000).toLocaleTimeString([], { hour12: false });
}

/** "12s", "4m", "3h", "2d" since unixS. */
export function fmtAgo(unixS, nowS = Date.now() / 1000) {
  if (!unixS) return "–";
  const d = Math.max(0, nowS - unixS);
  if (d < 60) return `${d.toFixed(0)}s`;
  if (d < 3600) return `${(d / 60).toFixed(0)}m`;
  if (d < 86400) return `${(d / 3600).toFixed(0)}h`;
  return `${(d / 86400).toFixed(0)}d`;
}

export function shorten(text, maxChars) {
  const s = String(text ?? "");
  return s.length <= maxChars ? s : `${s.slice(0, Math.max(1, maxChars - 1))}…`;
}

// ---- agents -----------------------------------------------------------------------------------

/** An agent's display name: its name if it has one, else its id. */
export function agentLabel(agent, agentId) {
  return (agent && agent.name) || agentId || "?";
}

export const DOWN_STATES = new Set(["dead", "lost", "drained", "disconnected"]);

/** healthy | warn | down | unknown: the colour class of an agent state badge. */
export function stateClass(state) {
  if (["online", "connected", "ready", "active"].includes(state)) return "healthy";
  if (["draining", "moving_stages", "moving_sessions", "loading", "recovering", "waiting", "standby",
    "pending", "running", "resting"].includes(state)) return "warn";
  if (["dead", "lost", "failed", "disconnected"].includes(state)) return "down";
  if (state === "drained" || state === "finished" || state === "scaled_to_zero") return "muted";
  return "unknown";
}

// Colours picked to stay readable under white text, distinct side by side, on light and dark themes.
const PALETTE = ["#3b7dd8", "#e07b28", "#3a9e5c", "#d64550", "#8e5cc7", "#1f9aa8", "#c28f0c", "#d4548e",
  "#5f6fd1", "#6f9a2a", "#a0632f", "#4a8fa8"];
const colours = new Map();

/** Fixes agent colours once, in order of first_seen: a palette slot from a hash of the id, probing on. */
export function assignColours(agents) {
  const fresh = agents.filter((a) => !colours.has(a.agent_id))
    .sort((a, b) => (a.first_seen || 0) - (b.first_seen || 0) || a.agent_id.localeCompare(b.agent_id));
  for (const agent of fresh) agentColour(agent.agent_id);
}

export function agentColour(agentId) {
  if (colours.has(agentId)) return colours.get(agentId);
  const taken = new Set(colours.values());
  let slot = hash(agentId) % PALETTE.length;
  for (let i = 0; i < PALETTE.length && taken.has(PALETTE[slot]); i += 1) slot = (slot + 1) % PALETTE.length;
  if (taken.has(PALETTE[slot])) slot = hash(agentId) % PALETTE.length;   // more agents than colours
  colours.set(agentId, PALETTE[slot]);
  return PALETTE[slot];
}

function hash(text) {
  let h = 2166136261;   // FNV-1a
  for (let i = 0; i < text.length; i += 1) { h ^= text.charCodeAt(i); h = Math.imul(h, 16777619); }
  return h >>> 0;
}

/** "nice" axis ticks from min to a rounded-up max, at least minStep apart (1 for counts). */
export function niceTicks(min, max, count = 4, minStep = 0) {
  if (!(max > min)) max = min + 1;
  const raw = Math.max((max - min) / count, minStep);
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag)
    .find((s) => s >= raw && (!minStep || Number.isInteger(s / minStep)));
  const top = Math.ceil(max / step) * step;
  const ticks = [];
  for (let v = Math.floor(min / step) * step; v <= top + step / 2; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}
