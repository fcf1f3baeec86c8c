"""Embedding models (a base model without an LM head): the task from the config, base-model tensor names, and the
pooled vector of our stages against transformers' AutoModel, the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.stages import StageSpec, model_task
from stratamesh.kernels.models.checkpoint import Checkpoint, canonical_name, stage_tensor_names
from stratamesh.kernels.models.config import parse_config, read_config
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.ops.kv_cache import KVCache
from stratamesh.kernels.tiny_model import TINY_ARCHS

transformers = pytest.importorskip("transformers")

NUM_LAYERS = 6
# float32 on CPU, per element of a unit vector; observed max |diff| 1.2e-7 to 1.5e-7 (one stage and two alike)
POOLED_ATOL = 1e-5
SPLITS = {"one stage": ((0, NUM_LAYERS),), "two stages": ((0, 3), (3, NUM_LAYERS))}
BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 100}

_hf_models: dict[Path, object] = {}


def hf_pooled(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm) at the last token, L2-normalized: [hidden]."""
    if model_dir not in _hf_models:
        _hf_models[model_dir] = transformers.AutoModel.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return F.normalize(_hf_models[model_dir](ids[None]).last_hidden_state[0, -1], dim=-1)


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 700, (length,), generator=torch.Generator().manual_seed(seed))


def load_stages(model_dir: Path, ranges: tuple[tuple[int, int], ...]) -> list[StageModel]:
    return [load_stage(StageSpec("emb", str(model_dir), s, e, NUM_LAYERS)) for s, e in ranges]


def pooled(stages: list[StageModel], ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The prompt prefilled chunk by chunk through every stage (a KV cache each); the last token's pooled vector."""
    caches: list[KVCache] = [s.new_cache(chunk_tokens=8) for s in stages]
    for begin in range(0, ids.numel(), chunk):
        x: torch.Tensor = ids[begin:begin + chunk]
        positions = torch.arange(begin, begin + x.numel())
        for stage, cache in zip(stages, caches, strict=True):
            x = stage.forward(x, positions, cache)
    return stages[-1].pool(x[-1:])[0]


@pytest.mark.parametrize("architectures, task", [
    (["LlamaModel"], "embed"), (["Qwen2Model"], "embed"), (["MistralModel"], "embed"),
    (["LlamaForCausalLM"], "generate"), (["Qwen2ForCausalLM"], "generate"), (None, "generate"), ([], "generate"),
    ("LlamaModel", "generate"),   # not a list: as if absent
])
def test_the_task_is_a_function_of_the_config(architectures, task):
    raw = {**BASE, "architectures": architectures}
    assert model_task(raw) == task
    config = parse_config(raw)
    assert config.task == task and config.has_lm_head == (task == "generate")


def test_bidirectional_attention_is_refused():
    with pytest.raises(CheckpointError, match="is_causal"):
        parse_config({**BASE, "architectures": ["Qwen2Model"], "is_causal": False})


def test_base_model_tensor_names_get_the_model_prefix(tiny_model):
    assert canonical_name("layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert canonical_name("embed_tokens.weight") == "model.embed_tokens.weight"
    assert canonical_name("norm.weight") == "model.norm.weight"
    assert canonical_name("model.norm.weight") == "model.norm.weight"
    assert canonical_name("lm_head.weight") == "lm_head.weight"
    model_dir = tiny_model("llama", embedding=True)
    config = read_config(model_dir)
    names = [n for s, e in ((0, 2), (2, NUM_LAYERS)) for n in stage_tensor_names(config, s, e)]
    assert sorted(names) == Checkpoint(model_dir).tensor_names()      # every tensor once, and no LM head
    assert names[-1] == "model.norm.weight" and "lm_head.weight" not in names


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("split", SPLITS, ids=list(SPLITS))
def test_pooled_vectors_match_transformers(tiny_model, arch, split):
    model_dir = tiny_model(arch, embedding=True)
    stages = load_stages(model_dir, SPLITS[split])
    assert stages[-1].config.task == "embed"
    for seed, length, chunk in ((1, 40, 40), (2, 37, 16), (3, 1, 1)):   # one chunk, chunked prefill, one token
        ids = prompt(seed, length)
        ours, expected = pooled(stages, ids, chunk), hf_pooled(model_dir, ids)
        assert ours.dtype == torch.float32 and float(ours.norm()) == pytest.approx(1.0, abs=1e-6)
        torch.testing.assert_close(ours, expected, atol=POOLED_ATOL, rtol=0)


def test_different_prompts_give_different_vectors(tiny_model):
    """Guards the comparison above: a wrong pooling (another token, no norm) must not pass by chance."""
    model_dir = tiny_model("llama", embedding=True)
    (stage,) = load_stages(model_dir, SPLITS["one stage"])
    a, b = pooled([stage], prompt(1, 40), 40), pooled([stage], prompt(2, 40), 40)
    assert float(a @ b) < 0.9
    ids = prompt(1, 40)
    hidden = stage.forward(ids, torch.arange(40), stage.new_cache())
    assert (stage.pool(hidden[-2:-1])[0] - hf_pooled(model_dir, ids)).abs().max() > 1e-2   # not the last token


def test_a_checkpoint_transformers_saved_loads_and_matches(tmp_path):
    """What transformers 5's LlamaModel.save_pretrained writes (tensors without the "model." prefix)."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaModel(config).save_pretrained(tmp_path)
    stored = Checkpoint(tmp_path)._read_weight_map()
    assert "layers.0.self_attn.q_proj.weight" in stored and not any(n.startswith("model.") for n in stored)
    stages = [load_stage(StageSpec("hf", str(tmp_path), s, e, 4)) for s, e in ((0, 2), (2, 4))]
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(pooled(stages, ids, 8), hf_pooled(tmp_path, ids), atol=POOLED_ATOL, rtol=0)


def test_an_embedding_model_has_no_logits_and_middle_stages_do_not_pool(tiny_model):
    first, last = load_stages(tiny_model("llama", embedding=True), SPLITS["two stages"])
    assert "lm_head.weight" not in last.tensor_names
    with pytest.raises(InvalidInput, match="no LM head"):
        last.logits(torch.randn(1, last.config.hidden_size))
    with pytest.raises(InvalidInput, match="not the last stage"):
        first.pool(torch.randn(1, first.config.hidden_size))
