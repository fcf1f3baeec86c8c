"use strict";
// The mesh's coordinators: on a PostgreSQL registry the one that leads and those standing by (each serves the API;
// only the leader plans and holds the agents' control streams), and the lease they share: its holder, its epoch
// (one more at each takeover) and when it runs out unless renewed. A lone coordinator on SQLite has no lease.

import { getJson } from "./api.js";
import { el, fmtSeconds } from "./dom.js";

export class CoordinatorsPanel {
  constructor(tbody, lease) {
    this.tbody = tbody;
    this.lease = lease;
  }

  async refresh() {
    try {
      this.render(await getJson("/coordinators"));
    } catch (err) {
      this.lease.textContent = `coordinators unknown: ${err.message}`;
    }
  }

  render(data) {
    const lease = data.lease;
    const expiry = lease && (lease.expires_in_s >= 0 ? `runs out in ${fmtSeconds(lease.expires_in_s)} unless renewed`
      : "expired: a standby takes it over");
    const text = lease ? `lease held by ${lease.holder} · epoch ${lease.epoch} · ${expiry}`
      : "one coordinator (SQLite registry): no lease";
    this.lease.replaceChildren(el("span", { "data-testid": "coordinator-lease", text }));
    if (!data.coordinators.length) {
      this.tbody.replaceChildren(el("tr", {}, el("td", { colspan: "5", class: "empty", text: "Only this one." })));
      return;
    }
    this.tbody.replaceChildren(...data.coordinators.map((c) => el("tr", {
      "data-testid": "coordinator-row", "data-name": c.name, "data-leads": String(c.leads) },
    el("td", { class: "mono", text: c.name }),
    el("td", {}, el("span", { class: `badge ${c.leads ? "healthy" : "unknown"}`, "data-testid": "coordinator-role",
      text: c.leads ? "leader" : "standby" })),
    el("td", { class: "mono small", text: c.http_url }),
    el("td", { class: "mono small", text: c.grpc_address }),
    el("td", { class: "num", text: `${fmtSeconds(c.seen_s_ago)} ago` }))));
  }

  clear() {
    this.tbody.replaceChildren();
    this.lease.replaceChildren();
  }
}
