"use strict";
// The newest coordinator events (plans made, placements failed, agents found or lost), newest first.

import { agentLabel, el, fmtClock } from "./dom.js";

const BAD = /fail|dead|lost|error|refused|unreachable/i;
const GOOD = /ready|discovered|connected|joined|active|drained|deployed|plan|moved/i;

export class EventsLog {
  constructor(list) {
    this.list = list;
    this.signature = "";
  }

  update(view) {
    const events = view.events.slice(0, 50);
    const signature = events.map((e) => e.id ?? `${e.ts}${e.kind}`).join(",") + view.agents.length;
    if (signature === this.signature) return;
    this.signature = signature;
    if (!events.length) {
      this.list.replaceChildren(el("li", { class: "empty", text: "No events yet." }));
      return;
    }
    this.list.replaceChildren(...events.map((e) => this.item(e, view)));
  }

  item(event, view) {
    const kind = String(event.kind || "event");
    const tone = BAD.test(kind) ? "down" : GOOD.test(kind) ? "healthy" : "unknown";
    const agent = event.agent_id ? view.agentsById.get(event.agent_id) : null;
    return el("li", { class: "event", "data-testid": "event", "data-kind": kind },
      el("span", { class: "mono muted small event-time", title: new Date(event.ts * 1000).toISOString(),
        text: fmtClock(event.ts) }),
      el("span", { class: `badge ${tone}`, text: kind.replaceAll("_", " ") }),
      event.agent_id
        ? el("span", { class: "event-agent", title: event.agent_id, text: agentLabel(agent, event.agent_id) }) : null,
      el("span", { class: "event-detail", title: detailText(event.detail), text: detailText(event.detail) }));
  }
}

function detailText(detail) {
  if (detail === null || detail === undefined) return "";
  if (typeof detail === "string") return detail;
  return Object.entries(detail).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
}
