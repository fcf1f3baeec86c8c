"""llama.cpp as a baseline and a converter: its own tools on a checkpoint of ours (a llama.cpp build's folder: its
`build/bin` tools, `convert_hf_to_gguf.py` and `gguf-py` beside them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stratamesh.fleet.errors import MeshError


def convert(llama_dir: Path, path: Path, out: Path, outtype: str) -> None:
    """llama.cpp's converter, told that the checkpoint has no SentencePiece model and that a BPE pre-tokenizer it
    does not know is GPT-2's (the tiny models' tokenizers are byte-level BPE of their own, which its table of known
    tokenizers cannot name)."""
    program = ("import sys; sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]; import conversion.base as base\n"
               "def no_sentencepiece(self): raise FileNotFoundError('no tokenizer.model')\n"
               "base.TextModel._create_vocab_sentencepiece = no_sentencepiece\n"
               "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
               "import convert_hf_to_gguf; convert_hf_to_gguf.main()")
    llama_dir = llama_dir.resolve()
    done = subprocess.run([sys.executable, "-c", program, str(llama_dir), str(llama_dir / "gguf-py"),
                           str(Path(path).resolve()), "--outfile", str(Path(out).resolve()), "--outtype", outtype], capture_output=True, text=True,
                          cwd=llama_dir)      # (`python -c` puts its folder first on sys.path: not a checkout's)
    if done.returncode:
        raise MeshError(f"llama.cpp's converter failed on {path}:\n{done.stderr[-2000:]}")


def quantize(llama_dir: Path, source: Path, out: Path, kind: str) -> None:
    """llama-quantize: source (a GGUF file) as kind ("q8_0", "q4_0", "Q4_K_M", ...) at out."""
    done = subprocess.run([str(llama_dir / "build" / "bin" / "llama-quantize"), str(source), str(out), kind],
                          capture_output=True, text=True)
    if done.returncode:
        raise MeshError(f"llama-quantize failed on {source}:\n{done.stderr[-2000:]}")
