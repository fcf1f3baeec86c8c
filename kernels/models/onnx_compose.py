"""A stage's ONNX graph built from one traced decoder layer: copies of the layer's graph chained, each copy's
weights its own layer's tensors.

Tracing a layer for the exporter costs seconds (torch.export over symbolic shapes, then decompositions), and the
same again for every further layer: a 32-layer stage took about a minute. The layers of a stage differ only in
their weights, so the exporter traces one layer whose weights are graph inputs (a template, the same for every
stage of a model of those shapes), and compose_layers() renames a copy of it per layer here, in milliseconds,
binding each copy's weight inputs to that layer's tensors, stored as external data written straight to disk.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

WEIGHT_PREFIX = "w."    # the template's weight inputs: "w.qkv", "w.qkv_packed", ...
OUTPUTS = ("hidden_out", "new_k", "new_v")     # the template's and the stage's: new K and V per layer [1 or L, N, ...]


def compose_layers(template: onnx.ModelProto, shared: Sequence[str], layers: Sequence[Mapping[str, np.ndarray]],
                   path: Path) -> onnx.ModelProto:
    """The stage's graph of len(layers) copies of the one-layer template, saved at path with its weights in
    "{path.name}.data" beside it. The template's inputs are "hidden", the shared ones (the same for every layer: the
    RoPE tables, the attention index), "k" and "v" (the layer's KV pools: k{i} and v{i} of the stage) and its
    weights (WEIGHT_PREFIX + name, layers[i][name] in copy i); its outputs are OUTPUTS, the stage's hidden states
    chained through the copies and new K and V concatenated over them."""
    g = template.graph
    assert not [a for n in g.node for a in n.attribute if a.type in (onnx.AttributeProto.GRAPH,
                                                                      onnx.AttributeProto.GRAPHS)], "no subgraphs"
    inputs = {i.name: i for i in g.input}
    weights = sorted(name for name in inputs if name.startswith(WEIGHT_PREFIX))
    assert set(inputs) == {"hidden", *shared, "k", "v", *weights}, sorted(inputs)
    kept = {*shared, *(i.name for i in g.initializer)}      # the same value in every copy: not renamed
    nodes, value_info, initializers = [], [], []
    hidden, new_k, new_v = "hidden", [], []
    with open(Path(f"{path}.data"), "wb") as data:
        for i, tensors in enumerate(layers):
            names = {"hidden": hidden, "k": f"k{i}", "v": f"v{i}",
                     **{w: f"l{i}.{w[len(WEIGHT_PREFIX):]}" for w in weights}}

            def renamed(value: str) -> str:
                return value if not value or value in kept else names.get(value, f"l{i}/{value}")

            for j, node in enumerate(g.node):
                node = copy.deepcopy(node)
                node.input[:] = [renamed(v) for v in node.input]
                node.output[:] = [renamed(v) for v in node.output]
                node.name = f"l{i}/{node.name or j}"
                nodes.append(node)
            for info in g.value_info:
                info = copy.deepcopy(info)
                info.name = renamed(info.name)
                value_info.append(info)
            for w in weights:
                array = tensors[w[len(WEIGHT_PREFIX):]]
                initializers.append(external_tensor(names[w], array, data, f"{path.name}.data"))
            hidden = renamed("hidden_out")
            new_k.append(renamed("new_k"))
            new_v.append(renamed("new_v"))
    nodes += [helper.make_node("Identity", [hidden], ["hidden_out"], name="hidden_out"),
              helper.make_node("Concat", new_k, ["new_k"], axis=0, name="new_k"),
              helper.make_node("Concat", new_v, ["new_v"], axis=0, name="new_v")]
    outputs = {o.name: o for o in g.output}
    graph = helper.make_graph(
        nodes, "stage",
        [inputs["hidden"], *(inputs[s] for s in shared),
         *(_renamed(inputs[kind], f"{kind}{i}") for i in range(len(layers)) for kind in ("k", "v"))],
        [_renamed(outputs[name], name, leading_dim=name != "hidden_out") for name in OUTPUTS],
        [*g.initializer, *initializers], value_info=value_info)
    model = helper.make_model(graph, opset_imports=template.opset_import, ir_version=template.ir_version,
                              functions=template.functions)
    onnx.save_model(model, str(path))
    return model


def external_tensor(name: str, array: np.ndarray, data, location: str) -> TensorProto:
    """A tensor whose bytes are appended to the open data file (at an offset aligned to 64 bytes)."""
    array = np.ascontiguousarray(array)
    offset = -data.tell() % 64
    data.write(b"\0" * offset)
    start = data.tell()
    data.write(array.tobytes())
    tensor = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", start), ("length", array.nbytes)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _renamed(info: onnx.ValueInfoProto, name: str, leading_dim: bool = False) -> onnx.ValueInfoProto:
    """A copy of a graph input or output's type under another name; leading_dim: its first dimension (a layer of
    the template, the stage's layers once concatenated) left unnamed."""
    out = copy.deepcopy(info)
    out.name = name
    if leading_dim and out.type.tensor_type.shape.dim:
        out.type.tensor_type.shape.dim[0].Clear()
    return out
