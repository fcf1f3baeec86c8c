"use strict";
// The mesh as a graph: the coordinator's origin on the left, one box per site, coloured by tier; links labelled
// with their measured RTT and bandwidth. The hops of each active pipeline (origin -> stage 0 -> ... -> origin) are
// drawn strong with arrows; the other links faint, their labels shown when one of their ends is hovered.
// A small site is drawn agent by agent. A larger one is one node with its counts, beside the agents of it that
// serve a stage (or are being drained or rest); clicking that node lists the site's agents below the graph, a page
// at a time from the agents API. So a fleet of 10,000 agents draws as its sites, not as 10,000 nodes.

import { agentColour, agentLabel, el, fmtBandwidth, fmtBytes, fmtNumber, shorten, stateClass, svg,
  DOWN_STATES } from "./dom.js";
import { AgentPager } from "./pager.js";

const NODE_W = 150;
const NODE_H = 44;
const ROWS = 5;          // agents per column inside a site box
const ROW_GAP = 40;
const COL_GAP = 100;
const PAD = 14;
const SITE_HEAD = 22;
const SITE_GAP = 96;     // between the boxes of one row: room for the labels of the links between sites
const WRAPPED_GAP = 40;  // ... when the boxes take several rows (their links are shown on hover only)
const WRAP_W = 1500;     // site boxes past this width go on a new row
const ORIGIN_GAP = 130;  // room for the labels of the origin's links
const ARC_ROOM = 36;     // right of a column: arcs between agents of one column
const MAX_FAINT_AGENTS = 8;
const MIN_SCALE = 0.6;   // shrink a wide mesh down to this, then scroll
const ORIGIN = "origin";
const SITE_OPEN_UP_TO = 12;   // a site of at most this many agents, all of them known, is drawn agent by agent
const SITE_PAGE = 25;         // agents per page of an opened site's list
const UP_STATES = new Set(["online", "connected"]);

export class Topology {
  constructor(root) {
    this.root = root;
    this.signature = "";
    this.graph = el("div");
    this.list = el("div", { class: "site-agents", "data-testid": "site-agents", hidden: true });
    this.root.replaceChildren(this.graph, this.list, legend());
    this.opened = null;       // the site whose agents are listed below the graph
    this.view = null;
    this.pager = new AgentPager(SITE_PAGE, () => this.drawList());
  }

  update(view) {
    this.view = view;
    const graph = buildGraph(view, this.opened);
    // A mesh too wide for its half of the page takes the whole width (the placement panel goes below).
    const grid = this.root.closest("main");
    const half = grid ? (grid.clientWidth * 7) / 12 - 40 : Infinity;
    document.body.classList.toggle("wide-topology", graph.width > half);
    const signature = JSON.stringify(graph);
    if (signature !== this.signature) {
      this.signature = signature;
      this.graph.replaceChildren(graph.nodes.length > 1 ? render(graph, (site) => this.open(site)) : el("p",
        { class: "empty", text: "No agents yet: start one with `stratamesh agent`." }));
    }
    if (this.opened !== null && !view.sites.some((s) => s.site === this.opened)) this.open(null);
  }

  /** Lists the site's agents below the graph (null, or the site listed already: closes the list). */
  open(site) {
    this.opened = site === this.opened ? null : site;
    if (this.opened === null) this.pager.stop(); else this.pager.show({ site: this.opened });
    this.drawList();
    if (this.view) this.update(this.view);
  }

  /** The opened site's page of agents again (their newest states). */
  refresh() {
    if (this.opened !== null) this.pager.reload();
  }

  /** Signed out: close the list and drop any answer still to come. */
  clear() {
    this.opened = null;
    this.pager.stop();
    this.drawList();
  }

