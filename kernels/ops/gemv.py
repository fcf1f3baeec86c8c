"""Batch-1 products over more weights than the caches hold, in each backend and weight format: the speed a decode
step of one sequence reads its weights at (agent.speed measures it; benchmarks/edge_cpu.py prints it).

The weights are random (their values do not change a product's time) and laid out as each backend's stages hold
them: torch's float32 matrices and its CPU kernels' int8 and repacked int4 (kernels.ops.quant), ONNX Runtime's
MatMulNBits blocks (kernels.models.onnx_stage: 8 bits in blocks of 128, 4 bits in the int4 format's groups)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from stratamesh.fleet.stages import QUANTIZED_BYTES
from stratamesh.kernels.ops.quant import INT4_GROUP, INT8_MAX, Int8Weight, PackedInt4Weight, linear

GEMV_SHAPE = (4096, 4096)           # one matrix [out, in]: a 7B model's attention projection
GEMV_BYTES = 128 << 20              # the weights a measurement reads: four times a large last-level cache
_FORMAT_BYTES = {"": 4.0, **QUANTIZED_BYTES}      # a weight's bytes in each format, its scales counted


def gemv_bandwidth(backend: str, quantize: str = "", num_bytes: int = 0, reps: int = 3) -> float:
    """Bytes/s that batch-1 products read weights in quantize's format ("" float32, "int8", "int4") at, in backend
    ("torch-cpu" or "onnxruntime-cpu"): the fastest of reps passes over matrices of num_bytes (0: GEMV_BYTES) in all,
    after one."""
    count = max(1, round((num_bytes or GEMV_BYTES) / (math.prod(GEMV_SHAPE) * _FORMAT_BYTES[quantize])))
    product = _ort_products(quantize, count) if backend == "onnxruntime-cpu" else _torch_products(quantize, count)
    product()
    seconds = min(_timed(product) for _ in range(max(reps, 1)))
    return count * math.prod(GEMV_SHAPE) * _FORMAT_BYTES[quantize] / seconds


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _torch_products(quantize: str, count: int) -> Callable[[], object]:
    out_features, in_features = GEMV_SHAPE
    x = torch.randn(1, in_features)
    weights: list[torch.Tensor | Int8Weight | PackedInt4Weight] = []
    for _ in range(count):
        if quantize == "int8":
            weights.append(Int8Weight(torch.randint(-INT8_MAX, INT8_MAX + 1, GEMV_SHAPE, dtype=torch.int8),
                                      torch.rand(out_features) / 100))
        elif quantize == "int4":      # random bytes in the kernel's own layout: what it holds does not change its time
            packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
            scales = torch.rand(in_features // INT4_GROUP, out_features, 2).to(torch.bfloat16)
            weights.append(PackedInt4Weight(packed, scales, INT4_GROUP))
        else:
            weights.append(torch.randn(GEMV_SHAPE))

    def products() -> None:
        for w in weights:
            F.linear(x, w) if isinstance(w, torch.Tensor) else linear(x, w)

    return products


def _ort_products(quantize: str, count: int) -> Callable[[], object]:
    """One session of count MatMulNBits (or MatMul, float32) nodes over the same input, run whole."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from stratamesh.kernels.models.onnx_stage import INT8_BLOCK     # (the blocks an int8 stage exports)

    out_features, in_features = GEMV_SHAPE
    rng = np.random.default_rng(0)
    nodes, initializers, outputs = [], [], []
    for i in range(count):
        if quantize:
            bits, block = (8, INT8_BLOCK) if quantize == "int8" else (4, INT4_GROUP)
            blocks = in_features // block
            packed = rng.integers(0, 256, (out_features, blocks, block * bits // 8), dtype=np.uint8)
            scales = (rng.random(out_features * blocks, dtype=np.float32) / 100)
            initializers += [numpy_helper.from_array(packed, f"w{i}"), numpy_helper.from_array(scales, f"s{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"w{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=in_features, N=out_features, bits=bits, block_size=block,
                                          accuracy_level=4))
        else:
            w = rng.standard_normal((in_features, out_features), dtype=np.float32)
            initializers.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, out_features]))
    graph = helper.make_graph(nodes, "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, in_features])],
                              outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del model, graph, initializers
    feed = {"x": np.ones((1, in_features), dtype=np.float32)}
    return lambda: session.run(None, feed)
