"""The owner's limits on an edge box: when the agent should step aside, and when it may serve again.

An owner lends a box on terms: not above a GPU temperature or a power draw, not while the owner's own work keeps
the CPU busy, not during quiet hours. OwnerLimits says which limits a reading crosses; OwnerPolicy turns readings
into decisions, with hysteresis so that a box does not flap: it rests once a limit has been crossed for grace_s
without a break, and serves again once no limit has been crossed for cooldown_s. Reading the box (HostLoad, the
GPUs' NVML readings) is apart from deciding, which is pure and driven by the caller's clock.

The host load the limit speaks of is the owner's, not the agent's: the cores' worth of CPU that every process but
this agent (and its children) used over the last interval, from /proc/stat and the agent's own CPU time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import GpuInfo, Telemetry

log = logging.getLogger(__name__)

MINUTES_A_DAY = 24 * 60
QUIET_HOURS_NEAR_MIN = 60     # quiet hours count as near from this many minutes before they begin
_CLOCK = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")


@dataclass(frozen=True, slots=True)
class QuietHours:
    """A daily span of local time, [start, end) in minutes after midnight; it may cross midnight (22:00-07:00)."""

    start_min: int
    end_min: int

    @classmethod
    def parse(cls, text: str) -> QuietHours:
        """"HH:MM-HH:MM" (InvalidInput otherwise, or for an empty span)."""
        start, sep, end = text.partition("-")
        if not sep or not _CLOCK.match(start.strip()) or not _CLOCK.match(end.strip()):
            raise InvalidInput(f"quiet hours {text!r} are not HH:MM-HH:MM")
        span = cls(_minutes(start), _minutes(end))
        if span.start_min == span.end_min:
            raise InvalidInput(f"quiet hours {text!r} are empty")
        return span

    def holds(self, minute_of_day: int) -> bool:
        if self.start_min < self.end_min:
            return self.start_min <= minute_of_day < self.end_min
        return minute_of_day >= self.start_min or minute_of_day < self.end_min

    def __str__(self) -> str:
        return f"{self.start_min // 60:02d}:{self.start_min % 60:02d}-{self.end_min // 60:02d}:{self.end_min % 60:02d}"


def _minutes(clock: str) -> int:
    hours, minutes = clock.strip().split(":")
    return int(hours) * 60 + int(minutes)


@dataclass(frozen=True, slots=True)
class Reading:
    """What the box reads at one moment."""

    unix_s: float
    minute_of_day: int                      # local time, minutes after midnight
    temperatures_c: tuple[float, ...] = ()  # its GPUs' (NVML) and the owner's sensor file's
    power_w: float = 0.0                    # its GPUs' draw together, and the sensor file's
    owner_load: float = 0.0                 # cores' worth of CPU the other processes used (HostLoad)

    @classmethod
    def of(cls, unix_s: float, gpus: Sequence[GpuInfo] = (), sensors: Sensors | None = None,
           owner_load: float = 0.0) -> Reading:
        sensors = sensors or Sensors()
        temps = [g.temperature_c for g in gpus if g.temperature_c is not None] + list(sensors.temperatures_c)
        power = sum(g.power_w for g in gpus if g.power_w is not None) + sensors.power_w
        return cls(unix_s, minute_of_day(unix_s), tuple(temps), power, owner_load)


@dataclass(frozen=True, slots=True)
class Sensors:
    """Readings of sensors NVML does not see (a laptop's CPU, a meter at the wall), from a JSON file the owner's
    script keeps up to date: {"temperatures_c": [71.5], "power_w": 35.0} (both optional)."""

    temperatures_c: tuple[float, ...] = ()
    power_w: float = 0.0

    @classmethod
    def read(cls, path: str) -> Sensors:
        """The file's readings; nothing where there is no path, and nothing (logged) where it cannot be read."""
        if not path:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
            temps = tuple(float(t) for t in raw.get("temperatures_c", ()))
            power = float(raw.get("power_w", 0.0))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.info("the sensor file %s reads nothing: %s", path, exc)
            return cls()
        if not all(math.isfinite(v) for v in (*temps, power)):
            log.info("the sensor file %s holds a value that is no number", path)
            return cls()
        return cls(temps, power)


@dataclass(frozen=True, slots=True)
class OwnerLimits:
    """The owner's terms; None (or no quiet hours) is no limit."""

    max_gpu_temp_c: float | None = None     # the hottest GPU (or sensor)
    max_power_w: float | None = None        # the box's GPUs (and sensors) together
    max_host_load: float | None = None      # cores' worth of CPU the owner's own processes may use
    quiet_hours: tuple[QuietHours, ...] = ()
    grace_s: float = 30.0                   # a limit crossed this long without a break: the agent rests
    cooldown_s: float = 300.0               # no limit crossed this long: it serves again

    def __post_init__(self) -> None:
        for name in ("max_gpu_temp_c", "max_power_w", "max_host_load"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise InvalidInput(f"{name} must be a finite number >= 0, got {value}")
        if not (0 <= self.grace_s < float("inf") and 0 <= self.cooldown_s < float("inf")):
            raise InvalidInput("the grace and cool-down periods must be finite and >= 0 seconds")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.max_gpu_temp_c, self.max_power_w, self.max_host_load)) \
            or bool(self.quiet_hours)

    def crossed(self, reading: Reading) -> list[str]:
        """Each limit the reading crosses, in words (empty: none)."""
        out, temps, power = [], reading.temperatures_c, reading.power_w
        if self.max_gpu_temp_c is not None and temps and max(temps) > self.max_gpu_temp_c:
            out.append(f"at {max(temps):.0f} C, above {self.max_gpu_temp_c:g} C")
        if self.max_power_w is not None and power > self.max_power_w:
            out.append(f"drawing {power:.0f} W, above {self.max_power_w:g} W")
        if self.max_host_load is not None and reading.owner_load > self.max_host_load:
            out.append(f"the owner's processes using {reading.owner_load:.1f} cores, above {self.max_host_load:g}")
        out += [f"quiet hours {span}" for span in self.quiet_hours if span.holds(reading.minute_of_day)]
        return out

    def nearness(self, reading: Reading) -> float:
        """How near the reading is to a limit: the largest of each reading over its limit, and of quiet hours
        0 an hour before they begin, rising to 1 when they do (1 within); 0 without limits. The autoscaler gives
        back the replicas of the boxes nearest first."""
        near = [0.0]
        for value, limit in ((max(reading.temperatures_c, default=0.0), self.max_gpu_temp_c),
                             (reading.power_w, self.max_power_w), (reading.owner_load, self.max_host_load)):
            if limit is not None:
                near.append(value / limit if limit > 0 else 1.0 if value > 0 else 0.0)
        for span in self.quiet_hours:
            ahead = (span.start_min - reading.minute_of_day) % MINUTES_A_DAY
            near.append(1.0 if span.holds(reading.minute_of_day) else max(0.0, 1 - ahead / QUIET_HOURS_NEAR_MIN))
        return max(near)