  drawList() {
    const page = this.opened === null ? null : this.pager.page;
    this.list.hidden = this.opened === null;
    if (this.opened === null) return this.list.replaceChildren();
    this.list.dataset.site = this.opened;
    const rows = page ? page.agents.map((agent) => siteAgentRow(agent, this.view)) : [];
    this.list.replaceChildren(
      el("div", { class: "site-agents-head" }, el("b", { text: `Site ${this.opened || "(no site)"}` }),
        this.pager.controls("site-agents"),
        el("button", { class: "btn small", type: "button", "data-testid": "site-agents-close",
          onclick: () => this.open(null) }, "Close")),
      el("table", { class: "table compact" }, el("tbody", {}, ...(rows.length ? rows
        : [el("tr", { class: "empty-row" }, el("td", { colspan: 4, text: page ? "No agents." : "Loading…" }))]))));
  }
}

/** One agent of an opened site: the stream's record of it where it has one (newer), else the page's. */
function siteAgentRow(agent, view) {
  const live = (view && view.agentsById.get(agent.agent_id)) || agent;
  const caps = live.capabilities || {};
  return el("tr", { "data-testid": "site-agent", "data-agent-id": live.agent_id, "data-state": live.state },
    el("td", {}, el("span", { class: "strong", text: agentLabel(live, live.agent_id) }), " ",
      el("span", { class: "mono muted small", text: live.agent_id })),
    el("td", {}, el("span", { class: `badge ${stateClass(live.state)}`, text: live.state })),
    el("td", { class: "small", text: deviceSummary(caps) }),
    el("td", {}, el("span", { class: `tag tier-${caps.tier === "cloud" ? "cloud" : "edge"}`, text: caps.tier || "edge" })));
}

/** Nodes with positions, site boxes and edges: plain values, so a re-render happens only on a change.
 * Site boxes stand in a row after the origin (several rows when there are many), so links between sites run
 * left to right. */
function buildGraph(view, opened) {
  const sites = sitesOf(view, routeOrder(view));
  const nodes = [];
  const boxes = sites.map((site) => siteBox(site));
  const left = PAD + NODE_W + ORIGIN_GAP;
  const oneRow = boxes.reduce((w, b) => w + b.w + SITE_GAP, left) <= WRAP_W;
  let [x, y, rowH] = [left, PAD, 0];
  sites.forEach((site, i) => {
    const box = boxes[i];
    if (!oneRow && x > left && x + box.w > WRAP_W) [x, y, rowH] = [left, y + rowH + WRAPPED_GAP, 0];
    [box.x, box.y] = [x, y];
    const slots = site.summary ? [siteNode(site, opened), ...site.agents] : site.agents;
    slots.forEach((item, k) => {
      const col = Math.floor(k / ROWS);
      const row = k % ROWS;
      const at = [box.x + PAD + col * (NODE_W + COL_GAP), box.y + SITE_HEAD + PAD + row * (NODE_H + ROW_GAP)];
      nodes.push(item.kind === "site" ? { ...item, x: at[0], y: at[1], col: col + 1000 * i, row }
        : agentNode(item, at[0], at[1], col + 1000 * i, row));
    });
    x += box.w + (oneRow ? SITE_GAP : WRAPPED_GAP);
    rowH = Math.max(rowH, box.h);
  });
  const height = Math.max(NODE_H + 2 * PAD, ...boxes.map((b) => b.y + b.h + PAD));
  const firstRow = boxes.filter((b) => b.y === PAD);
  const originY = boxes.length ? PAD + (Math.max(...firstRow.map((b) => b.h)) - NODE_H) / 2 : PAD;
  nodes.unshift({ id: ORIGIN, name: "coordinator", sub: "origin", x: PAD, y: originY, col: -1, row: 0,
    cls: "origin", title: "the coordinator's origin: tokenizes, drives each generation, samples nothing" });
  const width = Math.max(PAD * 2 + NODE_W, ...boxes.map((b) => b.x + b.w + PAD));
  return { nodes, boxes, edges: [...buildEdges(view, nodes), ...siteEdges(view, nodes)], width, height };
}

function siteBox(site) {
  const slots = site.agents.length + (site.summary ? 1 : 0);
  const cols = Math.ceil(slots / ROWS);
  const rows = Math.min(ROWS, slots);
  return { name: site.name, tiers: site.tiers, x: 0, y: 0,
    w: cols * NODE_W + (cols - 1) * COL_GAP + 2 * PAD + (slots > 1 ? ARC_ROOM : 0),
    h: SITE_HEAD + rows * NODE_H + (rows - 1) * ROW_GAP + 2 * PAD };
}

