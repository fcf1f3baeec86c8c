"""Registry: agents, models, plans, events and migrations on in-memory and file SQLite."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from stratamesh.coordinator.registry import (
    MIGRATIONS, AgentRecord, Registry, SchemaTooNew, StageRecord)
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed, StageLoad, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import StageSpec

T0 = 1_700_000_000.0
CPU_BOX = Capabilities("edge-1", "ARM Cortex-A78", 8, 16 << 30, 12 << 30)
GPU_BOX = Capabilities("cloud-1", "EPYC", 64, 512 << 30, 480 << 30,
                       gpus=(GpuInfo(0, "H100", 80 << 30, 79 << 30, "GPU-abc"),
                             GpuInfo(1, "H100", 80 << 30, 70 << 30)),
                       backends=("torch-cuda", "torch-cpu"),
                       speeds=(Speed("torch-cuda", "bfloat16", 6e14, 2.5e12),), site="eu-west", tier="cloud")


@pytest.fixture
def reg() -> Registry:
    r = Registry(":memory:")
    yield r
    r.close()


ALL_VERSIONS = list(range(1, len(MIGRATIONS) + 1))

def _stages(model_id: str, ranges: list[tuple[str, int, int]], num_layers: int,
            prefix: str) -> list[StageRecord]:
    return [StageRecord(f"{prefix}-{i}", i, agent,
                         StageSpec(model_id, f"/models/{model_id}", start, end, num_layers))
            for i, (agent, start, end) in enumerate(ranges)]


def test_upsert_agent_round_trips_capabilities(reg: Registry) -> None:
    reg.upsert_agent("a1", "cloud", "10.0.0.1:50051", GPU_BOX, now=T0)
    assert reg.agent("a1") == AgentRecord("a1", "cloud", "10.0.0.1:50051", GPU_BOX, "online",
                                          T0, T0, T0)
    assert reg.agent("a1").capabilities.usable_mem_bytes == (79 + 70) << 30
    assert reg.agent("nope") is None


def test_reupsert_keeps_first_seen_and_revives(reg: Registry) -> None:
    reg.upsert_agent("a1", "edge", "h:1", CPU_BOX, now=T0)
    reg.set_agent_state("a1", "lost", now=T0 + 5)
    reg.upsert_agent("a1", "edge2", "h:2", GPU_BOX, now=T0 + 10)
    a = reg.agent("a1")
    assert (a.name, a.address, a.capabilities, a.state) == ("edge2", "h:2", GPU_BOX, "online")
    assert (a.first_seen, a.last_seen, a.state_since) == (T0, T0 + 10, T0 + 10)


def test_capability_history_records_changes_only(reg: Registry) -> None:
    reg.upsert_agent("a1", "edge", "h:1", CPU_BOX, now=T0)
    reg.upsert_agent("a1", "edge", "h:1", CPU_BOX, now=T0 + 1)
    reg.upsert_agent("a1", "edge", "h:1", GPU_BOX, now=T0 + 2)
    assert reg.capability_history("a1") == [(T0, CPU_BOX), (T0 + 2, GPU_BOX)]


def test_agents_sorted_and_state_changes(reg: Registry) -> None:
    for agent_id in ("b", "c", "a"):
        reg.upsert_agent(agent_id, agent_id, f"{agent_id}:1", CPU_BOX, now=T0)
    reg.set_agent_state("b", "draining", now=T0 + 3)
    assert [a.agent_id for a in reg.agents()] == ["a", "b", "c"]
    b = reg.agent("b")
    assert (b.state, b.state_since, b.last_seen) == ("draining", T0 + 3, T0)


@pytest.mark.parametrize("call", [
    lambda r: r.set_agent_state("ghost", "online", now=T0),
    lambda r: r.touch_agent("ghost", now=T0),
    lambda r: r.set_stage_state("ghost", "ready"),
    lambda r: r.add_model("m", "/m", 0, {}, now=T0),
])
def test_unknown_ids_and_bad_values_raise(reg: Registry, call) -> None:
    with pytest.raises(InvalidInput):
        call(reg)


def test_expire_marks_silent_agents_lost_once(reg: Registry) -> None:
    reg.upsert_agent("quiet", "q", "q:1", CPU_BOX, now=T0)
    reg.upsert_agent("chatty", "c", "c:1", CPU_BOX, now=T0)
    reg.touch_agent("chatty", now=T0 + 25)
    assert reg.expire(now=T0 + 30, ttl_s=30) == []           # exactly ttl_s old: still alive
    assert reg.expire(now=T0 + 31, ttl_s=30) == ["quiet"]
    assert reg.agent("quiet").state == "lost" and reg.agent("quiet").state_since == T0 + 31
    assert reg.agent("chatty").state == "online"
    assert reg.expire(now=T0 + 100, ttl_s=30) == ["chatty"]  # "quiet" is reported only once
    reg.touch_agent("quiet", now=T0 + 101)
    assert reg.agent("quiet").state == "lost"                 # only re-registering revives


def test_models_add_update_and_list(reg: Registry) -> None:
    reg.add_model("tiny", "/m/tiny", 4, {"hidden_size": 256, "arch": "llama"}, now=T0)
    reg.add_model("big", "/m/big", 80, {}, now=T0 + 1)
    reg.add_model("tiny", "/m/tiny2", 4, {"hidden_size": 512}, now=T0 + 2)
    assert [m.model_id for m in reg.models()] == ["big", "tiny"]
    tiny = reg.model("tiny")
    assert (tiny.path, tiny.num_layers, tiny.config, tiny.created) == (
        "/m/tiny2", 4, {"hidden_size": 512}, T0)
    assert reg.model("nope") is None


def test_save_plan_and_active_plan_orders_stages(reg: Registry) -> None:
    reg.add_model("m", "/models/m", 8, {}, now=T0)
    stages = _stages("m", [("a1", 0, 3), ("a2", 3, 6), ("a3", 6, 8)], 8, "p1")
    reg.save_plan("p1", "m", stages, "3 devices", now=T0 + 1)
    plan = reg.active_plan("m")
    assert (plan.plan_id, plan.model_id, plan.created, plan.state, plan.reason) == (
        "p1", "m", T0 + 1, "active", "3 devices")
    assert [(s.stage_index, s.agent_id, s.spec, s.state) for s in plan.stages] == [
        (s.stage_index, s.agent_id, s.spec, "pending") for s in stages]
    reg.set_stage_state("p1-1", "ready")
    assert [s.state for s in reg.active_plan("m").stages] == ["pending", "ready", "pending"]
    assert reg.active_plan("other") is None


def test_new_plan_supersedes_previous(reg: Registry) -> None:
    reg.save_plan("p1", "m", _stages("m", [("a1", 0, 8)], 8, "p1"), "one", now=T0)
    reg.save_plan("other", "n", _stages("n", [("a1", 0, 2)], 2, "o"), "n", now=T0)
    reg.save_plan("p2", "m", _stages("m", [("a1", 0, 4), ("a2", 4, 8)], 8, "p2"), "two",
                  now=T0 + 1)
    assert reg.active_plan("m").plan_id == "p2"
    assert len(reg.active_plan("m").stages) == 2
    assert reg.active_plan("n").plan_id == "other"
    states = reg._rows("SELECT plan_id, state FROM plans ORDER BY plan_id")
    assert states == [{"plan_id": "other", "state": "active"},
                      {"plan_id": "p1", "state": "superseded"},
                      {"plan_id": "p2", "state": "active"}]


def test_a_standby_plan_waits_beside_the_active_one_until_activated(reg: Registry) -> None:
    reg.save_plan("p1", "m", _stages("m", [("a1", 0, 8)], 8, "p1"), "one", now=T0)
    reg.save_plan("s1", "m", _stages("m", [("a2", 0, 8)], 8, "s1"), "first idea", now=T0 + 1, standby=True)
    reg.save_plan("s2", "m", _stages("m", [("a3", 0, 8)], 8, "s2"), "better idea", now=T0 + 2, standby=True)
    assert reg.active_plan("m").plan_id == "p1" and reg.standby_plan("m").plan_id == "s2"
    with pytest.raises(InvalidInput, match="not a standby plan"):
        reg.activate_plan("m", "s1")
    reg.activate_plan("m", "s2")
    assert reg.active_plan("m").plan_id == "s2" and reg.standby_plan("m") is None
    states = {r["plan_id"]: r["state"] for r in reg._rows("SELECT plan_id, state FROM plans")}
    assert states == {"p1": "superseded", "s1": "abandoned", "s2": "active"}
    reg.save_plan("s3", "m", _stages("m", [("a1", 0, 8)], 8, "s3"), "again", now=T0 + 3, standby=True)
    reg.abandon_standby("m")
    assert reg.standby_plan("m") is None and reg.active_plan("m").plan_id == "s2"


def test_bad_plan_is_rejected_and_changes_nothing(reg: Registry) -> None:
    reg.save_plan("p1", "m", _stages("m", [("a1", 0, 8)], 8, "s"), "ok", now=T0)
    dup = _stages("m", [("a1", 0, 4), ("a2", 4, 8)], 8, "s")  # "s-0" is taken by p1
    with pytest.raises(InvalidInput, match="repeats"):
        reg.save_plan("p2", "m", dup, "dup", now=T0 + 1)
    with pytest.raises(InvalidInput, match="indices 0..n-1"):
        reg.save_plan("p3", "m", list(reversed(_stages("m", [("a", 0, 4), ("b", 4, 8)], 8, "x"))),
                      "order", now=T0 + 1)
    with pytest.raises(InvalidInput, match="indices"):
        reg.save_plan("p5", "m", [], "empty", now=T0 + 1)
    with pytest.raises(InvalidInput, match="not for model"):
        reg.save_plan("p4", "m", _stages("n", [("a", 0, 8)], 8, "y"), "wrong", now=T0 + 1)
    assert reg.active_plan("m").plan_id == "p1"  # the failed save rolled back its supersede
    assert [r["plan_id"] for r in reg._rows("SELECT plan_id FROM plans")] == ["p1"]


def test_events_newest_first_with_limit(reg: Registry) -> None:
    ids = [reg.log_event("joined", f"agent {i}", now=T0 + i, agent_id=f"a{i}") for i in range(5)]
    reg.log_event("plan", "saved p1", now=T0 + 10)
    events = reg.events(limit=3)
    assert [(e.kind, e.detail, e.agent_id, e.ts) for e in events] == [
        ("plan", "saved p1", None, T0 + 10), ("joined", "agent 4", "a4", T0 + 4),
        ("joined", "agent 3", "a3", T0 + 3)]
    assert events[1].id == ids[4]
    assert len(reg.events()) == 6


def test_readable_from_other_threads(reg: Registry) -> None:
    reg.upsert_agent("a1", "edge", "h:1", CPU_BOX, now=T0)
    seen: list[object] = []
    workers = [threading.Thread(target=lambda: seen.append(reg.agent("a1"))) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert seen == [reg.agent("a1")] * 4


def test_file_db_survives_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "registry.db")
    reg = Registry(path)
    assert reg.applied_migrations == ALL_VERSIONS
    reg.upsert_agent("a1", "edge", "h:1", GPU_BOX, now=T0)
    reg.add_model("m", "/models/m", 8, {"layers": 8}, now=T0)
    reg.save_plan("p1", "m", _stages("m", [("a1", 0, 8)], 8, "p1"), "solo", now=T0)
    reg.log_event("plan", "saved", now=T0)
    reg.close()

    again = Registry(path)
    assert again.applied_migrations == []
    assert again._rows("PRAGMA journal_mode") == [{"journal_mode": "wal"}]
    assert again.agent("a1").capabilities == GPU_BOX
    assert again.model("m").config == {"layers": 8}
    assert [s.assignment_id for s in again.active_plan("m").stages] == ["p1-0"]
    assert again.events()[0].detail == "saved"
    again.close()


def test_old_db_gets_missing_migrations(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    old = Registry(path, migrations=MIGRATIONS[:1])
    assert old.applied_migrations == [1]
    _insert_old_model(old, "m", "/models/m", 8)
    old.close()
    assert "agent_capabilities" not in _tables(path)

    new = Registry(path)
    assert new.applied_migrations == ALL_VERSIONS[1:]
    assert "agent_capabilities" in _tables(path)
    assert new.model("m").path == "/models/m"
    assert [r["version"] for r in new._rows("SELECT version FROM migrations")] == ALL_VERSIONS
    assert (new.model("m").first_site, new.model("m").last_site) == ("", "")   # no pins before migration 6
    new.close()


def _insert_old_model(reg: Registry, model_id: str, path: str, num_layers: int) -> None:
    """A model row as the first schema wrote it (today's add_model writes columns it lacks)."""
    reg._db["models"].insert({"model_id": model_id, "path": path, "num_layers": num_layers, "config_json": "{}",
                              "created": T0})


def test_a_models_site_pins_round_trip_and_update() -> None:
    reg = Registry(":memory:")
    reg.add_model("m", "/models/m", 8, {}, now=T0, first_site="factory", last_site="factory")
    assert (reg.model("m").first_site, reg.model("m").last_site) == ("factory", "factory")
    reg.add_model("m", "/models/m", 8, {}, now=T0 + 1, last_site="cloud")
    assert (reg.model("m").first_site, reg.model("m").last_site, reg.model("m").created) == ("", "cloud", T0)
    reg.close()


def test_newer_db_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "new.db")
    Registry(path).close()
    with pytest.raises(SchemaTooNew, match="newer"):
        Registry(path, migrations=MIGRATIONS[:1])


