"""bench serve: metric math, datasets and arrival schedule on plain values; one run against a real mesh."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from stratamesh.bench.datasets import (
    BenchRequest,
    make_requests,
    regular_token_ids,
    shared_prefix_requests,
)
from stratamesh.bench.metrics import (
    BenchError,
    RequestRecord,
    compute_metrics,
    is_good,
    parse_goodput,
    percentile,
)
from stratamesh.bench.options import ServeOptions, add_serve_arguments, options_from_args, parse_rate_schedule
from stratamesh.bench.report import format_json, format_report
from stratamesh.bench.serve import (
    arrival_offsets_s,
    scheduled_offsets_s,
    auth_headers,
    parse_sse_line,
    record_from_stream,
    request_body,
)


def _record(ttft: float, latency: float, tokens: int, itl: tuple[float, ...] = (), prompt: int = 10,
            cached: int = 0) -> RequestRecord:
    return RequestRecord(True, prompt, tokens, ttft, latency, itl, cached)


# ------------------------------------------------------------------ metrics
@pytest.mark.parametrize("values, p, expected", [
    ([], 50, 0.0),
    ([7.0], 99, 7.0),
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 90, 3.7),            # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    ([10.0, 20.0, 30.0, 40.0, 50.0], 99, 49.6),  # rank 3.96 -> 40 + 0.96 * 10
    ([10.0, 20.0, 30.0, 40.0, 50.0], 0, 10.0),
    ([10.0, 20.0, 30.0, 40.0, 50.0], 100, 50.0),
])
def test_percentile_interpolates_linearly_like_numpy(values: list[float], p: float, expected: float) -> None:
    assert percentile(values, p) == pytest.approx(expected)


@pytest.mark.parametrize("ttft, latency, tokens, tpot", [
    (0.100, 0.500, 5, 0.100),    # (0.5 - 0.1) / 4
    (0.100, 0.130, 2, 0.030),
    (0.100, 0.100, 1, 0.0),      # one token: no TPOT (0, as vLLM's goodput counts it)
    (0.0, 0.0, 0, 0.0),
])
def test_tpot_is_decode_time_over_tokens_after_the_first(ttft: float, latency: float, tokens: int,
                                                         tpot: float) -> None:
    assert _record(ttft, latency, tokens).tpot_s == pytest.approx(tpot)


def test_metrics_of_a_hand_computed_run() -> None:
    records = [
        _record(0.100, 0.500, 5, (0.1, 0.1, 0.1, 0.1), prompt=10, cached=4),
        _record(0.200, 0.200, 1, (), prompt=20),                 # one token: no TPOT, no ITL
        _record(0.300, 0.900, 4, (0.2, 0.4), prompt=30),         # a chunk of 2 tokens is one gap
        RequestRecord(False, 40, error="HTTP 500: boom"),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (60, 10, 4)
    assert m.prefix_hit_rate == pytest.approx(4 / 60) and m.to_dict()["prefix_hit_rate"] == m.prefix_hit_rate
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(35.0)
    assert m.request_goodput is None
    assert m.ttft.mean_ms == pytest.approx(200.0) and m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.p90_ms == pytest.approx(280.0) and m.ttft.p99_ms == pytest.approx(298.0)
    assert m.tpot.mean_ms == pytest.approx(150.0)             # mean of 100 and 200, the 1-token one left out
    assert m.itl.mean_ms == pytest.approx(1000 * 1.0 / 6)
    assert m.itl.median_ms == pytest.approx(100.0)
    assert m.e2el.mean_ms == pytest.approx(1000 * 1.6 / 3)
    assert m.errors == ("HTTP 500: boom",)


def test_metrics_of_a_run_where_everything_failed() -> None:
    m = compute_metrics([RequestRecord(False, 5, error="x")], duration_s=1.0, slos_ms={"ttft": 10})
    assert (m.completed, m.failed, m.request_throughput, m.request_goodput) == (0, 1, 0.0, 0.0)
    assert m.ttft.mean_ms == 0.0 and m.itl.p99_ms == 0.0


def test_goodput_counts_requests_that_meet_every_slo() -> None:
    fast = _record(0.050, 0.150, 11)                # TPOT 10 ms
    slow_decode = _record(0.050, 0.550, 11)         # TPOT 50 ms
    slow_start = _record(0.500, 0.600, 11)          # TTFT 500 ms
    single = _record(0.050, 0.050, 1)               # TPOT counts as 0
    slos = parse_goodput(["ttft:100", "tpot:20"])
    assert [is_good(r, slos) for r in (fast, slow_decode, slow_start, single)] == [True, False, False, True]
    assert compute_metrics([fast, slow_decode, slow_start, single], 4.0, slos).request_goodput == 0.5
    assert is_good(fast, {"ttft": 50.0})            # at the SLO is good (vLLM: slo >= measured)
    assert not is_good(fast, {"e2el": 149.0})


@pytest.mark.parametrize("specs", [["ttft"], ["ttft:x"], ["itl:10"], ["tpot:-1"]])
def test_bad_goodput_specs_are_named_errors(specs: list[str]) -> None:
    with pytest.raises(BenchError):
        parse_goodput(specs)


def test_json_result_names_metrics_like_vllm() -> None:
    options = ServeOptions(model="m", vocab_size=10, max_concurrency=2)
    m = compute_metrics([_record(0.1, 0.5, 5, (0.1,) * 4)], 1.0, {"ttft": 200})
    result = json.loads(format_json(m, options, [_record(0.1, 0.5, 5, (0.1,) * 4)]))
    assert result["median_ttft_ms"] == pytest.approx(100.0) and result["p99_tpot_ms"] == pytest.approx(100.0)
    assert result["completed"] == 1 and result["request_goodput"] == 1.0 and result["request_rate"] is None
    assert result["ttfts"] == [0.1] and result["e2els"] == [0.5] and result["output_lens"] == [5]
    table = format_report(m, options)
    assert "Maximum request concurrency:             2" in table
    assert "Request goodput (req/s):" in table and "Median TTFT (ms):                        100.00" in table
    assert result["spec_decode_draft_tokens"] is None and "Speculative Decoding" not in table
    # speculative decoding's section, as vLLM prints it, where the server said what was drafted and kept
    drafted = json.loads(format_json(m, options, drafts=(40, 10)))
    assert (drafted["spec_decode_draft_tokens"], drafted["spec_decode_accepted_tokens"]) == (40, 10)
    assert drafted["spec_decode_acceptance_rate"] == pytest.approx(0.25)
    assert "Acceptance rate (%):                     25.00" in format_report(m, options, (40, 10))


# ------------------------------------------------------------------ stream parsing
def _sse(choice: dict | None = None, usage: dict | None = None) -> str:
    return "data: " + json.dumps({"choices": [choice] if choice else [], "usage": usage})


def test_record_from_stream_times_token_chunks_and_counts_token_ids() -> None:
    usage = {"prompt_tokens": 8, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}
    events = [(10.5, _sse({"text": "a", "token_ids": [5]})), (10.5, ""),
              (10.7, _sse({"text": "bc", "token_ids": [6, 7]})),
              (10.8, _sse({"text": "", "token_ids": [8]})),                 # text may be held back
              (10.9, _sse({"text": "", "token_ids": [], "finish_reason": "length"})),
              (11.0, _sse(None, usage)), (11.0, "data: [DONE]")]
    r = record_from_stream(8, 10.0, events)
    assert r.success and r.output_tokens == 4 and r.cached_tokens == 6
    assert r.ttft_s == pytest.approx(0.5) and r.latency_s == pytest.approx(0.8)
    assert r.itl_s == pytest.approx((0.2, 0.1))
    assert r.tpot_s == pytest.approx(0.1)


def test_record_from_stream_without_token_ids_uses_usage() -> None:
    events = [(1.0, _sse({"text": "a"})), (2.0, _sse({"text": "bc"})), (3.0, _sse(None, {"completion_tokens": 3}))]
    r = record_from_stream(1, 0.0, events)
    assert (r.output_tokens, r.cached_tokens, r.ttft_s, r.latency_s) == (3, 0, 1.0, 2.0)


@pytest.mark.parametrize("events, error", [
    ([], "no chunk carried a token"),
    ([(1.0, _sse({"text": "a", "token_ids": [1]})), (2.0, 'data: {"error": {"message": "gone"}}')], "gone"),
    ([(1.0, "data: {not json")], "bad event"),
])
def test_record_from_stream_failures(events: list[tuple[float, str]], error: str) -> None:
    r = record_from_stream(3, 0.0, events)
    assert not r.success and error in r.error and r.prompt_len == 3


def test_parse_sse_line_ignores_non_data_lines() -> None:
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("data: [DONE]") is None
    assert parse_sse_line("event: x") is None


def test_request_body_asks_for_exact_greedy_streamed_token_ids() -> None:
    body = request_body("m", BenchRequest((3, 4, 5), 7))
    assert body["prompt"] == [3, 4, 5] and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True


# ------------------------------------------------------------------ datasets and arrivals
def test_datasets_are_deterministic_per_seed() -> None:
    vocab = list(range(3, 1000))
    first = make_requests("random", vocab, 5, 16, 4, seed=1)
    assert first == make_requests("random", vocab, 5, 16, 4, seed=1)
    assert first != make_requests("random", vocab, 5, 16, 4, seed=2)
    assert all(r.prompt_len == 16 and r.output_len == 4 and set(r.prompt_ids) <= set(vocab) for r in first)
    assert len({r.prompt_ids for r in first}) == 5


def test_random_range_ratio_spreads_lengths_like_vllm() -> None:
    requests = make_requests("random", list(range(3, 1000)), 200, 100, 40, seed=3, range_ratio=0.5)
    inputs, outputs = [r.prompt_len for r in requests], [r.output_len for r in requests]
    assert 50 <= min(inputs) < 60 and 140 < max(inputs) <= 150
    assert 20 <= min(outputs) and max(outputs) <= 60 and len(set(outputs)) > 20
    with pytest.raises(BenchError, match="range ratio"):
        make_requests("random", [1], 1, 1, 1, seed=0, range_ratio=1.0)


def test_shared_prefix_prompts_share_exactly_the_prefix() -> None:
    requests = shared_prefix_requests(list(range(100, 200)), 4, prefix_len=12, input_len=6, output_len=2, seed=0)
    prefixes = {r.prompt_ids[:12] for r in requests}
    assert len(prefixes) == 1 and all(r.prompt_len == 18 for r in requests)
    assert len({r.prompt_ids[12:] for r in requests}) == 4
    with pytest.raises(BenchError):
        make_requests("sharegpt", [1], 1, 1, 1, seed=0)


def test_shared_prefix_prompts_spread_evenly_over_several_prefixes_in_a_seeded_order() -> None:
    requests = shared_prefix_requests(list(range(100, 200)), 12, prefix_len=8, input_len=3, output_len=2, seed=1,
                                      num_prefixes=3)
    groups = [r.prompt_ids[:8] for r in requests]
    assert len(set(groups)) == 3 and sorted(groups.count(g) for g in set(groups)) == [4, 4, 4]
    assert groups != groups[:3] * 4                          # shuffled, not each prefix in turn
    assert requests == make_requests("shared-prefix", list(range(100, 200)), 12, 3, 2, seed=1, prefix_len=8,
                                     num_prefixes=3)
    with pytest.raises(BenchError, match="num-prefixes"):
        shared_prefix_requests([1], 2, prefix_len=4, input_len=1, output_len=1, seed=0, num_prefixes=3)


def test_regular_token_ids_leave_out_special_tokens(tiny_model) -> None:
    folder = tiny_model("llama", num_layers=1, hidden_size=32, intermediate_size=64)
    ids = regular_token_ids(folder)
    assert 0 not in ids and 1 not in ids and 2 not in ids
    assert ids[0] == 3 and ids == sorted(set(ids)) and len(ids) > 200
    with pytest.raises(BenchError):
        regular_token_ids(folder / "nowhere")


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate() -> None:
    offsets = arrival_offsets_s(2000, request_rate=4.0, seed=7)
    assert offsets == arrival_offsets_s(2000, 4.0, seed=7) and offsets != arrival_offsets_s(2000, 4.0, seed=8)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)     # exponential: stdev == mean
    assert arrival_offsets_s(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_a_rate_schedule_rises_and_falls_step_by_step() -> None:
    schedule = parse_rate_schedule("2:100,10:100,0:50,1:100")
    assert schedule == ((2.0, 100.0), (10.0, 100.0), (0.0, 50.0), (1.0, 100.0))
    offsets = scheduled_offsets_s(schedule, seed=3)
    assert offsets == sorted(offsets) and offsets == scheduled_offsets_s(schedule, seed=3)
    per_step = [sum(begin <= t < end for t in offsets) for begin, end in ((0, 100), (100, 200), (200, 250),
                                                                         (250, 350))]
    assert per_step[0] == pytest.approx(200, rel=0.2) and per_step[1] == pytest.approx(1000, rel=0.1)
    assert per_step[2] == 0 and per_step[3] == pytest.approx(100, rel=0.3) and len(offsets) == sum(per_step)
    for bad in ("2", "2:0", "-1:10", "a:b", "1:10,"):
        with pytest.raises(BenchError, match="rate-schedule"):
            parse_rate_schedule(bad)


@pytest.mark.parametrize("kwargs", [{"num_prompts": 0}, {"max_concurrency": 0}, {"request_rate": 0.0},
                                    {"vocab_size": None}, {"range_ratio": -0.1}])
def test_bad_options_are_named_errors(kwargs: dict) -> None:
    with pytest.raises(BenchError):
        ServeOptions(**{"vocab_size": 10, **kwargs})


def _parse(*argv: str) -> ServeOptions:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(["--vocab-size", "10", *argv]))


def test_api_key_comes_from_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATAMESH_API_KEY", raising=False)
    assert _parse().api_key == "" and auth_headers("") == {}
    monkeypatch.setenv("STRATAMESH_API_KEY", "from-env")
    assert _parse().api_key == "from-env"
    options = _parse("--api-key", "from-flag")
    assert options.api_key == "from-flag" and "from-flag" not in repr(options)
    assert auth_headers(options.api_key) == {"Authorization": "Bearer from-flag"}


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.bench     # a benchmark's smoke run: make test-bench
def test_bench_serve_against_a_real_mesh(tiny_model, tmp_path: Path) -> None:
    from stratamesh.launcher import LocalMesh

    folder = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    with LocalMesh(str(folder), num_agents=2, log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db"),
                   coordinator_args=["--speculative-config", ngram]) as mesh:
        result = subprocess.run(
            [sys.executable, "-m", "stratamesh.cli", "bench", "serve", "--url", mesh.url, "--api-key", mesh.api_key,
             "--tokenizer", str(folder), "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "12",
             "--output-len", "5", "--goodput", "ttft:60000", "--json"],
            check=False, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        data = json.loads(result.stdout)
        assert (data["completed"], data["failed"]) == (6, 0)
        assert data["total_output_tokens"] == 30 and data["total_input_tokens"] == 72
        assert data["request_goodput"] == pytest.approx(data["request_throughput"])
        assert data["total_cached_tokens"] >= 0
        assert data["successes"] == [True] * 6 and data["output_lens"] == [5] * 6
        assert all(0 < ttft < e2el for ttft, e2el in zip(data["ttfts"], data["e2els"], strict=True))
        # the mesh speculates (its greedy requests carry drafts): the run's drafted and kept tokens, from the admin API
        drafted, kept = data["spec_decode_draft_tokens"], data["spec_decode_accepted_tokens"]
        assert drafted is not None and 0 <= kept <= drafted     # (the mesh's key may read the admin API)
