"use strict";
// The view every panel renders from. The coordinator's live stream sends a snapshot of the fleet (every site summed
// up; in full only the agents that matter to the drawing: those the plans use, those draining or resting, the few
// that changed last) and then, every second, what changed; Fleet keeps that copy and applies each change to it, so
// a fleet of 10,000 agents costs the page a few hundred records, not 10,000 a second.

export const STATS_WINDOW_S = 300;

const LISTS = ["plans", "links", "site_links", "models", "drains", "events"];   // sent whole when they change

export function emptySnapshot() {
  return { ts: 0, num_agents: 0, sites: [], agents: [], plans: [], links: [], site_links: [], models: [], drains: [],
    stats: null, events: [] };
}

/** Fills in what a partial answer left out, so panels need no checks. */
export function normalise(snapshot) {
  const s = { ...emptySnapshot(), ...snapshot };
  for (const key of ["sites", "agents", ...LISTS]) {
    if (!Array.isArray(s[key])) s[key] = [];
  }
  return s;
}

/** The page's copy of the coordinator's fleet view: a snapshot, and the deltas after it applied in order. */
export class Fleet {
  constructor() {
    this.clear();
  }

  clear() {
    this.ts = 0;
    this.numAgents = 0;
    this.sites = new Map();    // site name -> its summary
    this.agents = new Map();   // agent id -> its full record (the agents that matter)
    for (const key of LISTS) this[key] = [];
    this.stats = null;
  }

  /** Replaces everything with a snapshot (the stream's first event, or a poll). */
  applySnapshot(raw) {
    const s = normalise(raw);
    this.clear();
    this.ts = s.ts;
    this.numAgents = s.num_agents || s.agents.length;
    for (const site of s.sites) this.sites.set(site.site, site);
    for (const agent of s.agents) this.agents.set(agent.agent_id, agent);
    for (const key of LISTS) this[key] = s[key];
    this.stats = s.stats;
  }

  /** Applies what changed since the event before: agents and sites in full, those removed by id or name, the
   * lists that changed whole. */
  applyDelta(delta) {
    this.ts = delta.ts ?? this.ts;
    this.numAgents = delta.num_agents ?? this.numAgents;
    this.stats = delta.stats ?? null;
    for (const agent of delta.agents || []) this.agents.set(agent.agent_id, agent);
    for (const id of delta.agents_removed || []) this.agents.delete(id);
    for (const site of delta.sites || []) this.sites.set(site.site, site);
    for (const name of delta.sites_removed || []) this.sites.delete(name);
    for (const key of LISTS) {
      if (Array.isArray(delta[key])) this[key] = delta[key];
    }
  }

  /** The copy as a snapshot's plain object (sites in name order). */
  snapshot() {
    const sites = [...this.sites.values()].sort((a, b) => a.site.localeCompare(b.site));
    return { ts: this.ts, num_agents: this.numAgents, sites, agents: [...this.agents.values()],
      ...Object.fromEntries(LISTS.map((key) => [key, this[key]])), stats: this.stats };
  }
}

/** Appends a stats point (if newer than the last) and drops those older than the window. */
export function appendStats(history, point, nowS) {
  if (point && typeof point.t === "number" && (!history.length || point.t > history[history.length - 1].t)) {
    history.push(point);
  }
  const cutoff = nowS - STATS_WINDOW_S;
  while (history.length && history[0].t < cutoff) history.shift();
  return history;
}

/** The model's layer count: the plan's, else the model record's, else the furthest end layer. */
export function numLayersOf(plan, models) {
  if (plan.num_layers) return plan.num_layers;
  const model = models.find((m) => m.model_id === plan.model_id);
  if (model && model.num_layers) return model.num_layers;
  return Math.max(1, ...plan.stages.map((s) => s.end_layer));
}

/** Derived lookups: agents by id, what each agent serves, stage order along each active route. */
export function deriveView(snapshot, stats, drains) {
  const agentsById = new Map(snapshot.agents.map((a) => [a.agent_id, a]));
  const serving = new Map();   // agent id -> [{model_id, plan_state, index, start_layer, end_layer, tp_degree}]
  for (const plan of snapshot.plans) {
    plan.stages.forEach((stage, index) => {
      const list = serving.get(stage.agent_id) || [];
      list.push({ model_id: plan.model_id, plan_state: plan.state, index, ...stage });
      serving.set(stage.agent_id, list);
    });
  }
  const routes = snapshot.plans.filter((p) => p.state === "active")
    .map((p) => ({ model_id: p.model_id, agents: [...p.stages].sort((a, b) => a.start_layer - b.start_layer)
      .map((s) => s.agent_id) }));
  const assignments = new Map();   // assignment id -> {agent_id, plan, index}
  for (const plan of snapshot.plans) {
    plan.stages.forEach((stage, index) => assignments.set(stage.assignment_id, { ...stage, plan, index }));
  }
  const numUp = snapshot.sites.reduce((n, site) => n + (site.num_up || 0), 0);
  // "now" is the coordinator's clock where known: stats and telemetry carry its timestamps, not the browser's.
  return { ...snapshot, stats, drains, agentsById, serving, routes, assignments, numUp,
    now: snapshot.ts || Date.now() / 1000 };
}
