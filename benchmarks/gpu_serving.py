"""Stages on a GPU: a ~1.1B-parameter random-weight Llama in bfloat16 on one GPU, the engine and the mesh.

    python benchmarks/gpu_serving.py [--quick] [--model DIR] [--steps 100] [--output-len 128] [--concurrency 64]

1. Engine: the stage engine's batch-1 decode step (all 16 layers in one stage, decode steps as CUDA graphs) against
   the HBM roofline, weight bytes / measured copy bandwidth (one large device-to-device copy, bytes read plus
   written): target at least 50%.
2. Serving: a local mesh of one agent on this box (what `stratamesh up --agents 1` starts): time per output token at
   concurrency 1, at the client, within 1.3x of the engine step; output tokens/s at concurrency 64 at least 1.5x
   transformers' batched generate on the same GPU (bfloat16, left-padded batches of 64).
3. Two stages, two agents sharing the GPU, at concurrency 64: at least 0.8x of one stage.
4. A mixed pipeline: a CPU stage, a GPU stage, a CPU stage (two --no-gpu agents pinned to the first and last site,
   the GPU agent computing in float32): greedy tokens equal to transformers' in float32.

Every target is printed PASS or FAIL, never asserted. --quick: a tiny model and short runs, on the CPU where there
is no GPU: it checks the benchmark runs, not the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.bench.datasets import BenchRequest, random_requests, regular_token_ids
from stratamesh.bench.metrics import compute_metrics
from stratamesh.bench.serve import run_requests
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels.tiny_model import write_tiny_model

log = logging.getLogger("gpu_serving")
# 16 layers x (10.5M attention + 34.6M MLP) + 2 x 96000 x 2048 embedding and head: about 1.1B parameters
FULL = {"num_layers": 16, "hidden_size": 2048, "intermediate_size": 5632, "num_heads": 32, "num_kv_heads": 8,
        "vocab_size": 96000}
# A GPU's prefill budget per step, as vLLM's max_num_batched_tokens (the agent's default, 512, suits CPUs)
SERVING_ARGS = ["--max-batch-tokens", "2048"]
QUICK = {"num_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2,
         "vocab_size": 1024}


# ------------------------------------------------------------------ 1. the engine against the roofline
def copy_bandwidth(device: str, num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a large copy on device, read plus written (the best of 5)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def engine_step_s(model_dir: Path, device: str, dtype: str, steps: int) -> tuple[float, int]:
    """(median seconds of a batch-1 decode step of the whole model as one stage, its weight bytes)."""
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    spec = StageSpec("m", str(model_dir), 0, layers, layers, dtype=dtype, device=device)
    runner = StageRunner.load(spec, 256 << 20, gpu_memory_utilization=0.5, graph_batch=8)
    engine = StageEngine(Assignment("a", spec), runner, EngineConfig())
    prompt = tuple(range(10, 138))
    engine.open(SessionOpen("s", "a", (), "o:1", SamplingParams(), prompt_token_ids=prompt,
                            feed=Hop("self:1", "a")), Outbox())
    engine.add(StepChunk("s", 0, 0, prompt, True), None)
    times, step = [], 0
    while step <= steps:
        batch = engine.schedule()
        start = time.perf_counter()
        output = engine.run(batch)       # a decode step ends in sampling, which waits for the device
        times.append(time.perf_counter() - start)
        outbox = Outbox()
        engine.postprocess(batch, output, outbox)
        for _, message in outbox.stage_messages:    # the ring's next step, fed to itself
            for chunk in message.chunks:
                engine.add(chunk, None)
        step += 1
    weight_bytes = runner.model.param_bytes
    runner.close()
    del engine, runner                    # the GPU's memory goes back before the meshes start
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(times[5:]), weight_bytes


# ------------------------------------------------------------------ 2, 3. serving
def transformers_batched_tok_s(model_dir: Path, device: str, requests: list[BenchRequest], batch: int) -> float:
    """Output tokens/s of transformers' greedy generate over left-padded batches (bfloat16 on the GPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    model.generation_config.eos_token_id = None
    num_tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch):
            chunk = requests[i:i + batch]
            width = max(len(r.prompt_ids) for r in chunk)
            ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in chunk], device=device)
            mask = (torch.arange(width, device=device)[None, :] >= width - torch.tensor(
                [len(r.prompt_ids) for r in chunk], device=device)[:, None]).long()
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(r.output_len for r in chunk),
                           do_sample=False, pad_token_id=0)
            num_tokens += sum(r.output_len for r in chunk)
    _sync(device)
    elapsed = time.perf_counter() - start
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return num_tokens / elapsed


def mesh_tok_s(mesh: LocalMesh, model_id: str, requests: list[BenchRequest], concurrency: int) -> float:
    records, duration_s = asyncio.run(run_requests(mesh.url, model_id, requests, math.inf, concurrency, seed=0,
                                                   api_key=mesh.api_key))
    metrics = compute_metrics(records, duration_s)
    return metrics.output_throughput if metrics.failed == 0 else math.nan


