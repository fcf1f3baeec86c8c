"""Nothing lost when a box dies: kill -9 of a stage's agent mid-stream, checked against uninterrupted runs."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace
from pathlib import Path

import httpx
import jsonschema
import pytest

from stratamesh.bench.chaos import (StreamOutcome, kill_stage_mid_stream, make_jobs, metrics_pages, run_streams,
                                    wait_for_tokens)
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import MIN_MARGIN, decisive, smallest_margin, whole_model
from stratamesh.bench.metrics import percentile
from stratamesh.kernels.models.decoder import greedy_tokens
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from tests.patience import patient, wait_until
from tests.draft_models import first_layers_draft
from tests.e2e.test_drain import samples
from .streams import held, settled_requests, which_diverged

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 32, "maxItems": 32}
DASHED = r"[0-9]{4}(-[0-9]{4}){12}"
# 65 and 64 characters, each a token of the tiny tokenizer (it merges no digit): about as long as the 64-token jobs
CONSTRAINED = {1: {"guided_json": NUMBERS}, 3: {"guided_regex": DASHED}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_killing_the_middle_agent_mid_stream_loses_no_token(tiny_models: dict[str, Path], tmp_path: Path,
                                                            proposer: str) -> None:
    """3 stages and a spare; 8 streams of 64 tokens (greedy and seeded, two of those kept to a JSON schema and a
    regex, of about as many tokens, which end with their grammars); kill -9 the middle stage's agent. The new last
    stage rebuilds each grammar from the output the origin replays: the constrained streams stay valid.

    The mesh decodes speculatively (--speculative-config: ngram, or a draft model, the target's first layer): the
    greedy and seeded streams carry drafted tokens (for ngram, one's prompt a span said twice, drafted from at once),
    the constrained ones decode a token a step; every greedy stream, killed or not, is the model's greedy decoding a
    token a step in one process. The draft model runs beside the last stage: its KV dies with the killed one's, and
    the new last stage's draft starts from the output the origin replays."""
    model_dir = tiny_models["llama"]
    speculative_config = NGRAM if proposer == "ngram" else {
        "method": "draft_model", "num_speculative_tokens": 4,
        "model": str(first_layers_draft(model_dir, tmp_path / "draft"))}
    vocab, stage = regular_token_ids(model_dir), whole_model(model_dir)
    jobs = decisive(make_jobs(8, vocab, prompt_len=20, max_tokens=64, seed=3), model_dir)
    for i, constraint in CONSTRAINED.items():       # seeded jobs (decisive() draws margins for greedy ones only)
        jobs[i] = replace(jobs[i], max_tokens=100, constraint=constraint)
    repeated = (replace(job, prompt_ids=job.prompt_ids[:10] * 2)     # as decisive as the others
                for job in make_jobs(40, vocab, prompt_len=20, max_tokens=64, seed=8) if job.temperature == 0)
    jobs[0] = next(job for job in repeated if smallest_margin(stage, job.prompt_ids, job.max_tokens) >= MIN_MARGIN)
    with LocalMesh(str(model_dir), num_agents=4, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db"),
                   coordinator_args=["--speculative-config", json.dumps(speculative_config)]) as mesh:
        run = asyncio.run(kill_stage_mid_stream(mesh, MODEL, held(jobs), stage=1))
        records = settled_requests(mesh, 8)
        pages = [page for page in metrics_pages(mesh).values() if page]

        def speculation() -> dict:      # the admin API's, from the serving last stage's newest heartbeat
            return httpx.get(f"{mesh.url}/admin/api/models", headers=mesh.headers).json()["models"][0]["speculation"]

        wait_until(lambda: speculation()["draft_tokens"] > 0, timeout_s=30)
        seen = speculation()
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    assert 0 <= seen["accepted_tokens"] <= seen["draft_tokens"] and seen["acceptance_rate"] == pytest.approx(
        seen["accepted_tokens"] / seen["draft_tokens"])
    assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference], which_diverged(   # none repeated,
        model_dir, jobs, reference=run.reference, failover=run.outcomes)                            # none missing
    greedy = [i for i, job in enumerate(jobs) if job.temperature == 0]
    assert [run.outcomes[i].tokens for i in greedy] == [
        greedy_tokens(stage, list(jobs[i].prompt_ids), jobs[i].max_tokens) for i in greedy]
    spec = [samples("", page) for page in pages]
    drafts, accepted = (sum(c.get(f"vllm:spec_decode_num_{name}_total", 0.0) for c in spec)
                        for name in ("drafts", "accepted_tokens"))
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    jsonschema.validate(json.loads(run.outcomes[1].text), NUMBERS)
    assert re.fullmatch(DASHED, run.outcomes[3].text), run.outcomes[3].text
    assert all(len(run.outcomes[i].tokens) >= 60 for i in CONSTRAINED)     # about as long as the others
    assert len(run.routes_after) == 8 and all(run.killed_address not in r for r in run.routes_after)
    assert all(r["num_failovers"] >= 1 and r["state"] == "finished" for r in records)
    assert len(run.stalls) == 8
    print(f"\nkill -9 of the middle stage: stall (kill to next token) p50 {percentile(run.stalls, 50) * 1e3:.0f} ms, "
          f"max {max(run.stalls) * 1e3:.0f} ms over {len(run.stalls)} streams")


async def num_sessions(mesh: LocalMesh) -> list[int]:
    """Open sessions on each agent, by its Stage.Info."""
    out = []
    for address in mesh.agent_addresses:
        async with mesh.channel(address) as channel:
            out.append((await pb_grpc.StageStub(channel).Info(pb.StageInfoRequest(), timeout=10)).num_sessions)
    return out


def test_a_coordinator_crash_cuts_its_streams_frees_the_stages_and_a_restart_serves_again(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The origin lives in the coordinator: its generations end with it; stages must not keep their KV."""
    model_dir = tiny_models["llama"]
    jobs = decisive(make_jobs(2, regular_token_ids(model_dir), prompt_len=20, max_tokens=400, seed=5), model_dir)
    with LocalMesh(str(model_dir), num_agents=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:

        async def crash(outcomes: list[StreamOutcome]) -> None:
            await wait_for_tokens(outcomes, 8)
            assert sum(await num_sessions(mesh)) == 2 * 3
            mesh.kill_coordinator()

        cut = asyncio.run(run_streams(mesh.url, MODEL, jobs, during=crash, headers=mesh.headers))
        assert all(o.error and 8 <= len(o.tokens) < 400 for o in cut)
        deadline = time.monotonic() + patient(10)
        while sum(left := asyncio.run(num_sessions(mesh))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [0, 0, 0]
        mesh.start_coordinator(deploy=False)        # the model and its plan come from the registry
        mesh.wait_ready(60)
        again = asyncio.run(run_streams(mesh.url, MODEL, [replace(j, max_tokens=8) for j in jobs],
                                        headers=mesh.headers))
    assert [o.tokens for o in again] == [o.tokens[:8] for o in cut]


def test_an_agent_joining_mid_stream_disturbs_nothing_and_the_next_plan_uses_it(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    vocab = regular_token_ids(model_dir)
    long_jobs = decisive(make_jobs(8, vocab, prompt_len=20, max_tokens=120, seed=7), model_dir)
    with LocalMesh(str(model_dir), num_agents=3, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        reference = asyncio.run(run_streams(mesh.url, MODEL, long_jobs, headers=mesh.headers))
        joined: dict[str, bool] = {}
        release = asyncio.Event()

        async def join(outcomes: list[StreamOutcome]) -> None:
            try:
                await wait_for_tokens(outcomes, 8)
                await asyncio.to_thread(mesh.start_agent, 3)
                async with httpx.AsyncClient(timeout=10, headers=mesh.headers) as client:
                    while len([a for a in (await client.get(f"{mesh.url}/admin/api/agents")).json()["agents"]
                               if a["state"] == "connected"]) < 4:
                        await asyncio.sleep(0.05)
                joined["while streaming"] = not any(o.end_s for o in outcomes)
            finally:
                release.set()       # the held streams end at their 120 tokens from here on

        during_join = asyncio.run(run_streams(mesh.url, MODEL, held(long_jobs), during=join,
                                              headers=mesh.headers, release=release))
        records = settled_requests(mesh, 8)
        assert joined["while streaming"]                                  # it joined while they streamed
        assert [o.tokens for o in during_join] == [o.tokens for o in reference]
        assert [r["num_failovers"] for r in records] == [0] * 8          # nobody was moved
        jobs = held(decisive(make_jobs(8, vocab, 20, 64, seed=8), model_dir))
        run = asyncio.run(kill_stage_mid_stream(mesh, MODEL, jobs, stage=1))
        assert [o.tokens for o in run.outcomes] == [o.tokens for o in run.reference], which_diverged(
            model_dir, jobs, reference=run.reference, failover=run.outcomes)
        assert all(mesh.agent_addresses[3] in route for route in run.routes_after)   # the newcomer took over
