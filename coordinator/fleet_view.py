"""The fleet as the admin API lists it and its UI draws it, at any size: pages of agents in id order, and the view
the live stream sends. The view sums every agent up per site, and holds in full only the agents that matter to the
drawing: those the plans use, those being drained or resting, the few whose state changed last (every agent of a
small fleet). fleet_delta says what changed between two views, so a stream sends a fleet of 10,000 boxes once and
then only its changes. Pure: values in, values out; MeshAdmin gathers them."""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from statistics import median
from typing import Any

from stratamesh.coordinator.plain import plain
from stratamesh.coordinator.records import AgentRecord
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.states import AgentState
from stratamesh.fleet.boxes import Telemetry

DETAIL_ALL_UP_TO = 100      # a fleet of at most this many agents is held in full: the UI draws every one
RECENT_S = 60.0             # agents whose state changed this recently are held in full ...
RECENT_MAX = 20             # ... the newest this many: a site going dark changes hundreds at once
SITE_LINKS_MAX = 100        # pairs of sites a view sums links up for, those with the most links first
UP_STATES = frozenset({AgentState.ONLINE, AgentState.CONNECTED})


def agent_json(agent: AgentRecord, metrics_address: str, telemetry: tuple[float, Telemetry] | None,
               versions: tuple[str, int] = ("", 0)) -> dict[str, Any]:
    """An agent as the admin API shows it (AgentView): its record, where its /metrics are, the software and
    data-plane protocol it last joined this coordinator with ("", 0: not since it started), and its newest telemetry
    with when the coordinator received it."""
    return {**plain(agent), "metrics_address": metrics_address, "software_version": versions[0],
            "protocol_version": versions[1],
            "telemetry": None if telemetry is None else plain(telemetry[1]) | {"received": telemetry[0]}}


# ------------------------------------------------------------------ pages
@dataclass(frozen=True, slots=True)
class AgentQuery:
    """One page of GET /admin/api/agents: at most limit agents whose id sorts after `after`, of those that pass every
    filter given (None: any)."""

    limit: int
    after: str | None = None
    site: str | None = None         # "": the agents that name no site
    state: str | None = None
    tier: str | None = None
    serving: bool | None = None     # holding or planned for a stage of a live plan (False: the spares)
    text: str | None = None         # a part of the agent's id, name, hostname or address, in any case

    def matches(self, agent: AgentRecord, serving: Collection[str]) -> bool:
        caps = agent.capabilities
        return ((self.site is None or caps.site == self.site) and (self.state is None or agent.state == self.state)
                and (self.tier is None or caps.tier == self.tier)
                and (self.serving is None or (agent.agent_id in serving) == self.serving)
                and (not self.text or self.text.lower() in
                     f"{agent.agent_id}\n{agent.name}\n{caps.hostname}\n{agent.address}".lower()))


def page_of(agents: Sequence[AgentRecord], query: AgentQuery,
            serving: Collection[str] = ()) -> tuple[list[AgentRecord], str | None, int]:
    """The query's page of agents (given in id order), the cursor of the page after it (None: there is none), and
    how many agents pass the filters in all. An `after` that names no agent (one gone since) still pages on."""
    matching = [a for a in agents if query.matches(a, serving)]
    start = 0 if query.after is None else bisect_right(matching, query.after, key=lambda a: a.agent_id)
    page = matching[start:start + query.limit]
    more = start + len(page) < len(matching)
    return page, page[-1].agent_id if more and page else None, len(matching)


# ------------------------------------------------------------------ the view
def agents_that_matter(agents: Sequence[AgentRecord], planned: Collection[str], draining: Collection[str],
                       now: float) -> set[str]:
    """The agents a view holds in full: every one of a fleet of up to DETAIL_ALL_UP_TO; of a larger one those the
    live plans use, those being drained or resting, and the RECENT_MAX whose state changed last (within RECENT_S)."""
    if len(agents) <= DETAIL_ALL_UP_TO:
        return {a.agent_id for a in agents}
    known = {a.agent_id for a in agents}
    recent = heapq.nlargest(RECENT_MAX, (a for a in agents if a.state_since >= now - RECENT_S),
                            key=attrgetter("state_since", "agent_id"))
    return ({a for a in (*planned, *draining) if a in known} | {a.agent_id for a in agents if a.state == AgentState.RESTING}
            | {a.agent_id for a in recent})