def _tables(path: str) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def test_failed_migration_leaves_no_trace(tmp_path: Path) -> None:
    def _m003_broken(db) -> None:
        db["half_done"].create({"id": int}, pk="id")
        raise RuntimeError("migration bug")

    path = str(tmp_path / "broken.db")
    with pytest.raises(RuntimeError, match="migration bug"):
        Registry(path, migrations=(*MIGRATIONS, _m003_broken))
    assert "half_done" not in _tables(path)
    reg = Registry(path)
    assert reg.applied_migrations == []
    assert [r["version"] for r in reg._rows("SELECT version FROM migrations")] == ALL_VERSIONS
    reg.close()


def test_a_stage_keeps_its_kv_block_size(reg: Registry) -> None:
    spec = StageSpec("m", "/models/m", 0, 4, 4, kv_block_size=32)
    reg.add_model("m", "/models/m", 4, {}, now=T0)
    reg.save_plan("p1", "m", [StageRecord("p1-0", 0, "a1", spec)], "one", now=T0)
    assert reg.active_plan("m").stages[0].spec == spec


def test_a_stage_keeps_its_tp_degree_across_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "tp.db")
    specs = [StageSpec("m", "/models/m", 0, 2, 6), StageSpec("m", "/models/m", 2, 4, 6, tp_degree=2),
             StageSpec("m", "/models/m", 4, 6, 6)]
    reg = Registry(path)
    reg.add_model("m", "/models/m", 6, {}, now=T0)
    reg.save_plan("p1", "m", [StageRecord(f"p1-{i}", i, agent, spec)
                              for i, (agent, spec) in enumerate(zip(["e1", "cloud", "e2"], specs))], "tp", now=T0)
    reg.close()
    again = Registry(path)
    assert [(s.agent_id, s.spec) for s in again.active_plan("m").stages] == list(zip(["e1", "cloud", "e2"], specs))
    again.close()