/** agent id -> its first position along an active route, so a pipeline reads top to bottom. */
function routeOrder(view) {
  const order = new Map();
  view.routes.forEach((route, r) => route.agents.forEach((id, k) => {
    if (!order.has(id)) order.set(id, r * 1000 + k);
  }));
  return order;
}

/** The sites, those holding the pipelines first: each with its summary when it is drawn as one node (null when
 * every agent of it is drawn) and the agents drawn one by one. */
function sitesOf(view, order) {
  const known = new Map();     // site -> its agents the view holds in full
  for (const agent of view.agents) {
    const name = (agent.capabilities && agent.capabilities.site) || "";
    if (!known.has(name)) known.set(name, []);
    known.get(name).push(agent);
  }
  const summaries = new Map(view.sites.map((s) => [s.site, s]));
  const rank = (a) => order.get(a.agent_id) ?? 1e9;
  const sites = [...new Set([...summaries.keys(), ...known.keys()])].map((name) => {
    const list = known.get(name) || [];
    const summary = summaries.get(name) || null;
    const whole = !summary || (list.length >= summary.num_agents && summary.num_agents <= SITE_OPEN_UP_TO);
    const drawn = whole ? list : list.filter((a) => view.serving.has(a.agent_id) || busy(a, view));
    return { name, summary: whole ? null : summary,
      agents: drawn.sort((a, b) => rank(a) - rank(b) || agentLabel(a).localeCompare(agentLabel(b))),
      tiers: summary ? Object.keys(summary.tiers).sort()
        : [...new Set(list.map((a) => (a.capabilities && a.capabilities.tier) || "edge"))].sort(),
      rank: Math.min(1e9, ...list.map(rank)) };
  });
  return sites.sort((a, b) => a.rank - b.rank || a.name.localeCompare(b.name));
}

/** Being drained, or resting: drawn on its own in a site drawn as one node. */
function busy(agent, view) {
  const drain = view.drains.get(agent.agent_id);
  return agent.state === "resting" || Boolean(drain && ["moving_stages", "moving_sessions"].includes(drain.state));
}

/** The node of a site drawn as one: how many agents, how many up, the others by state. */
function siteNode(site, opened) {
  const s = site.summary;
  const others = Object.entries(s.states).filter(([state, n]) => !UP_STATES.has(state) && n)
    .sort((a, b) => b[1] - a[1]).map(([state, n]) => `${fmtNumber(n, 0)} ${state}`);
  const tier = (s.tiers.cloud || 0) > (s.tiers.edge || 0) ? "cloud" : "edge";
  const state = s.num_up === s.num_agents ? "connected" : s.num_up ? "waiting" : "dead";
  const title = [`site ${site.name || "(none)"}: ${s.num_agents} agents, ${s.num_up} up, ${s.num_serving} serving`,
    `states: ${Object.entries(s.states).map(([k, n]) => `${k} ${n}`).join(", ")}`,
    `tiers: ${Object.entries(s.tiers).map(([k, n]) => `${k} ${n}`).join(", ")}`,
    `${s.num_gpus} GPUs (${fmtBytes(s.gpu_mem_bytes)}) · ${s.num_cpus} CPUs · ${fmtBytes(s.ram_total_bytes)} RAM`,
    `${fmtNumber(s.tokens_per_s)} tok/s · queue ${s.queue_depth}`, "click to list its agents"].join("\n");
  return { kind: "site", id: siteId(site.name), site: site.name, name: `${s.num_agents.toLocaleString("en")} agents`,
    sub: [`${fmtNumber(s.num_up, 0)} up`, ...others].join(" · "), numAgents: s.num_agents, numUp: s.num_up,
    state, open: opened === site.name, cls: `site-summary tier-${tier}`, title };
}

const siteId = (name) => `#site ${name}`;