def tpot_s(mesh: LocalMesh, model_id: str, num_tokens: int) -> float:
    """Time per output token of one streamed greedy completion, at the client: (last - first) / (n - 1)."""
    body = {"model": model_id, "prompt": "The mesh", "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    stamps = []
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, headers=mesh.headers, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps += [time.perf_counter()] * len(json.loads(line[6:])["choices"][0].get("token_ids", []))
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def greedy_ids(mesh: LocalMesh, model_id: str, prompt_ids: list[int], num_tokens: int) -> list[int]:
    body = {"model": model_id, "prompt": prompt_ids, "max_tokens": num_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.headers, timeout=600)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def transformers_greedy(model_dir: Path, device: str, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens in float32 (no TF32 on a GPU)."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=num_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device))
    return out[0, len(prompt_ids):].tolist()


def mixed_pipeline_mesh(model_dir: Path) -> LocalMesh:
    """Three agents: a CPU one at site edge, the GPU one at site cloud computing in float32, a CPU one at edge;
    the first and last stages pinned to edge, so the GPU takes the middle."""
    return LocalMesh(str(model_dir), num_agents=3, num_stages=3,
                     agent_args_by_index={0: ["--no-gpu", "--site", "edge"], 2: ["--no-gpu", "--site", "edge"],
                                          1: ["--site", "cloud", "--tier", "cloud", "--dtype", "float32"]},
                     coordinator_args=["--first-site", "edge", "--last-site", "edge"])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder; default: the ~1.1B random Llama, written once")
    parser.add_argument("--steps", type=int, default=100, help="engine decode steps timed")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a tiny model, short runs, the CPU if there is no GPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.steps, args.input_len, args.output_len, args.concurrency = 10, 16, 32, 4
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    shape = QUICK if args.quick else FULL
    model_dir = Path(args.model) if args.model else write_tiny_model(
        Path(tempfile.mkdtemp()) / ("tiny-llama" if args.quick else "llama-1b"), dtype=dtype, **shape)
    model_id, vocab = model_dir.name, regular_token_ids(model_dir)
    requests = random_requests(vocab, 2 * args.concurrency, args.input_len, args.output_len, seed=0)
    print(f"{model_id} ({dtype}) on {torch.cuda.get_device_name(0) if device != 'cpu' else 'the CPU'}; agents "
          f"{' '.join(SERVING_ARGS)}\n", flush=True)

    step_s, weight_bytes = engine_step_s(model_dir, device, dtype, args.steps)
    bandwidth = copy_bandwidth(device, (1 << 30) if device != "cpu" else (256 << 20))
    roofline = weight_bytes / bandwidth / step_s
    log.warning("engine: %.3f ms a step, %.0f%% of the roofline", step_s * 1e3, roofline * 100)
    hf_tok_s = transformers_batched_tok_s(model_dir, device, requests, args.concurrency)
    with LocalMesh(str(model_dir), num_agents=1, agent_args=SERVING_ARGS) as mesh:
        tpot = statistics.median(tpot_s(mesh, model_id, args.output_len) for _ in range(3))
        one_stage = mesh_tok_s(mesh, model_id, requests, args.concurrency)
    with LocalMesh(str(model_dir), num_agents=2, agent_args=SERVING_ARGS) as mesh:
        two_stages = mesh_tok_s(mesh, model_id, requests, args.concurrency)
    prompt = list(requests[0].prompt_ids)
    with mixed_pipeline_mesh(model_dir) as mesh:
        plan = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()
        mixed = greedy_ids(mesh, model_id, prompt, 16)
    reference = transformers_greedy(model_dir, device, prompt, 16)

    c = args.concurrency
    print(f"| {'measure':<58} | {'value':>12} |\n|{'-' * 60}|{'-' * 14}|")
    rows = [("engine batch-1 decode step (ms)", step_s * 1e3), ("weights (GB)", weight_bytes / 1e9),
            ("measured copy bandwidth, read + written (GB/s)", bandwidth / 1e9),
            ("HBM roofline: weights / bandwidth (ms)", weight_bytes / bandwidth * 1e3),
            ("mesh, 1 agent: time per output token at C=1 (ms)", tpot * 1e3),
            (f"transformers batched generate, batches of {c} (tok/s)", hf_tok_s),
            (f"mesh, 1 stage, C={c} (tok/s)", one_stage),
            (f"mesh, 2 stages sharing the GPU, C={c} (tok/s)", two_stages)]
    for name, value in rows:
        print(f"| {name:<58} | {value:12.3f} |")
    stages = [(s["agent_id"], s["device"], s["dtype"]) for p in plan["plans"] for s in p["stages"]]
    print(f"\nmixed pipeline (CPU, GPU, CPU): {stages}\n  mesh {mixed}\n  transformers float32 {reference}")
    print("\ntargets:")
    print(f"  engine step at {roofline:.0%} of the HBM roofline (target >= 50%)  {verdict(roofline >= 0.5)}")
    print(f"  mesh TPOT at C=1 / engine step = {tpot / step_s:.2f}x (target <= 1.3x)  {verdict(tpot / step_s <= 1.3)}")
    print(f"  mesh 1 stage / transformers batched at C={c} = {one_stage / hf_tok_s:.2f}x (target >= 1.5x)  "
          f"{verdict(one_stage / hf_tok_s >= 1.5)}")
    print(f"  2 stages / 1 stage at C={c} = {two_stages / one_stage:.2f}x (target >= 0.8x)  "
          f"{verdict(two_stages / one_stage >= 0.8)}")
    print(f"  mixed pipeline greedy-equal to transformers in float32: {verdict(mixed == reference)}")


if __name__ == "__main__":
    main()