def test_stages_saved_before_tp_degree_existed_read_back_as_one_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    old = Registry(path, migrations=MIGRATIONS[:4])
    _insert_old_model(old, "m", "/models/m", 4)
    old._db["plans"].insert({"plan_id": "p1", "model_id": "m", "created": T0, "state": "active", "reason": ""})
    old._db["stages"].insert({"assignment_id": "p1-0", "plan_id": "p1", "stage_index": 0, "agent_id": "a1",
                              "model_path": "/models/m", "start_layer": 0, "end_layer": 4, "num_layers": 4,
                              "dtype": "float32", "device": "cpu", "kv_block_size": 16, "state": "ready"})
    old.close()
    new = Registry(path)
    assert new.active_plan("m").stages[0].spec == StageSpec("m", "/models/m", 0, 4, 4, tp_degree=1)
    new.close()


def _telemetry(i: int) -> Telemetry:
    return Telemetry(T0 + i, queue_depth=i, tokens_per_s=10.0 * i,
                     stages=(StageLoad("p-0", 1, i, i, 64, 32, 16, expert_tokens=(i, 2 * i, 0),
                                       expert_imbalance=1.5 + i),),
                     gpus=(GpuInfo(0, "L4", 24 << 30, 20 << 30, "u", "8.9", 50.0 + i, 60.0, None, 72.0),))


