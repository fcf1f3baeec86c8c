"""A multimodal folder's text model served as a text model: Gemma 3 4B-27B (model_type gemma3) hold their Gemma 3
text model under text_config and language_model.*, beside a vision tower a mesh does not serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.model_folder import read_config_json
from stratamesh.fleet.stages import text_model_config
from stratamesh.kernels.models.config import parse_config, read_config
from tests.kernels.test_decoder import LOGITS_ATOL, greedy_decode, prompt, run_pipeline

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=48, sliding_window=32, query_pre_attn_scalar=36,
            rope_scaling={"rope_type": "linear", "factor": 8.0})     # the 4B-27B models' full layers are scaled
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
SPLIT = ((0, 2), (2, 5), (5, 6))


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Gemma3ForConditionalGeneration as transformers saves it (language_model.*, vision_tower.*)."""
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                       image_token_index=1000, boi_token_index=1001, eoi_token_index=1002)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():       # sharper than the default init, so that greedy argmax has no near-ties
        for name, p in model.model.language_model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    folder = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    model.save_pretrained(folder)
    return folder


def stages_of(folder: Path):
    from stratamesh.fleet.stages import StageSpec
    from stratamesh.kernels.models.decoder import load_stage

    return [load_stage(StageSpec("tiny", str(folder), s, e, 6)) for s, e in SPLIT]


def test_the_text_model_of_a_gemma3_folder_over_three_stages_is_transformers(gemma3_folder: Path) -> None:
    raw = json.loads((gemma3_folder / "config.json").read_text())
    assert raw["model_type"] == "gemma3" and "text_config" in raw
    config = read_config(gemma3_folder)
    assert config.arch == "gemma3_text" and config.tie_word_embeddings and config.head_dim == 48
    hf = transformers.AutoModelForImageTextToText.from_pretrained(gemma3_folder).eval()
    ids = prompt(seed=4)
    stages = stages_of(gemma3_folder)
    with torch.inference_mode():
        expected = hf(input_ids=ids[None]).logits[0].float()
        generated = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=16,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.numel():].tolist()
    torch.testing.assert_close(run_pipeline(stages, [s.new_cache() for s in stages], ids, 0), expected,
                               atol=LOGITS_ATOL, rtol=0)
    assert greedy_decode(stages_of(gemma3_folder), ids, 16) == generated


def test_the_text_model_is_found_under_either_layout_of_its_names(gemma3_folder: Path, tmp_path: Path) -> None:
    """transformers 4.5x saved it as model.language_model.*: the same tensors, the same stage."""
    other = tmp_path / "tiny-gemma3"
    other.mkdir()
    (other / "config.json").write_text((gemma3_folder / "config.json").read_text())
    tensors = load_file(gemma3_folder / "model.safetensors")
    save_file({name.replace("language_model.model.", "model.language_model.", 1): t for name, t in tensors.items()},
              other / "model.safetensors")
    ids = prompt(seed=5, length=12)
    a, b = stages_of(gemma3_folder), stages_of(other)
    assert torch.equal(run_pipeline(a, [s.new_cache() for s in a], ids, 0),
                       run_pipeline(b, [s.new_cache() for s in b], ids, 0))


def test_a_released_style_text_config_takes_the_text_config_class_defaults() -> None:
    """The released folders save text_config as what differs from Gemma3TextConfig's defaults: the mesh reads the
    model transformers does."""
    sparse = {"model_type": "gemma3", "torch_dtype": "bfloat16", "eos_token_id": [1, 106],
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024}}
    ours = parse_config(text_model_config(sparse))
    full = transformers.Gemma3TextConfig(**{k: v for k, v in sparse["text_config"].items() if k != "model_type"})
    theirs = parse_config({**full.to_dict(), "torch_dtype": "bfloat16", "eos_token_id": [1, 106]})
    assert ours == theirs
    assert (ours.vocab_size, ours.head_dim, ours.num_kv_heads, ours.torch_dtype) == (262208, 256, 4, "bfloat16")


def test_a_multimodal_folder_without_its_text_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {}}))
    with pytest.raises(CheckpointError, match="gemma3 model has no text_config"):
        read_config_json(tmp_path)
