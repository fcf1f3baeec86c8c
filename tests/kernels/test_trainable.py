"""The trainable decoder computes what transformers and the serving stage compute, and it learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import parse_config
from stratamesh.kernels.models.decoder import StageModel
from stratamesh.kernels.models.trainable import TrainableDecoder
from stratamesh.kernels.tiny_model import _config

TOLERANCE = 1e-4     # float32 logits


def small_config(tie: bool = False) -> dict:
    return _config("llama", num_layers=2, hidden=64, intermediate=96, num_heads=4, num_kv_heads=2, vocab_size=128,
                   max_pos=256, tie=tie, rope_scaling=None, rope_spelling="classic", sliding_window=None)


def trained_a_little(raw: dict) -> TrainableDecoder:
    """A decoder whose norms and weights are no longer at their initial values (ones, one scale)."""
    model = TrainableDecoder(parse_config(raw), seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tie: bool) -> None:
    raw = small_config(tie)
    model = trained_a_little(raw)
    reference = LlamaForCausalLM(LlamaConfig(**raw)).eval()
    missing, unexpected = reference.load_state_dict(model.checkpoint_tensors(), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    ids = torch.randint(0, raw["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids)
    assert got.shape == want.shape == (3, 40, raw["vocab_size"])
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)


def test_what_it_learns_is_what_a_stage_serves() -> None:
    raw = small_config()
    model = trained_a_little(raw)
    spec = StageSpec(model_id="m", model_path="unused", start_layer=0, end_layer=2, num_layers=2)
    stage = StageModel(parse_config(raw), spec, model.checkpoint_tensors())
    ids = torch.randint(0, raw["vocab_size"], (50,), generator=torch.Generator().manual_seed(1))
    served = stage.logits(stage.forward(ids, torch.arange(50), stage.new_cache()))
    with torch.no_grad():
        trained = model(ids[None])[0]
    torch.testing.assert_close(served, trained, atol=TOLERANCE, rtol=0)


def test_a_few_steps_lower_the_loss_on_a_repeated_sequence() -> None:
    losses = []
    with torch.inference_mode(False), torch.enable_grad():   # (whatever an earlier test left on)
        ids = torch.arange(32).repeat(4, 1) % 128      # [4, 32]: the same easy sequence
        model = TrainableDecoder(parse_config(small_config()), seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(20):
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] / 4, losses


def test_dropout_acts_only_while_training() -> None:
    model = TrainableDecoder(parse_config(small_config()), seed=0, dropout=0.5)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(ids), model(ids))
        model.eval()
        assert torch.equal(model(ids), model(ids))


def test_only_plain_llama_is_trained() -> None:
    raw = _config("qwen2", num_layers=2, hidden=64, intermediate=96, num_heads=4, num_kv_heads=2, vocab_size=128,
                  max_pos=256, tie=False, rope_scaling=None, rope_spelling="classic", sliding_window=None)
    with pytest.raises(ValueError, match="plain Llama"):
        TrainableDecoder(parse_config(raw))