@dataclass(frozen=True, slots=True)
class Decision:
    """A change of the agent's state: rest (with why) or serve again."""

    rest: bool
    why: str


@dataclass
class OwnerPolicy:
    """Readings in, decisions out: serving -> resting once a limit has been crossed for grace_s without a break;
    resting -> serving once none has been crossed for cooldown_s. update() returns a Decision on a change only."""

    limits: OwnerLimits
    resting: bool = False
    _crossed_since: float | None = field(default=None, init=False)
    _clear_since: float | None = field(default=None, init=False)

    def update(self, reading: Reading) -> Decision | None:
        crossed = self.limits.crossed(reading)
        now = reading.unix_s
        if crossed:
            self._clear_since = None
            self._crossed_since = now if self._crossed_since is None else self._crossed_since
            if not self.resting and now - self._crossed_since >= self.limits.grace_s:
                self.resting = True
                return Decision(True, "; ".join(crossed))
            return None
        self._crossed_since = None
        self._clear_since = now if self._clear_since is None else self._clear_since
        if self.resting and now - self._clear_since >= self.limits.cooldown_s:
            self.resting = False
            return Decision(False, f"no limit crossed for {self.limits.cooldown_s:g} s")
        return None


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat's first line (busy: all but idle and iowait)."""
    fields = text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        raise InvalidInput("/proc/stat does not start with the cpu line")
    values = [int(v) for v in fields[1:9]]        # user nice system idle iowait irq softirq steal
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def own_jiffies(pids: Sequence[int]) -> int:
    """utime + stime of these processes, and cutime + cstime of the first (the children it reaped: a rank that
    exited between two readings stays counted as the agent's), in jiffies (a process gone counts 0)."""
    total = 0
    for i, pid in enumerate(pids):
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if i == 0 else 0)
    return total


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first), or [] if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_tree(root: int, parents: Mapping[int, int]) -> list[int]:
    """root and every process descended from it, given each process's parent (root first)."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += sorted(children.get(pid, ()))
    return tree


def read_parents() -> dict[int, int]:
    """Each running process's parent, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))):
            parents[int(entry)] = int(fields[1])
    return parents


