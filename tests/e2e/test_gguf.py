"""A GGUF file served as it is (`stratamesh up --model FILE.gguf`), as processes on loopback: three stages whose
agents fetch only their own tensors of the file from the coordinator, Q4_0 kept in 4 bits, the chat template and
tokenizer from the file's metadata, and the one-process tokens of the same file."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.decoder import greedy_tokens, load_stage
from stratamesh.launcher import LocalMesh

from ..gguf_writer import write_gguf

pytestmark = pytest.mark.slow


def test_a_gguf_file_serves_in_three_stages_fetched_by_their_agents(tiny_models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    gguf = write_gguf(tiny_models["qwen3"], tmp_path / "tiny-qwen3-q4_0.gguf", "Q4_0")
    weights_dirs = [tmp_path / f"weights{i}" for i in range(3)]
    with LocalMesh(str(gguf), num_agents=3, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db"), agent_args=["--fetch-weights", "always"],
                   agent_args_by_index={i: ["--weights-dir", str(d)] for i, d in enumerate(weights_dirs)}) as mesh:
        # (no --quantize: a Q4_0 file is served in 4 bits, as stored)
        (plan,) = [p for p in httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
                   if p["state"] == "active"]     # (a spare joining late may have a standby plan made beside it)
        assert [(s["quantize"], s["weights"]["done"]) for s in plan["stages"]] == [("int4", True)] * 3
        # each agent fetched its own layers' tensors of the file, and its header
        assert sum(s["weights"]["tensor_bytes"] for s in plan["stages"]) < gguf.stat().st_size
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=mesh.api_key, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-qwen3-q4_0"]
        prompt = list(range(3, 30))
        completion = client.completions.create(model="tiny-qwen3-q4_0", prompt=prompt, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        one_process = load_stage(StageSpec("m", str(gguf), 0, 6, 6, quantize="int4"))
        assert completion.choices[0].token_ids == greedy_tokens(one_process, prompt, 16)
        chat = client.chat.completions.create(model="tiny-qwen3-q4_0", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "hello"}])
        assert chat.usage.prompt_tokens > 5 and chat.choices[0].message.role == "assistant"    # the file's template
        copies = [next(d.glob("*/*/tiny-qwen3-q4_0.gguf")) for d in weights_dirs]
        assert all(c.stat().st_size == gguf.stat().st_size for c in copies)    # whole size, its own parts only
        assert all(c.stat().st_blocks * 512 < 0.8 * gguf.stat().st_size for c in copies)