function agentNode(agent, x, y, col, row) {
  const caps = agent.capabilities || {};
  const tier = caps.tier || "edge";
  const down = DOWN_STATES.has(agent.state);
  return { id: agent.agent_id, name: agentLabel(agent, agent.agent_id), sub: deviceSummary(caps), x, y, col, row,
    state: agent.state, down, cls: `tier-${tier === "cloud" ? "cloud" : "edge"}${down ? " down" : ""}`,
    colour: agentColour(agent.agent_id),
    title: [agentLabel(agent, agent.agent_id), agent.agent_id, `state: ${agent.state}`, `tier: ${tier}`,
      `site: ${caps.site || "(none)"}`, `address: ${agent.address || "?"}`, caps.cpu_model || ""].join("\n") };
}

/** "2× H100 80GB HBM3" or "CPU · 8 cores". */
export function deviceSummary(caps) {
  const gpus = (caps && caps.gpus) || [];
  if (!gpus.length) return `CPU · ${(caps && caps.num_cpus) || "?"} cores`;
  const name = String(gpus[0].name || "GPU").replace(/^NVIDIA\s+/i, "");
  return gpus.length > 1 ? `${gpus.length}× ${name}` : name;
}

function buildEdges(view, nodes) {
  const known = new Set(nodes.map((n) => n.id));
  const down = new Set(nodes.filter((n) => n.down).map((n) => n.id));
  const measured = new Map();   // "a>b" -> link
  for (const link of view.links) measured.set(`${link.agent_id}>${link.peer_id}`, link);
  const edges = new Map();      // "a|b" (sorted) -> edge
  const edgeOf = (a, b) => {
    const [p, q] = a < b ? [a, b] : [b, a];
    const key = `${p}|${q}`;
    if (!edges.has(key)) edges.set(key, { a: p, b: q, pipe: false, forward: false, backward: false });
    return edges.get(key);
  };
  for (const route of view.routes) {
    const hops = [ORIGIN, ...route.agents, ORIGIN];
    for (let i = 0; i + 1 < hops.length; i += 1) {
      const [from, to] = [hops[i], hops[i + 1]];
      if (from === to || !known.has(from) || !known.has(to)) continue;
      const edge = edgeOf(from, to);
      edge.pipe = true;
      if (from === edge.a) edge.forward = true; else edge.backward = true;
    }
  }
  for (const link of view.links) {
    const [a, b] = [link.agent_id, link.peer_id];
    if (a !== b && known.has(a) && known.has(b) && !down.has(a) && !down.has(b)) edgeOf(a, b);
  }
  const numAgents = nodes.filter((n) => n.kind !== "site").length - 1;
  return [...edges.values()].map((e) => {
    const link = measured.get(`${e.a}>${e.b}`) || measured.get(`${e.b}>${e.a}`);
    return { ...e, optional: !e.pipe && numAgents > MAX_FAINT_AGENTS, label: linkLabel(link),
      error: Boolean(link && link.error) };
  });
}

/** The links measured between two sites drawn as one node each: shown when either is hovered. */
function siteEdges(view, nodes) {
  const drawn = new Set(nodes.filter((n) => n.kind === "site").map((n) => n.id));
  return view.site_links.filter((l) => l.a !== l.b && drawn.has(siteId(l.a)) && drawn.has(siteId(l.b)))
    .map((l) => ({ a: siteId(l.a), b: siteId(l.b), pipe: false, forward: false, backward: false, optional: true,
      error: l.num_failed === l.num_links,
      label: l.rtt_s === null ? `${l.num_links} unreachable`
        : `${(l.rtt_s * 1e3).toFixed(1)} ms · ${fmtBandwidth(l.bandwidth_bytes_per_s)} · ${l.num_links} links` }));
}

function linkLabel(link) {
  if (!link) return "not measured";
  if (link.error) return "unreachable";
  return `${(link.rtt_s * 1e3).toFixed(2)} ms · ${fmtBandwidth(link.bandwidth_bytes_per_s)}`;
}

// ---- drawing ----------------------------------------------------------------------------------

