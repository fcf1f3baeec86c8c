"""Fuzzing a real mesh while it generates: malformed Stage messages into every agent, and schemathesis against
the coordinator's HTTP API. Every generation running meanwhile ends token-identical; no process crashes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import schemathesis

from stratamesh.bench.chaos import make_jobs, run_streams
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.bench.stage_fuzz import ENDED_EARLY, Target, fuzz_concurrently
from stratamesh.launcher import LocalMesh
from tests.patience import patient

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
CASES_PER_STAGE = 300
HTTP_CASES = 15     # per operation and mode


def fuzz_http(url: str, api_key: str, counts: dict[str, int]) -> None:
    """Schemathesis against the running coordinator, as a viewer: every GET with valid and broken parameters;
    broken bodies only for /v1 (a valid one is a real generation, which the streams already are); the admin
    POSTs, which a viewer may not make, get 403. No 5xx, every answer as documented."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    from tests.coordinator.test_api_fuzz import CHECKS

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for operation in (result.ok() for result in schema.get_all_operations()):
        if operation.label == "GET /admin/api/stream":
            continue
        modes = [GenerationMode.NEGATIVE] if operation.label.startswith("POST /v1/") else \
            [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        for mode in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=HTTP_CASES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:  # noqa: ANN001
                counts[operation.label] = counts.get(operation.label, 0) + 1
                case.call_and_validate(checks=CHECKS, headers={"Authorization": f"Bearer {api_key}"})

            try:
                fuzz()
            except Unsatisfiable:
                pass


def targets_of(mesh: LocalMesh, model_dir: Path) -> dict[str, Target]:
    import httpx

    config = json.loads((model_dir / "config.json").read_text())
    [plan] = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
    return {mesh.agent_addresses[mesh.agent_ids.index(s["agent_id"])]: Target(
        s["assignment_id"], config["hidden_size"], config["vocab_size"], mesh.grpc_address) for s in plan["stages"]}


def test_malformed_stage_messages_hurt_no_generation(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    jobs = decisive(make_jobs(4, regular_token_ids(model_dir), prompt_len=20, max_tokens=160, seed=3), model_dir)
    with LocalMesh(str(model_dir), num_agents=2, num_stages=2, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        reference = asyncio.run(run_streams(mesh.url, MODEL, jobs, headers=mesh.headers))
        assert not any(o.error for o in reference)
        targets = targets_of(mesh, model_dir)
        reports = {}

        viewer_key = mesh.create_api_key("viewer", "http fuzzer")
        http_counts: dict[str, int] = {}

        async def fuzz(outcomes: list) -> None:
            channels = {address: mesh.channel(address) for address in targets}
            http = asyncio.to_thread(fuzz_http, mesh.url, viewer_key, http_counts)
            try:
                stage_reports, _ = await asyncio.gather(
                    fuzz_concurrently(channels, targets, CASES_PER_STAGE, seed=1, timeout_s=patient(10.0)), http)
                reports.update(stage_reports)
            finally:
                for channel in channels.values():
                    await channel.close()

        fuzzed = asyncio.run(run_streams(mesh.url, MODEL, jobs, during=fuzz, headers=mesh.headers))
        for address, report in reports.items():
            print(f"\n{address}: {report.num_cases} cases, statuses {dict(report.statuses)}; "
                  f"{len(report.by_case)} kinds: {dict(report.by_case)}")
            assert report.num_cases == CASES_PER_STAGE
            odd = {k: (n, report.details[k]) for k, n in report.by_case_status.items()
                   if k[1] not in ("OK", "INVALID_ARGUMENT", ENDED_EARLY)}
            assert not odd, f"answers other than OK (refused per session) or INVALID_ARGUMENT: {odd}"
        print(f"\nHTTP API: {sum(http_counts.values())} cases over {len(http_counts)} operations: {http_counts}")
        assert http_counts["POST /v1/completions"] >= HTTP_CASES and http_counts["GET /admin/api/agents"] >= 1
        assert [o.error for o in fuzzed] == [""] * len(jobs)
        assert [o.tokens for o in fuzzed] == [o.tokens for o in reference], "a generation changed under fuzzing"
        assert all(p.poll() is None for p in [mesh.coordinator, *mesh.agents]), "a process died"
        again = asyncio.run(run_streams(mesh.url, MODEL, jobs, headers=mesh.headers))
        assert [o.tokens for o in again] == [o.tokens for o in reference]
