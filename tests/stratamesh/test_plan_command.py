"""`stratamesh plan` on a config and a fleet file: a table, JSON, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratamesh.cli import _parser
from stratamesh.fleet.errors import InvalidInput, PlacementError
from stratamesh.plan_command import run_plan

CONFIG = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def gpu(device_id: str, mem_gb: float, tflops: float, site: str, node: str = "") -> dict:
    return {"id": device_id, "memory_bytes": int(mem_gb * 1e9), "tier": "edge", "site": site, "node": node,
            "speeds": [{"backend": "torch-cuda", "dtype": "bfloat16", "flops": tflops * 1e12,
                        "mem_bandwidth": tflops * 4e9}]}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "llama-1b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    fleet = {"origin_site": "home", "devices": [gpu("a", 4, 20, "home"), gpu("b", 8, 60, "home"),
                                                gpu("c", 2, 10, "office")]}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    return model, tmp_path / "fleet.json"


def args(*argv: str):
    return _parser().parse_args(["plan", *argv])


def test_prints_a_table_whose_stages_tile_the_model(files) -> None:
    model, fleet = files
    out = run_plan(args("--model", str(model), "--fleet", str(fleet)))
    rows = [line for line in out.splitlines() if line.startswith("| ") and "devices" not in line]
    spans = [tuple(int(x) for x in row.split("|")[3].strip(" [)").split(", ")) for row in rows]
    assert spans[0][0] == 0 and spans[-1][1] == 16 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert "model llama-1b" in out and "Bottleneck" in out


def test_json_is_the_plan_and_honours_exclusions(files) -> None:
    model, fleet = files
    plan = json.loads(run_plan(args("--model", str(model / "config.json"), "--fleet", str(fleet), "--json",
                                    "--exclude", "b", "--objective", "latency")))
    devices = {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert plan["objective"] == "latency" and "b" not in devices and devices


def test_errors_say_what_is_wrong(files, tmp_path: Path) -> None:
    model, fleet = files
    with pytest.raises(PlacementError, match=r"needs [\d.]+ GB more memory"):
        run_plan(args("--model", str(model), "--fleet", str(fleet), "--exclude", "b", "a"))
    (tmp_path / "bad.json").write_text(json.dumps({"devices": [{"id": "x"}]}))
    with pytest.raises(InvalidInput, match="lacks required field"):
        run_plan(args("--model", str(model), "--fleet", str(tmp_path / "bad.json")))


def test_the_command_line_exits_1_with_the_message(files) -> None:
    model, fleet = files
    result = subprocess.run([sys.executable, "-m", "stratamesh.cli", "plan", "--model", str(model), "--fleet",
                             str(fleet), "--first-site", "mars"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "pinned to site 'mars'" in result.stderr


def test_a_device_in_the_fleet_file_may_say_the_dtype_it_computes_in(files, tmp_path: Path) -> None:
    model, _ = files
    stages = {}
    for dtype in ("", "float32"):
        device = gpu("a", 16, 20, "home")
        device["speeds"] += [{**device["speeds"][0], "dtype": "float32"}]
        path = tmp_path / f"fleet-{dtype or 'model'}.json"
        path.write_text(json.dumps({"devices": [{**device, "dtype": dtype}]}))
        (stages[dtype],) = json.loads(run_plan(args("--model", str(model), "--fleet", str(path), "--json"))
                                      )["pipelines"][0]["stages"]
    assert (stages[""]["dtype"], stages["float32"]["dtype"]) == ("bfloat16", "float32")
    assert stages["float32"]["memory_bytes"] == 2 * stages[""]["memory_bytes"]    # every value in 4 bytes, not 2
