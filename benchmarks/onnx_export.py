"""How long exporting an ONNX Runtime stage takes, by its number of layers, on this CPU: one traced layer chained
(kernels/models/onnx_stage.py export_layers, what agents do) against tracing every layer of the stage in one graph
(trace_layers: how stages were exported before, the baseline).

    python benchmarks/onnx_export.py [--layers 1 4 16] [--hidden 512] [--quantize "" int8]

For each weights kind and stage length, in one process on a random-weight Llama of that width:
  - first stage: export_layers into an empty cache folder (the layer's trace, then the stage composed of it);
  - next stage: export_layers of another stage of the model, the traced layer cached (composition only);
  - every layer traced: trace_layers over the stage's layers, the exporter's work alone (nothing saved).
The exporter is used once before the first row: its first use in a process loads its op registry.
Ratio = every layer traced / first stage: above 1, tracing one layer is faster.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.decoder import load_stage
from stratamesh.kernels.models.onnx_stage import export_layers, trace_layers
from stratamesh.kernels.tiny_model import write_tiny_model


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def row(model_dir: Path, total: int, num_layers: int, quantize: str) -> tuple[float, float, float]:
    """(first stage s, next stage s, every layer traced s) for stages of num_layers of the model's total layers."""

    def stage(start: int):
        return load_stage(StageSpec("m", str(model_dir), start, start + num_layers, total, quantize=quantize))

    cache = tempfile.mkdtemp()
    first = timed(lambda: export_layers(stage(0), cache))
    following = timed(lambda: export_layers(stage(num_layers), cache))
    traced = timed(lambda: trace_layers(stage(0), num_layers))
    return first, following, traced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16], help="stage lengths")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--quantize", nargs="+", default=["", "int8"], help='"" (float32 weights) and/or int8')
    args = parser.parse_args()
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "llama", num_layers=2 * max(args.layers),
                                 hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                 num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 256))
    # the exporter's first use in a process loads its op registry (seconds): not any row's
    total = 2 * max(args.layers)
    trace_layers(load_stage(StageSpec("m", str(model_dir), 0, 1, total)), 1)
    print(f"random Llama, hidden {args.hidden}: export of a stage, seconds\n")
    print("| weights | layers | first stage | next stage | every layer traced | ratio |")
    print("|---|---|---|---|---|---|")
    for quantize in args.quantize:
        for num_layers in args.layers:
            first, following, traced = row(model_dir, total, num_layers, quantize)
            print(f"| {quantize or 'float32'} | {num_layers} | {first:.2f} | {following:.2f} | {traced:.2f} | "
                  f"{traced / first:.2f}x |", flush=True)
    print("\nratio = every layer traced / first stage: above 1, tracing one layer is faster")


if __name__ == "__main__":
    main()