def agent_pids() -> list[int]:
    """This process and its descendants (a tensor-parallel stage's rank processes): the agent's own CPU."""
    return process_tree(os.getpid(), read_parents())


class HostLoad:
    """The owner's load: cores' worth of CPU that every process but the agent's own used since the last reading."""

    def __init__(self, own_pids: Callable[[], Sequence[int]] = agent_pids,
                 read_stat: Callable[[], str] = lambda: _read("/proc/stat"),
                 read_own: Callable[[Sequence[int]], int] = own_jiffies) -> None:
        self._own_pids, self._read_stat, self._read_own = own_pids, read_stat, read_own
        self._last = self._sample()

    def _sample(self) -> tuple[int, int]:
        busy, _ = parse_proc_stat(self._read_stat())
        return busy, self._read_own(self._own_pids())

    def read(self, elapsed_s: float) -> float:
        """Cores' worth used by others over elapsed_s (the time since the last read)."""
        busy, own = self._sample()
        (last_busy, last_own), self._last = self._last, (busy, own)
        others = max(0, (busy - last_busy) - (own - last_own))
        return others / os.sysconf("SC_CLK_TCK") / elapsed_s if elapsed_s > 0 else 0.0


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def minute_of_day(unix_s: float) -> int:
    """Local time, minutes after midnight."""
    local = time.localtime(unix_s)
    return local.tm_hour * 60 + local.tm_min


class OwnerWatch:
    """The agent's side of the owner's limits: each heartbeat's telemetry is read against them (with the sensor
    file and the owner's load), and says why the agent rests while it does (Telemetry.resting); the coordinator
    moves its stages off, and plans on it again once it serves."""

    def __init__(self, limits: OwnerLimits, sensor_file: str = "", host_load: HostLoad | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.policy = OwnerPolicy(limits)
        self._sensor_file, self._clock = sensor_file, clock
        self._host_load = (host_load or HostLoad()) if limits.max_host_load is not None else None
        self._last = clock()
        self._why = ""

    def check(self, telemetry: Telemetry) -> Telemetry:
        now = self._clock()
        load = self._host_load.read(now - self._last) if self._host_load is not None else 0.0
        self._last = now
        reading = Reading.of(now, telemetry.gpus, Sensors.read(self._sensor_file), load)
        decision = self.policy.update(reading)
        if decision is not None:
            self._why = decision.why if decision.rest else ""
            log.warning("the owner's limits: %s (%s)", "resting" if decision.rest else "serving again", decision.why)
        return replace(telemetry, resting=self._why, limits_near=self.policy.limits.nearness(reading))
