"use strict";
// The admin UI's entry point: signs the user in (login.js), then holds the state, keeps it live (server-sent
// snapshots, polling when the stream is down) and hands each update to the panels. Signed out, nothing runs.

import { API, getJson, seg } from "./api.js";
import { assignColours, el, fmtNumber, fmtSeconds } from "./dom.js";
import { appendStats, deriveView, emptySnapshot, normalise, STATS_WINDOW_S } from "./state.js";
import { Charts } from "./charts.js";
import { Topology } from "./topology.js";
import { Placement } from "./placement.js";
import { AgentsTable } from "./agents.js";
import { RequestsPanel } from "./trace.js";
import { Actions, ModelsTable } from "./actions.js";
import { EventsLog } from "./events.js";
import { Auth } from "./login.js";

const STREAM_FRESH_MS = 4000;   // a stream that sent nothing for this long is treated as down
const POLL_EVERY_MS = 2000;
const STREAM_RETRY_MS = 10000;  // reopen a closed EventSource this often
const REQUESTS_EVERY_MS = 3000;

const $ = (id) => document.getElementById(id);

const state = {
  snapshot: emptySnapshot(),
  stats: [],               // oldest first, the last STATS_WINDOW_S seconds
  drains: new Map(),       // agent id -> newest DrainStatus
};

const actions = new Actions({ toasts: $("toasts"), dialog: $("confirm"), onChange: () => feed.pollSoon() });
actions.noteDrain = (drain) => { state.drains.set(drain.agent_id, drain); render(); };

const panels = [
  new Charts($("charts-body")),
  new Topology($("topology-body")),
  new Placement($("placement-body")),
  new AgentsTable($("agents-body"), $("agents-hint"), actions),
  new ModelsTable($("models-body"), actions),
  new EventsLog($("events-body")),
];
const requests = new RequestsPanel($("requests-body"), $("trace-body"));

function onSnapshot(raw) {
  const snapshot = normalise(raw);
  assignColours(snapshot.agents);
  for (const drain of snapshot.drains) state.drains.set(drain.agent_id, drain);
  state.snapshot = snapshot;
  appendStats(state.stats, snapshot.stats, snapshot.ts || Date.now() / 1000);
  render();
}

function render() {
  const view = deriveView(state.snapshot, state.stats, state.drains);
  actions.view = view;
  renderSummary(view);
  for (const panel of panels) {
    try {
      panel.update(view);
    } catch (err) {
      console.error("panel update failed", panel.constructor.name, err);   // one bad panel keeps the rest alive
    }
  }
  requests.setView(view);
}

function renderSummary(view) {
  const up = view.agents.filter((a) => ["online", "connected", "ready"].includes(a.state)).length;
  const last = view.stats.length ? view.stats[view.stats.length - 1] : null;
  const tile = (label, value, testid) => el("div", { class: "tile", "data-testid": testid },
    el("span", { class: "tile-value", text: value }), el("span", { class: "tile-label", text: label }));
  $("summary").replaceChildren(
    tile("agents up", `${up}/${view.agents.length}`, "summary-agents"),
    tile("models", String(view.models.length || new Set(view.plans.map((p) => p.model_id)).size), "summary-models"),
    tile("tok/s", fmtNumber(last ? last.tokens_per_s : null), "summary-tps"),
    tile("running · waiting", last ? `${last.running ?? "–"} · ${last.waiting ?? "–"}` : "–", "summary-queue"),
    tile("TTFT p50", fmtSeconds(last ? last.ttft_p50_s : null), "summary-ttft"),
  );
}

/** Keeps snapshots coming: an EventSource on /stream, and polling of the plain endpoints while it is down. */
class Feed {
  constructor(onData, indicator) {
    this.onData = onData;
    this.indicator = indicator;
    this.source = null;
    this.lastStreamAt = 0;
    this.lastPollOkAt = 0;
    this.lastPollAt = 0;
    this.streamOpenedAt = 0;
    this.polling = false;
    this.running = false;
    this.timer = 0;
  }

  start() {
    this.stop();
    this.running = true;
    this.lastStreamAt = this.lastPollOkAt = this.lastPollAt = 0;
    this.openStream();
    this.timer = setInterval(() => this.tick(), 1000);
    this.show();
  }

  /** Closes the stream and stops polling (signed out: every call would get a 401). */
  stop() {
    this.running = false;
    clearInterval(this.timer);
    if (this.source) this.source.close();
    this.source = null;
  }

  openStream() {
    if (this.source) this.source.close();
    this.streamOpenedAt = Date.now();
    this.source = new EventSource(`${API}/stream`);
    this.source.addEventListener("snapshot", (event) => {
      if (!this.running) return;
      this.lastStreamAt = Date.now();
      this.show();
      try {
        this.onData(JSON.parse(event.data));
      } catch (err) {
        console.error("bad snapshot", err);
      }
    });
    this.source.onerror = () => {
      if (!this.running) return;
      // Refused outright: poll at once. EventSource cannot say why; a 401 from the poll ends the session.
      if (this.source.readyState === EventSource.CLOSED) this.poll();
      this.show();
    };
  }

