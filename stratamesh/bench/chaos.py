"""Failover under load: streams completions at a local mesh while agents die by SIGKILL, and checks every output.

A stream's reference is the same request run on an undisturbed mesh: greedy and seeded sampling both give
the same tokens again, so a failover that repeats, drops or changes a token shows as a mismatch."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.metrics import percentile
from stratamesh.launcher import LocalMesh


@dataclass(frozen=True, slots=True)
class StreamJob:
    """One completion: a token-id prompt, how many tokens, greedy (temperature 0) or seeded sampling.

    hold_tokens > max_tokens holds the generation open: the request asks for hold_tokens, and the client ends the
    stream itself at max_tokens once the run is released (see run_streams), so it cannot end while a test still
    needs it running. Greedy and seeded outputs are prefixes of each other, so its max_tokens are comparable.

    A constrained job (constraint: the body's structured-output fields, {"guided_regex": ...} say) ends where its
    grammar ends, EOS and all, within max_tokens: it is never held, and its stream must end with finish_reason
    "stop"."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    hold_tokens: int = 0
    constraint: Mapping[str, Any] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        """Whether the job is held open (hold_tokens, and no constraint)."""
        return bool(self.hold_tokens) and not self.constraint

    def body(self, model: str) -> dict[str, Any]:
        asked = max(self.hold_tokens, self.max_tokens) if self.held else self.max_tokens
        body = {"model": model, "prompt": list(self.prompt_ids), "max_tokens": asked, "ignore_eos": not self.constraint,
                "temperature": self.temperature, "stream": True, "return_token_ids": True}
        return body | ({"seed": self.seed} if self.seed is not None else {}) | dict(self.constraint)


@dataclass(slots=True)
class StreamOutcome:
    """What a client saw: each token id with when it arrived (time.monotonic), or why the stream failed."""

    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)   # every token's arrival, a held stream's past max_tokens too
    text: str = ""              # every chunk's text (a held stream's past max_tokens too)
    finish_reason: str = ""
    error: str = ""
    request_id: str = ""        # the response id: the request's id in the admin API
    end_s: float = 0.0          # when the stream ended (0 while it runs)


def make_jobs(num_jobs: int, vocab_ids: Sequence[int], prompt_len: int, max_tokens: int,
              seed: int = 0) -> list[StreamJob]:
    """Random prompts; every other job samples (temperature 0.8, its own seed), the rest are greedy."""
    rng = random.Random(seed)
    return [StreamJob(tuple(rng.choice(vocab_ids) for _ in range(prompt_len)), max_tokens,
                      0.8 if i % 2 else 0.0, seed * 1000 + i if i % 2 else None) for i in range(num_jobs)]


