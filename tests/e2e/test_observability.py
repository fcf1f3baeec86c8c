"""A real 3-stage mesh seen from outside: per-stage traces, Prometheus /metrics, telemetry and JSON logs."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.launcher import LocalMesh
from tests.patience import patient

pytestmark = pytest.mark.slow

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def mesh(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    """Three agents logging JSON at debug level (so session opens are logged with their trace id)."""
    logs = tmp_path_factory.mktemp("observed-mesh")
    mesh = LocalMesh(str(tiny_models["llama"]), num_agents=3, log_dir=str(logs), db=str(logs / "registry.db"),
                     extra_env={"STRATAMESH_LOG_FORMAT": "json", "STRATAMESH_LOG": "debug"}).start()
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def completion(mesh: LocalMesh) -> tuple[dict, float]:
    """One greedy completion with a prompt shorter than a KV block (no open round trip), and its latency."""
    body = {"model": "tiny-llama", "prompt": "The mesh", "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True}
    # One client, warmed: a new httpx client costs tens of milliseconds before it sends anything.
    with httpx.Client(timeout=60, headers=mesh.headers) as client:
        client.post(f"{mesh.url}/v1/completions", json={**body, "max_tokens": 2}).raise_for_status()
        start = time.perf_counter()
        response = client.post(f"{mesh.url}/v1/completions", json=body)
        latency_s = time.perf_counter() - start
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == NUM_TOKENS
    return response.json(), latency_s


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, suffix: str = "", **labels: str) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_three_stage_trace_has_a_span_per_stage_per_step_in_pipeline_order(mesh, completion) -> None:
    answer, _ = completion
    trace = httpx.get(f"{mesh.url}/admin/api/requests/{answer['id']}/trace", timeout=10, headers=mesh.headers).json()
    assert trace["state"] == "finished" and trace["unreachable"] == [] and len(trace["route"]) == 3
    by_step: dict[int, dict[tuple, float]] = defaultdict(dict)
    for span in trace["spans"]:
        assert span["end_unix_ns"] >= span["start_unix_ns"] and span["duration_s"] >= 0, span
        if span["step"] is not None:
            assert span["attributes"].get("stratamesh.session", "").startswith(answer["id"])
            by_step[span["step"]][(span["stage"], span["name"])] = span["duration_s"]
    stages = {(stage, name) for stage in range(3) for name in ("queue", "compute", "send")}
    # Step i produced token i + 1, and the last stage ran no step past the request's max_tokens.
    assert set(by_step) == set(range(NUM_TOKENS))
    for step in range(NUM_TOKENS):
        assert set(by_step[step]) == stages | {("origin", "send")}, f"step {step}: {sorted(by_step[step], key=str)}"
    # A token's step runs through the stages in pipeline order: each stage computes step i after the one before it
    # has (one clock: the stages share this host). How much of the latency the spans cover is a figure for
    # benchmarks/trace_report.py (97-98% on an idle box), not for a test on a busy one.
    computes = {(span["step"], span["stage"]): span for span in trace["spans"] if span["name"] == "compute"}
    for step in range(NUM_TOKENS):
        for stage in (1, 2):
            before, after = computes[(step, stage - 1)], computes[(step, stage)]
            assert after["start_unix_ns"] >= before["end_unix_ns"], (step, stage)
    (root,) = [s for s in trace["spans"] if s["name"] == "request"]
    assert root["parent_span_id"] == "" and all(
        s["parent_span_id"] == root["span_id"] for s in trace["spans"] if s is not root)


def test_coordinator_metrics_parse_and_count_the_generation(mesh, completion) -> None:
    families = _families(httpx.get(f"{mesh.url}/metrics", timeout=10).text)
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"):
        assert families[name].type == "histogram" and _value(families[name], "_count") >= 2, name
    assert _value(families["vllm:generation_tokens"], "_total") >= NUM_TOKENS + 2
    assert _value(families["vllm:prompt_tokens"], "_total") > 0
    assert _value(families["vllm:request_success"], "_total", finished_reason="length") >= 2
    assert families["vllm:num_requests_running"].type == "gauge"
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    assert families["stratamesh:hop_transfer_seconds"].type == "histogram"   # the last hop, into the origin
    assert _value(families["stratamesh:hop_transfer_seconds"], "_count") > 0


def test_every_agent_serves_metrics_with_per_stage_compute_and_per_hop_transfer(mesh, completion) -> None:
    stages = set()
    for address in mesh.agent_metrics:
        families = _families(httpx.get(f"http://{address}/metrics", timeout=10).text)
        compute = families["stratamesh:stage_compute_seconds"]
        assert _value(compute, "_count") > 0
        stages |= {s.labels["stage"] for s in compute.samples if s.name.endswith("_count")}
        assert _value(families["stratamesh:stage_tokens"], "_total") >= NUM_TOKENS
        assert _value(families["stratamesh:hop_transfer_bytes"], "_total") > 0
        assert _value(families["stratamesh:hop_transfer_seconds"], "_count") > 0
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            assert name in families, name
    assert stages == {"0-2", "2-4", "4-6"}


def test_heartbeat_telemetry_is_kept_per_agent(mesh, completion) -> None:
    deadline = time.monotonic() + patient(10)
    while True:
        agents = httpx.get(f"{mesh.url}/admin/api/agents", timeout=10, headers=mesh.headers).json()["agents"]
        if all(a["telemetry"] and a["telemetry"]["stages"] for a in agents) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(agents) == 3
    for agent in agents:
        (stage,) = agent["telemetry"]["stages"]
        assert stage["kv_blocks_total"] > 0 and agent["metrics_address"] in mesh.agent_metrics
        history = httpx.get(f"{mesh.url}/admin/api/agents/{agent['agent_id']}/telemetry", timeout=10,
                            headers=mesh.headers).json()
        assert len(history["telemetry"]) >= 1


def test_agent_logs_are_json_with_agent_and_trace_ids(mesh, completion) -> None:
    answer, _ = completion
    trace_id = httpx.get(f"{mesh.url}/admin/api/requests/{answer['id']}", timeout=10,
                         headers=mesh.headers).json()["trace_id"]
    records = [json.loads(line) for index in range(3)
               for line in Path(mesh.log_dir, f"agent{index}.log").read_text().splitlines() if line.startswith("{")]
    assert records and all(r.get("agent_id") for r in records)
    opened = [r for r in records if r.get("trace_id") == trace_id and "opened" in r["message"]]
    assert len({r["agent_id"] for r in opened}) == 3


def test_an_unknown_request_trace_is_a_404(mesh) -> None:
    response = httpx.get(f"{mesh.url}/admin/api/requests/cmpl-nope/trace", timeout=10, headers=mesh.headers)
    assert response.status_code == 404 and "cmpl-nope" in response.json()["error"]["message"]
