"""Decode steps as CUDA graphs: the static, padded step a graph captures gives what the ordinary step gives.

Off CUDA the static step runs eagerly with the Triton kernel in its CPU interpreter (TRITON_INTERPRET=1, set before
Triton is imported): everything a graph captures except the capture. The gpu-marked test captures and replays."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from stratamesh.agent.engine.decode_graphs import can_capture   # noqa: E402
from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine   # noqa: E402
from stratamesh.agent.engine.stage_runner import StageRunner   # noqa: E402
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionOpen, StepChunk   # noqa: E402
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels.models.decoder import load_stage   # noqa: E402

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
PROMPTS = {"a": [5, 17, 42, 99, 7], "b": list(range(30, 51)), "c": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]}
NUM_BLOCKS = 24


def engine(model_dir, start: int, end: int, graph_batch: int, capture: bool, dtype: str = "float32") -> StageEngine:
    spec = StageSpec("m", str(model_dir), start, end, 2, dtype=dtype, device=DEVICE, kv_block_size=16)
    runner = StageRunner(load_stage(spec), NUM_BLOCKS, graph_batch=graph_batch, capture=capture)
    return StageEngine(Assignment("a", spec), runner, EngineConfig())


def decode(eng: StageEngine, steps: int, hidden: dict[str, torch.Tensor] | None = None) -> list:
    """Opens the sessions, prefills them, then runs `steps` decode steps of all of them at once; each step's
    output: sampled tokens on the last stage, else its hidden rows."""
    route = () if eng.is_last else (Hop("next:1", "b"),)
    for sid, prompt in PROMPTS.items():
        eng.open(SessionOpen(sid, "a", route, "o:1", SamplingParams(), prompt_token_ids=tuple(prompt)), Outbox())
        eng.add(StepChunk(sid, 0, 0, tuple(prompt), True), None if hidden is None else hidden[sid][:len(prompt)])
    eng.scheduler.pipeline_depth = 1     # one micro-batch: every session decodes in every step
    batch = eng.schedule()
    eng.postprocess(batch, eng.run(batch), Outbox())
    outputs, tokens = [], {sid: 9 for sid in PROMPTS}
    for step in range(steps):
        for sid, prompt in PROMPTS.items():
            rows = None if hidden is None else hidden[sid][len(prompt) + step:len(prompt) + step + 1]
            eng.add(StepChunk(sid, step + 1, len(prompt) + step, (tokens[sid],), True), rows)
        batch = eng.schedule()
        assert all(c.num_tokens == 1 for c in batch.chunks) and len(batch.chunks) == 3
        output = eng.run(batch)
        outputs.append(dict(output.tokens) if output.tokens is not None else output.hidden.clone())
        tokens = dict(output.tokens) if output.tokens is not None else tokens
        eng.postprocess(batch, output, Outbox())
    return outputs


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2)


def test_a_decode_graph_step_padded_to_its_size_equals_the_ordinary_step(model_dir) -> None:
    """3 sessions run on the graph of 4 (one padding row); the last stage samples the same tokens."""
    ordinary = decode(engine(model_dir, 0, 2, graph_batch=0, capture=True), steps=4)
    static = engine(model_dir, 0, 2, graph_batch=4, capture=False)
    assert static.runner.graphs is not None and static.runner.graphs.sizes == (1, 2, 4)
    assert static.runner.cache.num_blocks == NUM_BLOCKS + 1           # the scratch block, no session's
    assert decode(static, steps=4) == ordinary


def test_a_graph_step_writes_and_reads_no_block_table_column_past_its_longest_table(model_dir) -> None:
    """Each step writes the table columns its sessions fill, and the kernel reads no column past a row's context:
    columns left further right by earlier steps (here: a session's block, planted before every step) change nothing."""
    ordinary = decode(engine(model_dir, 0, 2, graph_batch=0, capture=True), steps=4)
    static = engine(model_dir, 0, 2, graph_batch=4, capture=False)
    graphs, fill = static.runner.graphs, static.runner.graphs._fill
    assert graphs.width > 2                     # 2048 positions in blocks of 16: 128 columns, the sessions fill 2

    def planted_fill(seqs, inputs, size) -> None:
        graphs._tables.fill_(1)                 # block 1 (a session's) in every column, as if a step had left it
        fill(seqs, inputs, size)
        assert (graphs._tables[:size, 2:] == 1).all()     # written: the 2 columns of the longest table only

    graphs._fill = planted_fill
    assert decode(static, steps=4) == ordinary


def test_a_middle_stage_graph_gives_the_hidden_rows_of_the_ordinary_step(model_dir) -> None:
    hidden = {sid: torch.randn(len(p) + 4, 256, generator=torch.Generator().manual_seed(len(p)))
              for sid, p in PROMPTS.items()}
    ordinary = decode(engine(model_dir, 0, 1, graph_batch=0, capture=True), steps=3, hidden=None)
    static = decode(engine(model_dir, 0, 1, graph_batch=8, capture=False), steps=3, hidden=None)
    for a, b in zip(ordinary, static, strict=True):
        torch.testing.assert_close(b.cpu(), a.cpu(), atol=2e-5, rtol=2e-5)
    later = decode(engine(model_dir, 1, 2, graph_batch=8, capture=False), steps=3, hidden=hidden)
    assert later == decode(engine(model_dir, 1, 2, graph_batch=0, capture=True), steps=3, hidden=hidden)


def test_graphs_are_only_captured_for_one_process_on_cuda(model_dir) -> None:
    cpu = load_stage(StageSpec("m", str(model_dir), 0, 2, 2, kv_block_size=16))
    assert not can_capture(cpu, 16)
    assert StageRunner(cpu, NUM_BLOCKS, graph_batch=8).graphs is None   # capture asked, but not on a CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_decode_graphs_replay_the_ordinary_steps_on_a_gpu(model_dir, dtype) -> None:
    ordinary = decode(engine(model_dir, 0, 2, graph_batch=0, capture=True, dtype=dtype), steps=8)
    captured = engine(model_dir, 0, 2, graph_batch=8, capture=True, dtype=dtype)
    assert captured.runner.graphs is not None and len(captured.runner.graphs._graphs) == 4   # 1, 2, 4, 8
    assert decode(captured, steps=8) == ordinary