async def stream(client: httpx.AsyncClient, url: str, model: str, job: StreamJob,
                 outcome: StreamOutcome | None = None, release: asyncio.Event | None = None) -> StreamOutcome:
    """Streams one completion into outcome (a new one if None): failures are recorded, never raised. A held job
    (hold_tokens) ends once release is set and it has max_tokens; it keeps those."""
    outcome = outcome if outcome is not None else StreamOutcome()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=job.body(model)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {text[:300]}"
                return outcome
            async for line in response.aiter_lines():
                payload = line[5:].strip() if line.startswith("data:") else ""
                if not payload or payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if "error" in data:
                    outcome.error = str(data["error"])[:300]
                outcome.request_id = outcome.request_id or data.get("id", "")
                for choice in data.get("choices") or ():
                    ids, now = choice.get("token_ids") or (), time.monotonic()
                    outcome.tokens += ids
                    outcome.arrivals += [now] * len(ids)
                    outcome.text += choice.get("text") or ""
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                if _released(job, outcome, release):
                    break       # leaving the block closes the response: the mesh ends the generation
    except (httpx.HTTPError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if job.held:
        del outcome.tokens[job.max_tokens:]
    outcome.end_s = time.monotonic()
    if outcome.error:
        return outcome
    if job.constraint and outcome.finish_reason != "stop":
        outcome.error = f"{len(outcome.tokens)} tokens, ended by {outcome.finish_reason or 'nothing'}, not its grammar"
    elif not job.constraint and len(outcome.tokens) != job.max_tokens:
        outcome.error = f"{len(outcome.tokens)} tokens, asked for {job.max_tokens}"
    return outcome


def _released(job: StreamJob, outcome: StreamOutcome, release: asyncio.Event | None) -> bool:
    """Whether a held job's stream may end now: released, with its max_tokens in."""
    return job.held and (release is None or release.is_set()) and len(outcome.tokens) >= job.max_tokens


async def run_streams(url: str, model: str, jobs: Sequence[StreamJob],
                      during: Callable[[list[StreamOutcome]], Awaitable[None]] | None = None,
                      timeout_s: float = 300.0, headers: dict[str, str] | None = None,
                      release: asyncio.Event | None = None) -> list[StreamOutcome]:
    """Streams every job at once (sending headers: the API key); during(outcomes), if given, runs alongside
    and sees them fill in. Held jobs (StreamJob.hold_tokens) run until release is set (by during, say)."""
    outcomes = [StreamOutcome() for _ in jobs]
    async with _client(timeout_s, headers) as client:
        streams = asyncio.gather(*(stream(client, url, model, j, o, release) for j, o in zip(jobs, outcomes)))
        if during is not None:
            await asyncio.gather(streams, during(outcomes))
        else:
            await streams
    return outcomes


def _client(timeout_s: float, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """One client for many concurrent streams: no cap on its connections."""
    return httpx.AsyncClient(timeout=timeout_s, headers=headers,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def stalls_after(kill_s: float, outcomes: Sequence[StreamOutcome]) -> list[float]:
    """For each stream with tokens before and after kill_s: seconds from the kill to its next token (counting a held
    stream's tokens past its max_tokens: on a busy box the kill may fall after them)."""
    out = []
    for o in outcomes:
        if o.arrivals and o.arrivals[0] < kill_s < o.arrivals[-1]:
            out.append(next(t for t in o.arrivals if t > kill_s) - kill_s)
    return out


async def wait_for_tokens(outcomes: Sequence[StreamOutcome], num_tokens: int, timeout_s: float = 60.0) -> None:
    """Returns once every stream has at least num_tokens tokens (or has ended)."""
    deadline = time.monotonic() + timeout_s
    while any(len(o.tokens) < num_tokens and not o.end_s for o in outcomes):
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {num_tokens} tokens in {timeout_s:.0f} s")
        await asyncio.sleep(0.005)


# ------------------------------------------------------------------ one kill
@dataclass(slots=True)
class FailoverRun:
    """Streams with one stage's agent killed mid-way, the same streams undisturbed, and where the kill fell."""

    reference: list[StreamOutcome]
    outcomes: list[StreamOutcome]
    killed_address: str = ""                                       # the stage's agent killed (or drained)
    killed_index: int = -1          # ... its index in the mesh, read at the kill (a restart gives it a new address)
    kill_s: float = 0.0                                            # time.monotonic of the kill (or drain order)
    routes_after: list[list[str]] = field(default_factory=list)   # running requests' routes after the failover
    drain_output: str = ""                                         # what `stratamesh drain` printed, and ...
    drain_exit: int | None = None                                  # ... its exit code
    killed_rank_pids: dict[int, list[int]] = field(default_factory=dict)   # the killed agent's ranks > 0, by rank
    # the coordinator's /metrics page and each agent's at the drain order (a late agent's plan switch may have moved
    # sessions before it: what the drain moved is what the counters gained since)
    metrics_before: dict[str, str] = field(default_factory=dict)

    @property
    def stalls(self) -> list[float]:
        return stalls_after(self.kill_s, self.outcomes)

    @property
    def largest_gaps(self) -> list[float]:
        """Per stream still running at kill_s: its longest wait for a token from then on."""
        return [max(b - a for a, b in zip([self.kill_s] + o.arrivals, o.arrivals) if b > self.kill_s)
                for o in self.outcomes if o.arrivals and o.arrivals[-1] > self.kill_s]


async def running_routes(client: httpx.AsyncClient, url: str) -> list[list[str]]:
    """The Stage addresses of every running request's current route, in pipeline order."""
    records = (await client.get(f"{url}/admin/api/requests")).json()["requests"]
    return [[hop["address"] for hop in r["route"]] for r in records if r["state"] == "running"]


async def wait_for_failover(url: str, headers: dict[str, str], address: str, timeout_s: float = 60.0) -> None:
    """Returns once no running request's route passes through address any more (or timeout_s has passed: the
    caller's check of the routes then fails). Tokens arriving prove nothing: the ring may have computed them
    before the agent at address died."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        while any(address in route for route in await running_routes(client, url)):
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)


async def kill_stage_mid_stream(mesh: LocalMesh, model: str, jobs: Sequence[StreamJob], stage: int = 1,
                                after_tokens: int = 16) -> FailoverRun:
    """Runs the jobs undisturbed, then again with a kill -9 of the agent serving `stage` once every stream
    has after_tokens tokens (held jobs run on until the kill's effects are read: see StreamJob)."""
    async def kill(run: FailoverRun, outcomes: list[StreamOutcome]) -> None:
        run.killed_index = mesh.agent_index(run.killed_address)
        mesh.kill_agent(run.killed_index)
        await wait_for_failover(mesh.url, mesh.headers, run.killed_address)

    return await disturb_stage_mid_stream(mesh.url, mesh.headers, model, jobs, stage, after_tokens, kill)


async def kill_rank_mid_stream(mesh: LocalMesh, model: str, jobs: Sequence[StreamJob], stage: int = 1,
                               rank: int = 1, after_tokens: int = 16) -> FailoverRun:
    """As kill_stage_mid_stream, but kill -9 of one rank > 0 of the tensor-parallel group serving `stage`: a
    process its agent launched. The agent takes the group down and exits; the rest is the failover path.

    That rank is killed in every group the agent holds: beside the serving group it may hold another of the
    stage (a standby plan's, or a replaced stage's kept for reuse), and which process serves is not visible."""
    async def kill(run: FailoverRun, outcomes: list[StreamOutcome]) -> None:
        run.killed_index = mesh.agent_index(run.killed_address)
        run.killed_rank_pids = mesh.rank_pids(run.killed_index)
        for pid in run.killed_rank_pids[rank]:
            os.kill(pid, signal.SIGKILL)
        await wait_for_failover(mesh.url, mesh.headers, run.killed_address)

    return await disturb_stage_mid_stream(mesh.url, mesh.headers, model, jobs, stage, after_tokens, kill)


async def drain_stage_mid_stream(mesh: LocalMesh, model: str, jobs: Sequence[StreamJob], stage: int = 1,
                                 after_tokens: int = 16) -> FailoverRun:
    """Runs the jobs undisturbed, then again with the agent serving `stage` drained by `stratamesh drain` once
    every stream has after_tokens tokens."""
    async def drain(run: FailoverRun, outcomes: list[StreamOutcome]) -> None:
        agent_id = mesh.agent_ids[mesh.agent_index(run.killed_address)]
        run.metrics_before = await asyncio.to_thread(metrics_pages, mesh)
        command = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stratamesh.cli", "drain", agent_id, "--url", mesh.url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "STRATAMESH_API_KEY": mesh.api_key})
        run.drain_output = (await command.communicate())[0].decode(errors="replace")
        run.drain_exit = command.returncode

    return await disturb_stage_mid_stream(mesh.url, mesh.headers, model, jobs, stage, after_tokens, drain)


def metrics_pages(mesh: LocalMesh) -> dict[str, str]:
    """The coordinator's /metrics page ("coordinator") and each agent's (by its metrics address; "" for one gone)."""
    import urllib.request

    with urllib.request.urlopen(f"{mesh.url}/metrics", timeout=10) as response:
        pages = {"coordinator": response.read().decode()}
    for index, address in enumerate(mesh.agent_metrics):
        try:
            pages[address] = mesh.metrics_text(index)
        except OSError:
            pages[address] = ""
    return pages


async def disturb_stage_mid_stream(
        url: str, headers: dict[str, str], model: str, jobs: Sequence[StreamJob], stage: int, after_tokens: int,
        disturb: Callable[[FailoverRun, list[StreamOutcome]], Awaitable[None]]) -> FailoverRun:
    """On the mesh at url: the jobs undisturbed, then again with disturb() done to the agent of `stage`
    (run.killed_address) once every stream has after_tokens tokens; the running routes are read when disturb()
    returns."""
    plain = [replace(j, hold_tokens=0) for j in jobs]      # the reference runs undisturbed, to its end
    run = FailoverRun(await run_streams(url, model, plain, headers=headers), [])

    release = asyncio.Event()

    async def during(outcomes: list[StreamOutcome]) -> None:
        try:
            await wait_for_tokens(outcomes, after_tokens)
            async with httpx.AsyncClient(timeout=10, headers=headers) as client:
                run.killed_address = (await running_routes(client, url))[0][stage]
                run.kill_s = time.monotonic()
                await disturb(run, outcomes)
                run.routes_after = await running_routes(client, url)
        finally:
            release.set()

    run.outcomes = await run_streams(url, model, jobs, during=during, headers=headers, release=release)
    return run


# ------------------------------------------------------------------ the chaos run
@dataclass(slots=True)
class ChaosReport:
    """What a chaos run did and saw."""

    duration_s: float
    num_clients: int
    kills: list[tuple[float, int]] = field(default_factory=list)     # (time.monotonic, agent index)
    results: list[tuple[int, StreamOutcome]] = field(default_factory=list)   # (job index, outcome)
    num_mismatched: int = 0
    stalls: list[float] = field(default_factory=list)   # kill to next token, of each stream that failed over
    num_failovers: int = 0

    @property
    def num_failed(self) -> int:
        return sum(1 for _, o in self.results if o.error)

    @property
    def num_completed(self) -> int:
        return len(self.results) - self.num_failed


async def run_chaos(mesh: LocalMesh, model: str, jobs: Sequence[StreamJob], duration_s: float,
                    num_clients: int, kill_every_s: float, seed: int = 0) -> ChaosReport:
    """num_clients stream jobs back to back for duration_s while a random agent is killed (SIGKILL) every
    kill_every_s and started again; each output is checked against an undisturbed run of the same job."""
    references = [o.tokens for o in await run_streams(mesh.url, model, jobs, headers=mesh.headers)]
    rng, report = random.Random(seed), ChaosReport(duration_s, num_clients)
    start = time.monotonic()
    async with _client(300.0, mesh.headers) as client:

        async def client_loop(first: int) -> None:
            n = first
            while time.monotonic() < start + duration_s:
                job = n % len(jobs)
                report.results.append((job, await stream(client, mesh.url, model, jobs[job])))
                n += num_clients

        async def killer() -> None:
            for at in itertools.count(1):
                if at * kill_every_s >= duration_s:
                    return
                await asyncio.sleep(max(0.0, start + at * kill_every_s - time.monotonic()))
                index = rng.randrange(len(mesh.agents))
                report.kills.append((time.monotonic(), index))
                mesh.kill_agent(index)
                await asyncio.to_thread(mesh.start_agent, index)

        await asyncio.gather(killer(), *(client_loop(i) for i in range(num_clients)))
        records = (await client.get(f"{mesh.url}/admin/api/requests", params={"limit": 1000})).json()["requests"]
    failovers = {r["request_id"]: r["num_failovers"] for r in records}
    report.num_mismatched = sum(1 for job, o in report.results if not o.error and o.tokens != references[job])
    report.num_failovers = sum(failovers.get(o.request_id, 0) for _, o in report.results)
    moved = [o for _, o in report.results if failovers.get(o.request_id, 0)]
    report.stalls = [s for kill_s, _ in report.kills for s in stalls_after(kill_s, moved)]
    return report


def format_chaos(report: ChaosReport) -> str:
    """The run as a table: requests, outcomes, kills, failovers and stalls."""
    errors = sorted({o.error for _, o in report.results if o.error})
    rows = [("duration", f"{report.duration_s:.0f} s"), ("concurrent clients", str(report.num_clients)),
            ("agents killed (SIGKILL) and restarted", f"{len(report.kills)} (indexes "
                                                      f"{', '.join(str(i) for _, i in report.kills) or '-'})"),
            ("requests completed", str(report.num_completed)), ("requests failed", str(report.num_failed)),
            ("outputs differing from the undisturbed run", str(report.num_mismatched)),
            ("failovers (a generation resumed on a new route)", str(report.num_failovers)),
            ("stall, kill to next token, p50", _ms(report.stalls, percentile(report.stalls, 50))),
            ("stall, kill to next token, p99", _ms(report.stalls, percentile(report.stalls, 99))),
            ("stall, kill to next token, max", _ms(report.stalls, max(report.stalls, default=0.0)))]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines + [f"error: {e}" for e in errors[:5]])


def _ms(stalls: Sequence[float], seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if stalls else "-"


def chaos_main(model_dir: str, num_agents: int, num_stages: int, duration_s: float, num_clients: int,
               kill_every_s: float, num_jobs: int, prompt_len: int, max_tokens: int, seed: int,
               min_margin: float = 1e-4) -> ChaosReport:
    """`stratamesh bench chaos`: starts a local mesh, runs the chaos and prints the table. Greedy prompts are drawn
    so that each greedy step leads its runner-up by min_margin (bench.margins; 0: any prompt): a failover reorders
    float sums, so an output that differs on a closer step says nothing about the mesh."""
    jobs = make_jobs(num_jobs, regular_token_ids(model_dir), prompt_len, max_tokens, seed)
    if min_margin > 0:
        from stratamesh.bench.margins import decisive     # (it imports this module, and torch)
        jobs = decisive(jobs, model_dir, seed, min_margin)
        print(f"greedy prompts drawn so that each of their greedy steps leads by {min_margin:g} or more", flush=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)    # one line per request would bury the table
    with LocalMesh(model_dir, num_agents=num_agents, num_stages=num_stages) as mesh:
        print(f"mesh of {num_agents} agents ({num_stages} stages) up; logs in {mesh.log_dir}", flush=True)
        report = asyncio.run(run_chaos(mesh, Path(model_dir).resolve().name, jobs, duration_s, num_clients,
                                       kill_every_s, seed))
    print(format_chaos(report), flush=True)
    return report