function render(graph, onOpen) {
  const root = svg("svg", { class: "topo-svg", width: graph.width, height: graph.height,
    style: `min-width:${Math.round(graph.width * MIN_SCALE)}px`,
    viewBox: `0 0 ${graph.width} ${graph.height}`, "data-testid": "topology", role: "group",
    "aria-label": "mesh topology" });
  root.append(markers());
  const byId = new Map(graph.nodes.map((n) => [n.id, n]));
  const lines = svg("g", { class: "edges" });
  const labels = svg("g", { class: "edge-labels" });
  const edgesOf = new Map();    // node id -> its edge elements, for hover
  for (const edge of graph.edges) {
    const drawn = drawEdge(edge, byId.get(edge.a), byId.get(edge.b));
    lines.append(drawn.line);
    labels.append(drawn.label);
    for (const id of [edge.a, edge.b]) edgesOf.set(id, [...(edgesOf.get(id) || []), drawn.line, drawn.label]);
  }
  root.append(...graph.boxes.map(drawSite), lines);
  for (const node of graph.nodes) {
    const edges = edgesOf.get(node.id) || [];
    root.append(node.kind === "site" ? drawSiteNode(node, root, edges, onOpen) : drawNode(node, root, edges));
  }
  root.append(labels);
  return el("div", { class: "topo-scroll" }, root);
}

function markers() {
  const arrow = (id) => svg("marker", { id, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
    markerHeight: 7, orient: "auto-start-reverse" }, svg("path", { d: "M0,0L10,5L0,10z", class: "arrow" }));
  return svg("defs", {}, arrow("topo-arrow"));
}

function drawSite(box) {
  const title = box.name || "(no site)";
  return svg("g", { class: "site", "data-testid": "topology-site", "data-site": box.name },
    svg("rect", { x: box.x, y: box.y, width: box.w, height: box.h, rx: 10 }),
    svg("text", { class: "site-name", x: box.x + 12, y: box.y + 17, text: title }),
    svg("text", { class: "site-tier", x: box.x + box.w - 12, y: box.y + 17, "text-anchor": "end",
      text: box.tiers.join(" + ") }));
}

function drawNode(node, root, edges) {
  const g = svg("g", { class: `node ${node.cls}`, transform: `translate(${node.x},${node.y})`,
    "data-testid": node.id === ORIGIN ? "topology-origin" : "topology-node", "data-agent-id": node.id,
    "data-state": node.state || "" },
    svg("title", { text: node.title }),
    svg("rect", { class: "node-box", width: NODE_W, height: NODE_H, rx: 7 }),
    node.colour ? svg("rect", { class: "node-stripe", x: 0, y: 0, width: 5, height: NODE_H, fill: node.colour }) : null,
    svg("text", { class: "node-name", x: 13, y: 18, text: shorten(node.name, 19) }),
    svg("text", { class: "node-sub", x: 13, y: 34, text: shorten(node.sub, 24) }));
  if (node.state) {
    g.append(svg("circle", { class: `state-dot ${stateClass(node.state)}`, cx: NODE_W - 11, cy: 11, r: 4.5 },
      svg("title", { text: node.state })));
  }
  return hoverable(g, root, edges);
}

/** A site drawn as one node: its counts; a click (or Enter) lists its agents below the graph. */
function drawSiteNode(node, root, edges, onOpen) {
  const g = svg("g", { class: `node ${node.cls}${node.open ? " open" : ""}`, transform: `translate(${node.x},${node.y})`,
    "data-testid": "topology-site-summary", "data-site": node.site, "data-num-agents": node.numAgents,
    "data-num-up": node.numUp, role: "button", tabindex: 0, "aria-expanded": String(node.open) },
    svg("title", { text: node.title }),
    svg("rect", { class: "node-box", width: NODE_W, height: NODE_H, rx: 7 }),
    svg("text", { class: "node-name", x: 13, y: 18, text: shorten(node.name, 19) }),
    svg("text", { class: "node-sub", x: 13, y: 34, text: shorten(node.sub, 24) }),
    svg("text", { class: "node-open", x: NODE_W - 20, y: 34, text: node.open ? "▾" : "▸" }),
    svg("circle", { class: `state-dot ${stateClass(node.state)}`, cx: NODE_W - 11, cy: 11, r: 4.5 }));
  g.addEventListener("click", () => onOpen(node.site));
  g.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); onOpen(node.site); } });
  return hoverable(g, root, edges);
}

