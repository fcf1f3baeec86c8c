"""`stratamesh bench plan`: what the planner predicts of a local mesh next to what the mesh then does.

For each mesh size in turn: a LocalMesh of that many agents on this machine, its active plan's prediction
(GET /admin/api/plans), then a `bench serve` run at the concurrency the prediction is for; a table of
predicted and measured output tokens/s, their ratio, and the serving path's CPU per token the agents measured
under that load (a fresh mesh's plan priced it at placement.DEFAULT_SERVING_CPU_PER_TOKEN_S)."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.bench.options import ServeOptions
from stratamesh.bench.serve import bench_serve
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.states import PlanState

log = logging.getLogger(__name__)

WITHIN = 2.0          # the prediction counts as honest within this factor of the measurement, either way
SERVING_METRIC = "stratamesh:serving_cpu_seconds_per_token"
TELEMETRY_WAIT_S = 5.0   # for the agents' next heartbeat to carry what the load measured


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """One mesh size: what was predicted and what was measured."""

    num_agents: int
    layout: str                   # each stage's layers, e.g. "0-3 | 3-6"
    concurrency: int
    predicted_tokens_per_s: float
    measured_tokens_per_s: float
    predicted_step_s: float
    measured_tpot_s: float        # median time per output token of one request
    serving_cpu_s: float = 0.0    # the serving path's CPU per token the agents measured under the load (median; 0:
                                  # none did: too few tokens); the plan priced the default, never measured before

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured_tokens_per_s / self.predicted_tokens_per_s

    @property
    def honest(self) -> bool:
        return 1 / WITHIN <= self.ratio <= WITHIN


def active_plan(url: str, headers: dict[str, str]) -> dict[str, Any]:
    plans = httpx.get(f"{url}/admin/api/plans", headers=headers, timeout=30).json()["plans"]
    (plan,) = [p for p in plans if p["state"] == PlanState.ACTIVE]
    return plan


def check_mesh(model_dir: str, num_agents: int, input_len: int, output_len: int, rounds: int,
               seed: int = 0) -> PlanCheck:
    """Starts the mesh, reads its prediction, loads it at that concurrency for `rounds` waves of requests."""
    with LocalMesh(model_dir, num_agents=num_agents, keep_logs=False) as mesh:
        plan = active_plan(mesh.url, mesh.headers)
        predicted = plan["predicted"]
        concurrency = predicted["concurrency"]
        options = ServeOptions(url=mesh.url, tokenizer=model_dir, num_prompts=concurrency * rounds,
                               max_concurrency=concurrency, input_len=input_len, output_len=output_len,
                               warmup=concurrency, seed=seed, api_key=mesh.api_key)
        metrics, _ = bench_serve(options)
        serving = serving_cpu(mesh.agent_metrics)
    if metrics.failed:
        raise RuntimeError(f"{metrics.failed} requests failed on {num_agents} agents: {metrics.errors[:3]}")
    layout = " | ".join(f"{s['start_layer']}-{s['end_layer']}" for s in plan["stages"])
    return PlanCheck(num_agents, layout, concurrency, predicted["tokens_per_s"], metrics.output_throughput,
                     predicted["step_s"], metrics.tpot.median_ms / 1e3, serving)


def serving_cpu(metrics_addresses: list[str]) -> float:
    """The median of what the agents report as their serving path's CPU per token, once every one reports a figure
    (or TELEMETRY_WAIT_S passes: 0 from those that measured none)."""
    deadline = time.monotonic() + TELEMETRY_WAIT_S
    while True:
        figures = [_gauge(address, SERVING_METRIC) for address in metrics_addresses]
        if all(figures) or time.monotonic() >= deadline:
            return statistics.median(figures) if figures else 0.0
        time.sleep(0.1)


def _gauge(address: str, name: str) -> float:
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return next((sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == name), 0.0)


def format_table(checks: list[PlanCheck]) -> str:
    head = (f"{'agents':>6} {'stages':<22} {'conc':>5} {'predicted tok/s':>16} {'measured tok/s':>15} "
            f"{'measured/pred':>14} {'pred step ms':>13} {'TPOT ms':>8} {'serving CPU ms/tok':>19}")
    rows = [f"{c.num_agents:>6} {c.layout:<22} {c.concurrency:>5} {c.predicted_tokens_per_s:>16.1f} "
            f"{c.measured_tokens_per_s:>15.1f} {c.ratio:>13.2f}x {c.predicted_step_s * 1e3:>13.2f} "
            f"{c.measured_tpot_s * 1e3:>8.2f} {_ms(c.serving_cpu_s):>19}" for c in checks]
    verdict = ("every prediction within " if all(c.honest for c in checks) else "NOT every prediction within ")
    return "\n".join([head, *rows, f"{verdict}{WITHIN:g}x of the measurement"])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds > 0 else "-"


def plan_main(model_dir: str, agent_counts: list[int], input_len: int, output_len: int, rounds: int) -> list[PlanCheck]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    checks = []
    for count in agent_counts:
        checks.append(check_mesh(model_dir, count, input_len, output_len, rounds))
        print(f"{count} agent(s): predicted {checks[-1].predicted_tokens_per_s:.1f} tok/s, measured "
              f"{checks[-1].measured_tokens_per_s:.1f}", flush=True)
    print(format_table(checks), flush=True)
    return checks
