"use strict";
// The admin UI's entry point: signs the user in (login.js), then holds the state, keeps it live (server-sent
// events: a snapshot of the fleet, then what changed; polling when the stream is down) and hands each update to the
// panels. Signed out, nothing runs.

import { API, getJson } from "./api.js";
import { assignColours, el, fmtNumber, fmtSeconds } from "./dom.js";
import { appendStats, deriveView, Fleet, STATS_WINDOW_S } from "./state.js";
import { Charts } from "./charts.js";
import { Topology } from "./topology.js";
import { Placement } from "./placement.js";
import { AgentsTable } from "./agents.js";
import { RequestsPanel } from "./trace.js";
import { Actions, ModelsTable } from "./actions.js";
import { EventsLog } from "./events.js";
import { CoordinatorsPanel } from "./coordinators.js";
import { Auth } from "./login.js";

const STREAM_FRESH_MS = 4000;   // a stream that sent nothing for this long is treated as down
const POLL_EVERY_MS = 2000;
const STREAM_RETRY_MS = 10000;  // reopen a closed EventSource this often
const REQUESTS_EVERY_MS = 3000;
const PAGES_EVERY_MS = 3000;    // pages of agents shown (the table, an opened site) are fetched again this often

const $ = (id) => document.getElementById(id);

const state = {
  fleet: new Fleet(),      // the coordinator's view of the fleet, kept by its stream
  stats: [],               // oldest first, the last STATS_WINDOW_S seconds
  drains: new Map(),       // agent id -> newest DrainStatus
};

const actions = new Actions({ toasts: $("toasts"), dialog: $("confirm"), onChange: () => {
  feed.pollSoon();
  agentsTable.refresh();
} });
actions.noteDrain = (drain) => { state.drains.set(drain.agent_id, drain); render(); };

const topology = new Topology($("topology-body"));
const agentsTable = new AgentsTable({ tbody: $("agents-body"), hint: $("agents-hint"), filters: $("agents-filters"),
  pager: $("agents-pager") }, actions);
const panels = [
  new Charts($("charts-body")),
  topology,
  new Placement($("placement-body")),
  agentsTable,
  new ModelsTable($("models-body"), actions),
  new EventsLog($("events-body")),
];
const requests = new RequestsPanel($("requests-body"), $("trace-body"));
const coordinators = new CoordinatorsPanel($("coordinators-body"), $("coordinators-lease"));

/** A snapshot (the stream's first event, or a poll) replaces the fleet; a delta changes it. */
function onUpdate(kind, data) {
  if (kind === "snapshot") state.fleet.applySnapshot(data); else state.fleet.applyDelta(data);
  const fleet = state.fleet;
  assignColours([...fleet.agents.values()]);
  for (const drain of fleet.drains) state.drains.set(drain.agent_id, drain);
  appendStats(state.stats, fleet.stats, fleet.ts || Date.now() / 1000);
  render();
}

function render() {
  const view = deriveView(state.fleet.snapshot(), state.stats, state.drains);
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
  const last = view.stats.length ? view.stats[view.stats.length - 1] : null;
  const tile = (label, value, testid) => el("div", { class: "tile", "data-testid": testid },
    el("span", { class: "tile-value", text: value }), el("span", { class: "tile-label", text: label }));
  $("summary").replaceChildren(
    tile("agents up", `${view.numUp}/${view.num_agents}`, "summary-agents"),
    tile("models", String(view.models.length || new Set(view.plans.map((p) => p.model_id)).size), "summary-models"),
    tile("tok/s", fmtNumber(last ? last.tokens_per_s : null), "summary-tps"),
    tile("running · waiting", last ? `${last.running ?? "–"} · ${last.waiting ?? "–"}` : "–", "summary-queue"),
    tile("TTFT p50", fmtSeconds(last ? last.ttft_p50_s : null), "summary-ttft"),
  );
}

/** Keeps the fleet live: an EventSource on /stream (a snapshot, then deltas), and polling of /snapshot while it
 * is down. */
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
    this.polled = false;        // a poll replaced the fleet since the stream's snapshot: its deltas no longer apply
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
    this.polled = false;
    this.source = new EventSource(`${API}/stream`);
    for (const kind of ["snapshot", "delta"]) {
      this.source.addEventListener(kind, (event) => this.received(kind, event.data));
    }
    this.source.onerror = () => {
      if (!this.running) return;
      // Refused outright: poll at once. EventSource cannot say why; a 401 from the poll ends the session.
      if (this.source.readyState === EventSource.CLOSED) this.poll();
      this.show();
    };
  }

  received(kind, text) {
    if (!this.running) return;
    this.lastStreamAt = Date.now();
    this.show();
    if (kind === "delta" && this.polled) {    // a fresh stream starts with a snapshot the deltas after it fit
      this.openStream();
      return;
    }
    try {
      this.onData(kind, JSON.parse(text));
    } catch (err) {
      console.error(`bad ${kind}`, err);
    }
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

  /** After an action: fetch once now, unless the stream is live (it sends the change within a second). */
  pollSoon() {
    if (Date.now() - this.lastStreamAt >= STREAM_FRESH_MS) setTimeout(() => this.poll(), 300);
  }

  async poll() {
    if (this.polling || !this.running) return;
    this.polling = true;
    this.lastPollAt = Date.now();
    try {
      const snapshot = await getJson("/snapshot");   // what /stream sends first
      if (!this.running) return;
      this.polled = true;
      this.onData("snapshot", snapshot);
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

const feed = new Feed(onUpdate, $("conn"));
const dashboard = ["dashboard", "jump", "summary", "conn"].map($);
let requestsTimer = 0;
let pagesTimer = 0;

/** Signed in: show the panels (and the operator's controls to an operator only) and keep them live. */
function startDashboard(user) {
  actions.setRole(user.role);
  $("deploy-form").hidden = !actions.canOperate;
  for (const node of dashboard) node.hidden = false;
  render();
  feed.start();
  agentsTable.start();
  loadStatsHistory();
  requests.refresh();
  coordinators.refresh();
  clearInterval(requestsTimer);
  requestsTimer = setInterval(() => {
    if (document.hidden) return;
    requests.refresh();
    coordinators.refresh();
  }, REQUESTS_EVERY_MS);
  clearInterval(pagesTimer);
  pagesTimer = setInterval(() => {
    if (document.hidden) return;
    agentsTable.refresh();
    topology.refresh();
  }, PAGES_EVERY_MS);
}

/** Signed out: stop every call and forget what was shown. */
function stopDashboard() {
  feed.stop();
  clearInterval(requestsTimer);
  clearInterval(pagesTimer);
  agentsTable.stop();
  topology.clear();
  for (const node of dashboard) node.hidden = true;
  if ($("confirm").open) $("confirm").close("cancel");
  state.fleet.clear();
  state.stats.length = 0;
  state.drains.clear();
  actions.setRole(null);
  render();
  requests.clear();
  coordinators.clear();
}

const auth = new Auth({
  panel: $("login"), form: $("login-form"), note: $("login-note"), error: $("login-error"), who: $("who"),
  name: $("who-name"), role: $("who-role"), logout: $("logout"), banner: $("insecure-banner"),
}, { onSignIn: startDashboard, onSignOut: stopDashboard, onError: (message) => actions.toast(message, "error") });

setUpTheme();
actions.mountDeployForm($("deploy-form"));
window.addEventListener("resize", () => { if (auth.state === "in") render(); });
auth.start();
