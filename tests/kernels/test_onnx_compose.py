"""compose_layers on a hand-written one-layer template, run by ONNX Runtime against the same chain in numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from stratamesh.kernels.models.onnx_compose import compose_layers


def template() -> onnx.ModelProto:
    """hidden_out = hidden * w.scale + shift (shared) + half (constant); new_k = k[None] * w.scale, new_v = v[None]."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["hidden", "w.scale"], ["scaled"]),
             helper.make_node("Add", ["scaled", "shift"], ["shifted"]),
             helper.make_node("Add", ["shifted", "half"], ["hidden_out"]),
             helper.make_node("Unsqueeze", ["k", "zero"], ["k1"]),
             helper.make_node("Mul", ["k1", "w.scale"], ["new_k"]),
             helper.make_node("Unsqueeze", ["v", "zero"], ["new_v"])]
    graph = helper.make_graph(
        nodes, "layer",
        [helper.make_tensor_value_info(name, f, shape) for name, shape in
         (("hidden", ["n", 4]), ("shift", ["n", 4]), ("k", ["s", 4]), ("v", ["s", 4]), ("w.scale", [4]))],
        [helper.make_tensor_value_info(name, f, None) for name in ("hidden_out", "new_k", "new_v")],
        [numpy_helper.from_array(np.array(0.5, np.float32), "half"), numpy_helper.from_array(np.array([0]), "zero")],
        value_info=[helper.make_tensor_value_info("scaled", f, ["n", 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_copies_of_the_layer_chain_the_hidden_states_and_each_reads_its_own_weights_and_pools(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    scales = [rng.standard_normal(4).astype(np.float32) for _ in range(3)]
    path = tmp_path / "stage.onnx"
    compose_layers(template(), ["shift"], [{"scale": s} for s in scales], path)
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [i.name for i in graph.input] == ["hidden", "shift", "k0", "v0", "k1", "v1", "k2", "v2"]
    assert all(i.data_location == TensorProto.EXTERNAL for i in graph.initializer if i.name.endswith(".scale"))
    hidden, shift = rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((2, 4)).astype(np.float32)
    pools = {f"{kind}{i}": rng.standard_normal((5, 4)).astype(np.float32) for i in range(3) for kind in "kv"}
    out, new_k, new_v = ort.InferenceSession(str(path)).run(None, {"hidden": hidden, "shift": shift, **pools})
    expected = hidden
    for s in scales:
        expected = expected * s + shift + 0.5
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_array_equal(new_k, np.stack([pools[f"k{i}"] * scales[i] for i in range(3)]))
    np.testing.assert_array_equal(new_v, np.stack([pools[f"v{i}"] for i in range(3)]))