def site_summaries(agents: Iterable[AgentRecord], telemetry: Mapping[str, Telemetry],
                   serving: Collection[str]) -> dict[str, dict[str, Any]]:
    """Per site ("" for none), in name order: its agents by state and by tier, how many are up and how many serve a
    stage, their GPUs, GPU memory, RAM and CPUs, and the tokens/s and queue the newest telemetry of those up says."""
    sites: dict[str, dict[str, Any]] = {}
    for agent in agents:
        caps = agent.capabilities
        site = sites.get(caps.site)
        if site is None:
            site = sites[caps.site] = {"site": caps.site, "num_agents": 0, "num_up": 0, "num_serving": 0,
                                       "states": Counter(), "tiers": Counter(), "num_gpus": 0, "gpu_mem_bytes": 0,
                                       "ram_total_bytes": 0, "num_cpus": 0, "tokens_per_s": 0.0, "queue_depth": 0}
        site["num_agents"] += 1
        site["states"][agent.state] += 1
        site["tiers"][caps.tier] += 1
        site["num_gpus"] += len(caps.gpus)
        site["gpu_mem_bytes"] += sum(g.mem_total_bytes for g in caps.gpus)
        site["ram_total_bytes"] += caps.ram_total_bytes
        site["num_cpus"] += caps.num_cpus
        site["num_serving"] += agent.agent_id in serving
        if agent.state in UP_STATES:
            site["num_up"] += 1
            if (t := telemetry.get(agent.agent_id)) is not None:
                site["tokens_per_s"] += t.tokens_per_s
                site["queue_depth"] += t.queue_depth
    for site in sites.values():     # plain dicts, and a rate rounded so that noise is not a change
        site["states"], site["tiers"] = dict(sorted(site["states"].items())), dict(sorted(site["tiers"].items()))
        site["tokens_per_s"] = round(site["tokens_per_s"], 1)
    return dict(sorted(sites.items()))


def site_links(links: Iterable[LinkMeasurement], site_of: Mapping[str, str]) -> list[dict[str, Any]]:
    """The links measured between agents, summed up per pair of sites (either way; a site with itself too): how
    many, how many failed last, and the median round trip and bulk rate of the others. The origin's links are left
    out (a view holds them to the agents it holds). At most SITE_LINKS_MAX pairs, those with the most links."""
    rtts: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
    rates: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
    failed: Counter[tuple[str, str]] = Counter()
    for link in links:
        a, b = site_of.get(link.agent_id), site_of.get(link.peer_agent_id)
        if a is None or b is None:
            continue
        pair = (a, b) if a <= b else (b, a)
        if link.error:
            failed[pair] += 1
        else:
            rtts[pair].append(link.rtt_s)
            rates[pair].append(link.bandwidth_bytes_per_s)
    pairs = sorted(rtts.keys() | failed.keys(), key=lambda p: (-len(rtts[p]) - failed[p], p))[:SITE_LINKS_MAX]
    return [{"a": p[0], "b": p[1], "num_links": len(rtts[p]) + failed[p], "num_failed": failed[p],
             "rtt_s": median(rtts[p]) if rtts[p] else None,
             "bandwidth_bytes_per_s": median(rates[p]) if rates[p] else None} for p in pairs]


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet as the admin UI draws it at one moment, its parts JSON-ready."""

    ts: float
    num_agents: int
    sites: Mapping[str, dict[str, Any]]        # site -> its summary (site_summaries)
    agents: Mapping[str, dict[str, Any]]       # agent id -> its full record, for the agents that matter
    plans: list[dict[str, Any]]
    links: list[dict[str, Any]]                # among the agents held in full, and from the origin to them
    site_links: list[dict[str, Any]]
    models: list[dict[str, Any]]
    drains: list[dict[str, Any]]
    stats: dict[str, Any] | None               # the newest point
    events: list[dict[str, Any]]               # the newest few, newest first

    def snapshot(self) -> dict[str, Any]:
        """All of it as one JSON object: what a stream sends first, and GET /admin/api/snapshot."""
        return {"ts": self.ts, "num_agents": self.num_agents, "sites": list(self.sites.values()),
                "agents": list(self.agents.values()), **{key: getattr(self, key) for key in _WHOLE},
                "stats": self.stats}


_WHOLE = ("plans", "links", "site_links", "models", "drains", "events")    # each small: sent whole when it changed


def fleet_delta(old: FleetView, new: FleetView) -> dict[str, Any]:
    """What changed from old to new: the agents and sites added or changed (in full) and those removed (an agent no
    longer held in full may still be in the fleet: its site's summary counts it); the plans, links, models, drains
    and events when they changed; and always the time, the agent count and the newest stats point."""
    delta = {"ts": new.ts, "num_agents": new.num_agents, "stats": new.stats,
             "agents": _changed(old.agents, new.agents), "agents_removed": [a for a in old.agents if a not in new.agents],
             "sites": _changed(old.sites, new.sites), "sites_removed": [s for s in old.sites if s not in new.sites]}
    return delta | {key: getattr(new, key) for key in _WHOLE if getattr(new, key) != getattr(old, key)}


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Any]:
    return [value for key, value in new.items() if old.get(key) != value]
