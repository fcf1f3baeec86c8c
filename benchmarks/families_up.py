"""`stratamesh up --model DIR` on each family's checkpoint, asked through the openai client, against transformers.

    python benchmarks/families_up.py [--families llama phi3 ...] [--agents 2] [--layers 6] [--tokens 32]

For each model family (a random-weight checkpoint of it, kernels.tiny_model), starts `stratamesh up` as a user
does (its own processes, state and logs in a temporary folder), waits for it to say it is up, asks for a greedy
completion with the openai client, and compares the tokens with transformers' `generate` on the same prompt, in
this process. Prints, per family: the seconds `up` took to serve, whether the tokens are transformers', and the
completion's tokens per second against generate's (ratio: mesh / transformers, higher is better; the mesh's
includes its HTTP request and every hop between its agents). Exits non-zero if any family's tokens differ.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from stratamesh.kernels.tiny_model import TINY_ARCHS, write_tiny_model

PROMPT_IDS = list(range(40, 80))     # 40 tokens: past the tiny models' sliding window of 32


def start_up(model_dir: Path, agents: int, home: Path) -> tuple[subprocess.Popen, str, str, float]:
    """`stratamesh up` serving model_dir: (the process, its API URL, its API key, seconds until it said it is up)."""
    env = {**os.environ, "STRATAMESH_HOME": str(home)}
    start = time.perf_counter()
    up = subprocess.Popen([sys.executable, "-m", "stratamesh.cli", "up", "--model", str(model_dir), "--agents",
                           str(agents), "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env=env)
    said = ""
    while "Ctrl-C stops" not in said:
        line = up.stdout.readline()
        if not line:
            raise SystemExit(f"stratamesh up for {model_dir.name} ended before it was up:\n{said}")
        said += line
    url, key = re.search(r"API\s+(http://\S+/v1)", said), re.search(r"API key (sk-sm-\S+)", said)
    return up, url[1], key[1], time.perf_counter() - start


def stop(up: subprocess.Popen) -> None:
    up.send_signal(signal.SIGINT)
    up.wait(timeout=60)


def mesh_tokens(url: str, key: str, model_id: str, num_tokens: int) -> tuple[list[int], float]:
    """The greedy completion's token ids through the openai client, and its tokens per second."""
    client = openai.OpenAI(base_url=url, api_key=key, timeout=120)
    client.completions.create(model=model_id, prompt=PROMPT_IDS, max_tokens=1, temperature=0)     # warm
    start = time.perf_counter()
    completion = client.completions.create(model=model_id, prompt=PROMPT_IDS, max_tokens=num_tokens, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    return completion.choices[0].token_ids, num_tokens / (time.perf_counter() - start)


def transformers_tokens(model_dir: Path, num_tokens: int) -> tuple[list[int], float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([PROMPT_IDS])
    gen = GenerationConfig(max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
            max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0))      # warm
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, len(PROMPT_IDS):].tolist(), num_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=TINY_ARCHS, default=list(TINY_ARCHS))
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"stratamesh up --agents {args.agents} per family, {args.layers} layers, a {len(PROMPT_IDS)}-token prompt, "
          f"{args.tokens} greedy tokens\n")
    print("| family      | up s | tokens = transformers | mesh tok/s | transformers tok/s | ratio |")
    print("|-------------|------|-----------------------|------------|--------------------|-------|")
    differ = []
    for family in args.families:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_tiny_model(Path(tmp) / f"tiny-{family}", arch=family, num_layers=args.layers)
            expected, hf_rate = transformers_tokens(model_dir, args.tokens)
            up, url, key, up_s = start_up(model_dir, args.agents, Path(tmp) / "home")
            try:
                got, rate = mesh_tokens(url, key, model_dir.name, args.tokens)
            finally:
                stop(up)
        same = got == expected
        differ += [] if same else [family]
        print(f"| {family:<11} | {up_s:4.1f} | {'yes' if same else 'NO':<21} | {rate:10.1f} | {hf_rate:18.1f} | "
              f"{rate / hf_rate:4.2f}x |", flush=True)
    if differ:
        raise SystemExit(f"\ntokens differ from transformers for: {', '.join(differ)}")
    print(f"\nevery family's tokens are transformers' ({len(args.families)} families)")


if __name__ == "__main__":
    main()
