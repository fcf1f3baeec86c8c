"""`stratamesh plan` on a config and a fleet file: a table, JSON, clear one-line errors and warnings, the schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratamesh.cli import _parser
from stratamesh.fleet.errors import InvalidInput, PlacementError
from stratamesh.partitioner.fleet_file import SCHEMA_PATH, fleet_json_schema
from stratamesh.plan_command import FLEET_EXAMPLE, run_plan

CONFIG = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def gpu(device_id: str, mem_gb: float, tflops: float, site: str, node: str = "") -> dict:
    return {"id": device_id, "memory_bytes": int(mem_gb * 1e9), "tier": "edge", "site": site, "node": node,
            "speeds": [{"backend": "torch-cuda", "dtype": "bfloat16", "flops": tflops * 1e12,
                        "mem_bandwidth": tflops * 4e9}]}


FLEET = {"origin_site": "home", "devices": [gpu("a", 4, 20, "home"), gpu("b", 8, 60, "home"),
                                           gpu("c", 2, 10, "office")]}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "llama-1b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "fleet.json").write_text(json.dumps(FLEET))
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
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": [{"id": "x", "speeds": []}]}))
    with pytest.raises(InvalidInput) as caught:
        run_plan(args("--model", str(model), "--fleet", str(bad)))
    assert str(caught.value) == f"{bad}: devices[0].memory_bytes: required field missing"


def stratamesh(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratamesh.cli", *argv], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_the_command_line_exits_1_with_the_message(files) -> None:
    model, fleet = files
    result = stratamesh("plan", "--model", str(model), "--fleet", str(fleet), "--first-site", "mars")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("stratamesh plan: ") and "pinned to site 'mars'" in result.stderr
    assert result.stderr.count("\n") == 1


def _with(fleet: dict, path: tuple, value) -> dict:
    """fleet with the field at path set to value."""
    fleet = json.loads(json.dumps(fleet))
    *parents, key = path
    holder = fleet
    for p in parents:
        holder = holder[p]
    holder[key] = value
    return fleet


@pytest.mark.parametrize("text, message", [
    ("{\"devices\": [", "not JSON: Expecting value: line 1 column 14 (char 13)"),
    ("[]", "must be an object (got a list)"),
    (_with(FLEET, ("devices", 2, "memory_bytes"), -5), "devices[2].memory_bytes: must be at least 0 (got -5)"),
    (_with(FLEET, ("devices", 1, "speeds", 0, "flops"), "60e12"),
     "devices[1].speeds[0].flops: must be a number (got '60e12')"),
    (_with(FLEET, ("devices", 0, "memory_gb"), 4), "devices[0].memory_gb: unknown field"),
    (_with(FLEET, ("links",), [{"a": "a", "b": "z", "bandwidth": 1e9, "rtt_s": 0.001}]),
     "links[0].b: no device 'z' in devices (nor is it 'origin')"),
])
def test_a_bad_fleet_file_is_one_plain_line_naming_the_file_and_field(files, text, message) -> None:
    model, fleet = files
    fleet.write_text(text if isinstance(text, str) else json.dumps(text))
    result = stratamesh("plan", "--model", str(model), "--fleet", "fleet.json", cwd=fleet.parent)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"stratamesh plan: fleet.json: {message}\n"      # no timestamp, prefix or traceback


def test_a_fleet_file_that_is_not_there(files) -> None:
    model, fleet = files
    result = stratamesh("plan", "--model", str(model), "--fleet", "nothere.json", cwd=fleet.parent)
    assert (result.returncode, result.stderr) == (1, "stratamesh plan: nothere.json: cannot read it: No such file "
                                                     "or directory\n")


def test_a_device_without_a_speed_for_the_models_dtype_is_warned_of_and_left_out(files) -> None:
    model, fleet = files
    cpu = {"id": "cpu", "memory_bytes": int(64e9), "site": "home",
           "speeds": [{"backend": "torch-cpu", "dtype": "float32", "flops": 1e12, "mem_bandwidth": 1e11},
                      {"backend": "torch-cpu", "dtype": "int8", "flops": 2e12, "mem_bandwidth": 1e11}]}
    fleet.write_text(json.dumps({**FLEET, "devices": [*FLEET["devices"], cpu, {**cpu, "id": "bare", "speeds": []}]}))
    result = stratamesh("plan", "--model", str(model), "--fleet", str(fleet), "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "stratamesh plan: warning: device 'cpu' has no measured speed for bfloat16 (it has: float32, int8); "
        "the plan leaves it out",
        "stratamesh plan: warning: device 'bare' has no measured speed for bfloat16 (it has: none); "
        "the plan leaves it out"]
    plan = json.loads(result.stdout)
    used = {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used and not used & {"cpu", "bare"}


def test_warnings_skip_excluded_devices_and_follow_a_devices_own_dtype(files) -> None:
    model, fleet = files
    heard = []
    a = FLEET["devices"][0]
    float32_only = [{**a["speeds"][0], "dtype": "float32"}]
    devices = [*FLEET["devices"], {**a, "id": "d", "dtype": "float32"},                   # measured bfloat16 only
               {**a, "id": "e", "speeds": float32_only}, {**a, "id": "f", "speeds": float32_only, "dtype": "float32"}]
    fleet.write_text(json.dumps({**FLEET, "devices": devices}))
    run_plan(args("--model", str(model), "--fleet", str(fleet), "--exclude", "e"), warn=heard.append)
    assert heard == ["device 'd' has no measured speed for float32 (it has: bfloat16); the plan leaves it out"]


def test_fleet_schema_prints_the_json_schema_and_needs_no_model(tmp_path: Path) -> None:
    result = stratamesh("plan", "--fleet-schema", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout) == fleet_json_schema()
    assert json.loads(result.stdout)["properties"]["devices"]["items"] == {"$ref": "#/$defs/DeviceEntry"}


def test_help_describes_the_fleet_file(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        args("--help")
    out = capsys.readouterr().out
    assert exited.value.code == 0
    for words in (SCHEMA_PATH, "--fleet-schema", "memory_bytes (bytes", "flops in FLOP/s", "mem_bandwidth in",
                  "bandwidth (bytes/s)", "rtt_s (seconds)", "origin_site", "25e9 bytes/s", "12.5e6 bytes/s"):
        assert words in " ".join(out.split()), words


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


def test_the_example_in_help_is_a_fleet_the_planner_uses(files) -> None:
    model, fleet = files
    fleet.write_text(FLEET_EXAMPLE)
    heard = []
    plan = json.loads(run_plan(args("--model", str(model), "--fleet", str(fleet), "--json"), warn=heard.append))
    assert heard == [] and {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]} <= {"gpu0", "nuc"}
