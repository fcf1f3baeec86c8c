"""Speculative decoding across the pipeline (--speculative-config, ngram): a 3-stage mesh gives greedy generations
exactly the tokens of decoding one token a step in one process, with several tokens a trip where the drafts hold,
also when its middle agent is killed mid-stream; sampled generations beside them decode a token a step."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from stratamesh.bench.chaos import kill_stage_mid_stream, make_jobs, metrics_pages
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import MIN_MARGIN, decisive, smallest_margin, whole_model
from stratamesh.kernels.models.decoder import greedy_tokens
from stratamesh.launcher import LocalMesh
from tests.e2e.test_drain import samples
from .streams import held, which_diverged

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_greedy_generations_speculate_and_keep_their_tokens_through_a_kill(tiny_models: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    vocab, stage = regular_token_ids(model_dir), whole_model(model_dir)
    jobs = decisive(make_jobs(6, vocab, prompt_len=20, max_tokens=48, seed=7), model_dir)
    # an input-grounded job: its prompt a span said twice, which the lookup drafts from at once (the first such
    # prompt whose greedy steps are as decisive as the others')
    repeated = (replace(job, prompt_ids=job.prompt_ids[:10] * 2)
                for job in make_jobs(40, vocab, prompt_len=20, max_tokens=48, seed=8) if job.temperature == 0)
    jobs[0] = next(job for job in repeated if smallest_margin(stage, job.prompt_ids, job.max_tokens) >= MIN_MARGIN)
    with LocalMesh(str(model_dir), num_agents=4, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db"),
                   coordinator_args=["--speculative-config", json.dumps(NGRAM)]) as mesh:
        run = asyncio.run(kill_stage_mid_stream(mesh, MODEL, held(jobs), stage=1))
        pages = [page for page in metrics_pages(mesh).values() if page]
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    for i, job in enumerate(jobs):
        if job.temperature == 0:        # a token a step, in one process
            expected = greedy_tokens(stage, list(job.prompt_ids), job.max_tokens)
            assert run.reference[i].tokens == expected == run.outcomes[i].tokens, which_diverged(
                model_dir, jobs, reference=run.reference, failover=run.outcomes)
        else:
            assert run.outcomes[i].tokens == run.reference[i].tokens
    counts = [samples("", page) for page in pages]
    drafts, accepted = (sum(c.get(f"vllm:spec_decode_num_{name}_total", 0.0) for c in counts)
                        for name in ("drafts", "accepted_tokens"))
    print(f"\nspeculation: {drafts:.0f} steps with drafts, {accepted:.0f} drafted tokens kept")
    assert drafts > 0 and accepted > 0
