"""Draft models for tests: a target's first layers, its embedding and head (a draft that agrees with its target
part of the time, as a real one does), in a Hugging Face folder of their own with the target's tokenizer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def first_layers_draft(target_dir: Path, out_dir: Path, num_layers: int = 1) -> Path:
    """The target (one safetensors file) cut to its first num_layers layers."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)
    config = json.loads((target_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=num_layers)))
    layer = re.compile(r"model\.layers\.(\d+)\.")
    weights = {name: t for name, t in load_file(target_dir / "model.safetensors").items()
               if not (m := layer.match(name)) or int(m.group(1)) < num_layers}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