def test_telemetry_round_trips_and_reads_back_by_agent_and_time(reg: Registry) -> None:
    for i in range(5):
        reg.record_telemetry("a", _telemetry(i), now=T0 + i)
    reg.record_telemetry("b", _telemetry(9), now=T0 + 2.5)
    assert reg.telemetry("a") == [(T0 + i, _telemetry(i)) for i in range(5)]
    assert reg.telemetry("a", since=T0 + 2) == [(T0 + 3, _telemetry(3)), (T0 + 4, _telemetry(4))]
    assert reg.telemetry("a", limit=2) == [(T0 + 3, _telemetry(3)), (T0 + 4, _telemetry(4))]
    assert reg.latest_telemetry() == {"a": (T0 + 4, _telemetry(4)), "b": (T0 + 2.5, _telemetry(9))}


def test_telemetry_retention_drops_old_rows_and_caps_each_agent(reg: Registry) -> None:
    for i in range(10):
        reg.record_telemetry("a", _telemetry(i), now=T0 + i)
        reg.record_telemetry("b", _telemetry(i), now=T0 + i)
    reg.record_telemetry("c", _telemetry(0), now=T0 + 9)
    # older than 5 s at T0 + 10 goes (rows 0..4 of a and b); then each agent keeps its newest 3
    assert reg.prune_telemetry(now=T0 + 10, max_age_s=5.5, max_rows_per_agent=3) == 5 + 5 + 2 + 2
    assert [ts for ts, _ in reg.telemetry("a")] == [T0 + 7, T0 + 8, T0 + 9]
    assert [ts for ts, _ in reg.telemetry("b")] == [T0 + 7, T0 + 8, T0 + 9]
    assert [ts for ts, _ in reg.telemetry("c")] == [T0 + 9]
    assert reg.prune_telemetry(now=T0 + 10, max_age_s=5.5, max_rows_per_agent=3) == 0