  tick() {
    const now = Date.now();
    const streamClosed = this.source && this.source.readyState === EventSource.CLOSED;
    if (streamClosed && now - this.streamOpenedAt > STREAM_RETRY_MS) this.openStream();
    // Poll while the stream is quiet; give a fresh stream a moment to send its first snapshot.
    const quiet = now - this.lastStreamAt > STREAM_FRESH_MS && now - this.streamOpenedAt > 2500;
    if (quiet && now - this.lastPollAt >= POLL_EVERY_MS) this.poll();
    this.show();
  }

  /** After an action: fetch once now rather than wait for the next snapshot. */
  pollSoon() {
    setTimeout(() => this.poll(), 300);
  }

  async poll() {
    if (this.polling || !this.running) return;
    this.polling = true;
    this.lastPollAt = Date.now();
    try {
      const snapshot = await pollSnapshot();
      if (!this.running) return;
      this.onData(snapshot);
      this.lastPollOkAt = Date.now();
    } catch (err) {
      console.warn("poll failed:", err.message);
    } finally {
      this.polling = false;
      this.show();
    }
  }

  show() {
    const now = Date.now();
    let mode = "reconnecting";
    if (now - this.lastStreamAt < STREAM_FRESH_MS) mode = "live";
    else if (now - this.lastPollOkAt < STREAM_FRESH_MS) mode = "polling";
    else if (!this.lastStreamAt && !this.lastPollOkAt) mode = "connecting";
    if (this.indicator.dataset.state !== mode) {
      this.indicator.dataset.state = mode;
      this.indicator.querySelector(".conn-text").textContent = mode;
      this.indicator.title = mode === "live" ? "receiving snapshots over server-sent events"
        : mode === "polling" ? "the event stream is down: polling the JSON API" : "";
    }
  }
}

/** A snapshot assembled from the plain endpoints (what /stream would have sent). */
async function pollSnapshot() {
  const optional = (path, key) => getJson(path).then((d) => d[key]).catch(() => null);
  const [agents, plans, links, models, events, stats] = await Promise.all([
    getJson("/agents").then((d) => d.agents),
    getJson("/plans").then((d) => d.plans),
    optional("/links", "links"), optional("/models", "models"), optional("/events?limit=20", "events"),
    optional("/stats?seconds=5", "points"),
  ]);
  const unfinished = [...state.drains.values()].filter((d) => !["drained", "failed"].includes(d.state));
  const drains = await Promise.all(unfinished.map(
    (d) => getJson(`/agents/${seg(d.agent_id)}/drain`).then((r) => r.drain).catch(() => d)));
  const newest = stats && stats.length ? stats[stats.length - 1] : null;
  return { ts: newest ? newest.t : Date.now() / 1000, agents, plans, links, models, events, drains, stats: newest };
}

async function loadStatsHistory() {
  try {
    const data = await getJson(`/stats?seconds=${STATS_WINDOW_S}`);
    if (!feed.running) return;
    const now = data.points.length ? data.points[data.points.length - 1].t : Date.now() / 1000;   // coordinator clock
    // Points that arrived on the stream meanwhile are newer: keep them after the history.
    const newer = state.stats.filter((p) => !data.points.length || p.t > data.points[data.points.length - 1].t);
    state.stats.length = 0;
    for (const point of [...data.points, ...newer]) appendStats(state.stats, point, now);
    render();
  } catch (err) {
    console.warn("no stats history:", err.message);
  }
}

function setUpTheme() {
  const stored = localStorage.getItem("stratamesh-theme");
  const dark = stored ? stored === "dark" : window.matchMedia("(prefers-color-scheme: dark)").matches;
  document.documentElement.dataset.theme = dark ? "dark" : "light";
  $("theme-toggle").addEventListener("click", () => {
    const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    document.documentElement.dataset.theme = next;
    localStorage.setItem("stratamesh-theme", next);
  });
}

const feed = new Feed(onSnapshot, $("conn"));
const dashboard = ["dashboard", "jump", "summary", "conn"].map($);
let requestsTimer = 0;

/** Signed in: show the panels (and the operator's controls to an operator only) and keep them live. */
function startDashboard(user) {
  actions.setRole(user.role);
  $("deploy-form").hidden = !actions.canOperate;
  for (const node of dashboard) node.hidden = false;
  render();
  feed.start();
  loadStatsHistory();
  requests.refresh();
  clearInterval(requestsTimer);
  requestsTimer = setInterval(() => { if (!document.hidden) requests.refresh(); }, REQUESTS_EVERY_MS);
}

/** Signed out: stop every call and forget what was shown. */
function stopDashboard() {
  feed.stop();
  clearInterval(requestsTimer);
  for (const node of dashboard) node.hidden = true;
  if ($("confirm").open) $("confirm").close("cancel");
  state.snapshot = emptySnapshot();
  state.stats.length = 0;
  state.drains.clear();
  actions.setRole(null);
  render();
  requests.clear();
}

const auth = new Auth({
  panel: $("login"), form: $("login-form"), note: $("login-note"), error: $("login-error"), who: $("who"),
  name: $("who-name"), role: $("who-role"), logout: $("logout"), banner: $("insecure-banner"),
}, { onSignIn: startDashboard, onSignOut: stopDashboard, onError: (message) => actions.toast(message, "error") });

setUpTheme();
actions.mountDeployForm($("deploy-form"));
window.addEventListener("resize", () => { if (auth.state === "in") render(); });
auth.start();