/** Hovering the node shows its links, and dims the others. */
function hoverable(g, root, edges) {
  g.addEventListener("mouseenter", () => {
    root.classList.add("focusing");
    for (const e of edges) e.classList.add("hot");
    g.classList.add("hot");
  });
  g.addEventListener("mouseleave", () => {
    root.classList.remove("focusing");
    for (const e of edges) e.classList.remove("hot");
    g.classList.remove("hot");
  });
  return g;
}

/** A link as a path (straight, or an arc between agents of one column) and its label at the middle. */
function drawEdge(edge, a, b) {
  const [p0, c, p1] = edgeGeometry(a, b);
  const cls = ["edge", edge.pipe ? "pipe" : "faint", edge.optional ? "optional" : "", edge.error ? "error" : ""]
    .join(" ");
  const line = svg("path", { class: cls, d: `M${p0[0]},${p0[1]}Q${c[0]},${c[1]} ${p1[0]},${p1[1]}`,
    "marker-end": edge.forward ? "url(#topo-arrow)" : null, "marker-start": edge.backward ? "url(#topo-arrow)" : null,
    "data-a": edge.a, "data-b": edge.b });
  const mid = [0.25 * p0[0] + 0.5 * c[0] + 0.25 * p1[0], 0.25 * p0[1] + 0.5 * c[1] + 0.25 * p1[1]];
  const arc = a.col === b.col && Math.abs(a.row - b.row) > 1;
  const width = edge.label.length * 5.6 + 10;
  const left = arc ? mid[0] - 4 : mid[0] - width / 2;
  const label = svg("g", { class: `edge-label ${cls}`, "data-testid": "topology-link", "data-a": edge.a,
    "data-b": edge.b },
    svg("rect", { x: left, y: mid[1] - 8, width, height: 16, rx: 8 }),
    svg("text", { x: left + width / 2, y: mid[1] + 3.5, "text-anchor": "middle", text: edge.label }));
  return { line, label };
}

function edgeGeometry(a, b) {
  const [top, bottom] = a.y <= b.y ? [a, b] : [b, a];
  if (a.col === b.col && a.col >= 0) {
    if (Math.abs(a.row - b.row) === 1) {     // neighbours in a column: straight down
      const x = a.x + NODE_W / 2;
      const p0 = [x, top.y + NODE_H];
      const p1 = [x, bottom.y];
      return ordered(a, top, [p0, mid(p0, p1), p1]);
    }
    const x = a.x + NODE_W;                   // farther apart: an arc on the right, clear of the nodes between
    const p0 = [x, top.y + NODE_H / 2];
    const p1 = [x, bottom.y + NODE_H / 2];
    const bulge = 30 + 8 * Math.abs(a.row - b.row);
    return ordered(a, top, [p0, [x + bulge, (p0[1] + p1[1]) / 2], p1]);
  }
  const [left, right] = a.x <= b.x ? [a, b] : [b, a];
  const p0 = [left.x + NODE_W, left.y + NODE_H / 2];
  const p1 = [right.x, right.y + NODE_H / 2];
  const m = mid(p0, p1);
  const c = Math.abs(p0[1] - p1[1]) < 1 && right.col - left.col > 1 ? [m[0], m[1] - 40] : m;
  return ordered(a, left, [p0, c, p1]);
}

const mid = (p, q) => [(p[0] + q[0]) / 2, (p[1] + q[1]) / 2];

/** The geometry runs from a to b, so the path's start and end markers point the right way. */
function ordered(a, first, [p0, c, p1]) {
  return a === first ? [p0, c, p1] : [p1, c, p0];
}

function legend() {
  const item = (cls, text) => el("span", { class: "legend-item" }, el("i", { class: cls }), text);
  return el("div", { class: "legend" }, item("sw tier-edge", "edge"), item("sw tier-cloud", "cloud"),
    item("sw down", "dead · drained · lost"), item("ln pipe", "pipeline hop"), item("ln faint", "measured link"));
}
