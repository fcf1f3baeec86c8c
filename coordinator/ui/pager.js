"use strict";
// Pages of GET /admin/api/agents, in agent id order, behind filters: the agents table and an opened site of the
// topology each hold one. Pages go by cursor (the last agent id of the page before), so paging on stays right while
// agents join and leave; Prev goes back through the cursors it took.

import { getJson } from "./api.js";
import { el } from "./dom.js";

export class AgentPager {
  constructor(limit, onPage) {
    this.limit = limit;
    this.onPage = onPage;       // onPage(page) after each load: {agents, next_after, total}
    this.filters = {};
    this.cursors = [null];      // the `after` of each page up to the one shown
    this.page = null;
    this.asked = 0;             // loads asked for: an answer to an older one is dropped
  }

  /** Shows the first page of the agents that pass these filters ({site, state, tier, q}; null: any). */
  show(filters = this.filters) {
    this.filters = filters;
    this.cursors = [null];
    return this.load();
  }

  next() {
    if (!this.page || !this.page.next_after) return Promise.resolve();
    this.cursors.push(this.page.next_after);
    return this.load();
  }

  prev() {
    if (this.cursors.length < 2) return Promise.resolve();
    this.cursors.pop();
    return this.load();
  }

  /** The page shown, again: its agents' newest state and telemetry. */
  reload() {
    return this.load();
  }

  /** Forgets the page and drops any answer still to come (signed out). */
  stop() {
    this.asked += 1;
    this.page = null;
  }

  async load() {
    const asked = ++this.asked;
    const params = new URLSearchParams({ limit: String(this.limit) });
    const after = this.cursors[this.cursors.length - 1];
    if (after !== null) params.set("after", after);
    for (const [key, value] of Object.entries(this.filters)) {
      if (value !== undefined && value !== null) params.set(key, value);
    }
    try {
      const page = await getJson(`/agents?${params}`);
      if (asked !== this.asked) return;
      if (!page.agents.length && this.cursors.length > 1) {   // the last agents of the last page left: go back one
        this.cursors.pop();
        this.load();
        return;
      }
      this.page = page;
      this.onPage(page);
    } catch (err) {
      console.warn("agents page failed:", err.message);
    }
  }

  /** "51–100 of 10,000", counted from the pages gone through. */
  rangeText() {
    if (!this.page) return "";
    const first = (this.cursors.length - 1) * this.limit;
    const shown = this.page.agents.length;
    return shown ? `${first + 1}–${first + shown} of ${this.page.total.toLocaleString("en")}`
      : `0 of ${this.page.total.toLocaleString("en")}`;
  }

  /** Prev, the range and Next, as buttons wired to this pager (testid prefix: "agents" gives agents-prev ...). */
  controls(prefix) {
    const prev = el("button", { class: "btn small", type: "button", "data-testid": `${prefix}-prev`,
      disabled: this.cursors.length < 2, onclick: () => this.prev() }, "‹ Prev");
    const next = el("button", { class: "btn small", type: "button", "data-testid": `${prefix}-next`,
      disabled: !this.page || !this.page.next_after, onclick: () => this.next() }, "Next ›");
    return el("div", { class: "pager" }, prev,
      el("span", { class: "muted small", "data-testid": `${prefix}-range`, text: this.rangeText() }), next);
  }
}
