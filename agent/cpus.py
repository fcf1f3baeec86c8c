"""Which of its box's cores an agent computes on: a set of CPUs (`agent --cpus`), every thread of the process pinned to
them and as many compute threads as they are, so that agents sharing a box each own their cores (`stratamesh up`
gives each a share of them: cpu_shares) and a stage's threads do not wander between cores."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from stratamesh.fleet.errors import InvalidInput

log = logging.getLogger(__name__)


def parse_cpus(text: str) -> tuple[int, ...]:
    """A CPU list as taskset and cgroups write it ("0-3,6,8-9") -> the CPUs, sorted; InvalidInput if malformed."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise InvalidInput(f"--cpus {text!r}: {part!r} is not a CPU or a range of them (as in 0-3,6)")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise InvalidInput(f"--cpus {text!r} names no CPU")
    return tuple(sorted(cpus))


def format_cpus(cpus: Sequence[int]) -> str:
    """The CPU list form parse_cpus reads (ranges joined)."""
    parts, ordered = [], sorted(cpus)
    start = previous = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if cpu is not None:
            start = previous = cpu
    return ",".join(parts)


def cpu_shares(cpus: Sequence[int], num_agents: int) -> list[tuple[int, ...]]:
    """Each of num_agents agents' own CPUs of cpus: consecutive shares as equal as they can be, or every CPU for
    each where there are fewer CPUs than agents (the OS then shares them: a pinned core of its own each is not to
    be had, and sharing one core between two stages' threads while another idles is worse)."""
    if num_agents > len(cpus):
        return [tuple(cpus)] * num_agents
    share, extra = divmod(len(cpus), num_agents)
    out, start = [], 0
    for i in range(num_agents):
        end = start + share + (i < extra)
        out.append(tuple(cpus[start:end]))
        start = end
    return out


def pin_process(cpus: Sequence[int]) -> None:
    """Every thread of this process (and the threads it starts later, which inherit it) on cpus; InvalidInput if
    this process may not run on them all (CPUs the box lacks, or outside its cgroup's)."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, OverflowError) as exc:
        raise InvalidInput(f"--cpus {format_cpus(cpus)}: this process may not run there ({exc})") from None
    if os.sched_getaffinity(0) != set(cpus):
        got = format_cpus(sorted(os.sched_getaffinity(0)))
        raise InvalidInput(f"--cpus {format_cpus(cpus)}: this process may run on CPUs {got} of them only")
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:      # a thread that ended meanwhile
            continue
    log.info("pinned to CPUs %s", format_cpus(cpus))


def _threads() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:             # no /proc: the calling thread alone
        return [0]