def test_links_keep_the_newest_figures_and_survive_a_failed_probe(reg: Registry) -> None:
    reg.record_links("a", [LinkMeasurement("b", 0.002, 1e8), LinkMeasurement("c", error="refused")], now=T0)
    assert [(r.agent_id, r.peer_agent_id, r.rtt_s) for r in reg.links()] == [("a", "b", 0.002)]  # c: never measured
    reg.record_links("a", [LinkMeasurement("b", 0.001, 2e8)], now=T0 + 1)
    reg.record_links("a", [LinkMeasurement("b", error="timeout")], now=T0 + 2)
    (link,) = reg.links()
    assert (link.rtt_s, link.bandwidth_bytes_per_s, link.error, link.measured_at_s) == (0.001, 2e8, "timeout", T0 + 2)


def test_a_models_quantization_and_its_stages_round_trip_across_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "q.db")
    reg = Registry(path)
    reg.add_model("m", "/models/m", 4, {}, now=T0, quantize="int8")
    specs = [StageSpec("m", "/models/m", 0, 2, 4, quantize="int8", kv_cache_bytes=3 << 30),
             StageSpec("m", "/models/m", 2, 4, 4)]
    reg.save_plan("p1", "m", [StageRecord(f"p1-{i}", i, f"a{i}", s) for i, s in enumerate(specs)], "q", now=T0)
    reg.close()
    again = Registry(path)
    assert again.model("m").quantize == "int8"
    assert [s.spec for s in again.active_plan("m").stages] == specs
    again.add_model("m", "/models/m", 4, {}, now=T0 + 1)      # deployed again without it: as stored
    assert again.model("m").quantize == ""
    again.close()


def test_a_models_speculative_decoding_round_trips_across_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    reg = Registry(path)
    reg.add_model("m", "/models/m", 4, {}, now=T0, speculation=Speculation("ngram", 3, 2, 4))
    reg.add_model("plain", "/models/plain", 4, {}, now=T0)
    reg.close()
    again = Registry(path)
    assert again.model("m").speculation == Speculation("ngram", 3, 2, 4) and again.model("plain").speculation is None
    again.add_model("m", "/models/m", 4, {}, now=T0 + 1)      # deployed again without it: the coordinator's
    assert again.model("m").speculation is None
    again.close()
