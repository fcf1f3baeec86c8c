"use strict";
// The mesh as a graph: the coordinator's origin on the left, agents grouped in one box per site,
// coloured by tier; links labelled with their measured RTT and bandwidth. The hops of each active
// pipeline (origin -> stage 0 -> ... -> origin) are drawn strong with arrows; the other links faint,
// their labels shown when one of their ends is hovered.

import { agentColour, agentLabel, el, fmtBandwidth, shorten, stateClass, svg, DOWN_STATES } from "./dom.js";

const NODE_W = 150;
const NODE_H = 44;
const ROWS = 5;          // agents per column inside a site box
const ROW_GAP = 40;
const COL_GAP = 100;
const PAD = 14;
const SITE_HEAD = 22;
const SITE_GAP = 96;
const ORIGIN_GAP = 130;  // room for the labels of the origin's links
const ARC_ROOM = 36;     // right of a column: arcs between agents of one column
const MAX_FAINT_AGENTS = 8;
const MIN_SCALE = 0.6;   // shrink a wide mesh down to this, then scroll
const ORIGIN = "origin";

export class Topology {
  constructor(root) {
    this.root = root;
    this.signature = "";
  }

  update(view) {
    const graph = buildGraph(view);
    // A mesh too wide for its half of the page takes the whole width (the placement panel goes below).
    const grid = this.root.closest("main");
    const half = grid ? (grid.clientWidth * 7) / 12 - 40 : Infinity;
    document.body.classList.toggle("wide-topology", graph.width > half);
    const signature = JSON.stringify(graph);
    if (signature === this.signature) return;
    this.signature = signature;
    this.root.replaceChildren(graph.nodes.length > 1 ? render(graph) : el("p", { class: "empty",
      text: "No agents yet: start one with `stratamesh agent`." }), legend());
  }
}

/** Nodes with positions, site boxes and edges: plain values, so a re-render happens only on a change.
 * Site boxes stand in one row after the origin, so links between sites run left to right. */
function buildGraph(view) {
  const order = routeOrder(view);
  const sites = groupBySite(view.agents, order);
  const nodes = [];
  const boxes = [];
  let x = PAD + NODE_W + ORIGIN_GAP;
  sites.forEach((site, i) => {
    const cols = Math.ceil(site.agents.length / ROWS);
    const rows = Math.min(ROWS, site.agents.length);
    const box = { name: site.name, tiers: site.tiers, x, y: PAD,
      w: cols * NODE_W + (cols - 1) * COL_GAP + 2 * PAD + ARC_ROOM,
      h: SITE_HEAD + rows * NODE_H + (rows - 1) * ROW_GAP + 2 * PAD };
    site.agents.forEach((agent, k) => {
      const col = Math.floor(k / ROWS);
      const row = k % ROWS;
      nodes.push(agentNode(agent, box.x + PAD + col * (NODE_W + COL_GAP),
        box.y + SITE_HEAD + PAD + row * (NODE_H + ROW_GAP), col + 1000 * i, row));
    });
    boxes.push(box);
    x += box.w + SITE_GAP;
  });
  const height = Math.max(NODE_H + 2 * PAD, ...boxes.map((b) => b.y + b.h + PAD));
  const originY = boxes.length ? PAD + (Math.max(...boxes.map((b) => b.h)) - NODE_H) / 2 : PAD;
  nodes.unshift({ id: ORIGIN, name: "coordinator", sub: "origin", x: PAD, y: originY, col: -1, row: 0,
    cls: "origin", title: "the coordinator's origin: tokenizes, drives each generation, samples nothing" });
  const width = Math.max(PAD * 2 + NODE_W, ...boxes.map((b) => b.x + b.w + PAD));
  return { nodes, boxes, edges: buildEdges(view, nodes), width, height };
}

/** agent id -> its first position along an active route, so a pipeline reads top to bottom. */
function routeOrder(view) {
  const order = new Map();
  view.routes.forEach((route, r) => route.agents.forEach((id, k) => {
    if (!order.has(id)) order.set(id, r * 1000 + k);
  }));
  return order;
}

function groupBySite(agents, order) {
  const bySite = new Map();
  for (const agent of agents) {
    const name = (agent.capabilities && agent.capabilities.site) || "";
    if (!bySite.has(name)) bySite.set(name, []);
    bySite.get(name).push(agent);
  }
  const rank = (a) => order.get(a.agent_id) ?? 1e9;
  const sites = [...bySite.entries()].map(([name, list]) => ({
    name,
    agents: list.sort((a, b) => rank(a) - rank(b) || agentLabel(a).localeCompare(agentLabel(b))),
    tiers: [...new Set(list.map((a) => (a.capabilities && a.capabilities.tier) || "edge"))].sort(),
  }));
  return sites.sort((a, b) => Math.min(...a.agents.map(rank)) - Math.min(...b.agents.map(rank))
    || a.name.localeCompare(b.name));
}

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
  const numAgents = nodes.length - 1;
  return [...edges.values()].map((e) => {
    const link = measured.get(`${e.a}>${e.b}`) || measured.get(`${e.b}>${e.a}`);
    return { ...e, optional: !e.pipe && numAgents > MAX_FAINT_AGENTS, label: linkLabel(link),
      error: Boolean(link && link.error) };
  });
}

function linkLabel(link) {
  if (!link) return "not measured";
  if (link.error) return "unreachable";
  return `${(link.rtt_s * 1e3).toFixed(2)} ms · ${fmtBandwidth(link.bandwidth_bytes_per_s)}`;
}

// ---- drawing ----------------------------------------------------------------------------------

function render(graph) {
  const root = svg("svg", { class: "topo-svg", width: graph.width, height: graph.height,
    style: `min-width:${Math.round(graph.width * MIN_SCALE)}px`,
    viewBox: `0 0 ${graph.width} ${graph.height}`, "data-testid": "topology", role: "img",
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
  for (const node of graph.nodes) root.append(drawNode(node, root, edgesOf.get(node.id) || []));
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
