"use strict";
// The view every panel renders from: the newest snapshot plus what is derived from it once per update.

export const STATS_WINDOW_S = 300;

export function emptySnapshot() {
  return { ts: 0, agents: [], plans: [], links: [], models: [], drains: [], stats: null, events: [] };
}

/** Fills in what an older coordinator or a partial poll left out, so panels need no checks. */
export function normalise(snapshot) {
  const s = { ...emptySnapshot(), ...snapshot };
  for (const key of ["agents", "plans", "links", "models", "drains", "events"]) {
    if (!Array.isArray(s[key])) s[key] = [];
  }
  return s;
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
  // "now" is the coordinator's clock where known: stats and telemetry carry its timestamps, not the browser's.
  return { ...snapshot, stats, drains, agentsById, serving, routes, assignments, now: snapshot.ts || Date.now() / 1000 };
}
