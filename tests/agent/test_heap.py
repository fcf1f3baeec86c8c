"""The agent's malloc settings: a large tensor freed and allocated again is not faulted in again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# First, whether brk can grow this process's heap by 1 GiB (and give it back): what the setting keeps lives there.
# Then allocates, fills and frees a 64 MB tensor until the heap has settled (3 allocations in a row faulted nothing
# in: at first torch's aligned allocations leave holes a freed tensor does not fit, and one may reuse a hole by luck
# before the next misses; it took 5 to 12 rounds here, more with more threads filling it), at most 48 times; then 4
# more, whose minor page faults it prints together with how many of them glibc served from its heap (the [heap]
# mapping brk grows) rather than from mappings of their own. Under glibc's default nothing settles: every
# allocation over 32 MiB is mapped afresh.
CHURN = """
import ctypes, json, resource, sys, torch
from stratamesh.agent.heap import keep_freed_memory
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
grows = libc.sbrk(1 << 30) != ctypes.c_void_p(-1).value and libc.sbrk(-(1 << 30)) != ctypes.c_void_p(-1).value
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            low, high = line.split()[0].split("-")
            return int(low, 16), int(high, 16)
    return 0, 0
streak = 0
for rounds in range(1, 49):
    before = faults()
    torch.ones(16 << 20)
    streak = streak + 1 if faults() == before else 0
    if streak == 3:
        break
before, addresses = faults(), []
for _ in range(4):     # nothing else allocated between a tensor and its free: it would split the heap's top
    addresses.append(torch.ones(16 << 20).data_ptr())
after = faults()
low, high = heap()
from_heap = sum(low <= address < high for address in addresses)
print(json.dumps({"applied": applied, "faults": after - before, "from_heap": from_heap, "grows": grows,
                  "settled_after": rounds, "threads": torch.get_num_threads()}))
"""


def churn(mode: str) -> dict:
    return json.loads(subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True,
                                     timeout=120).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_freed_large_tensor_is_reused_not_faulted_in_again() -> None:
    pages = (64 << 20) // 4096
    kept, default = churn("keep"), churn("default")
    if not kept["grows"]:
        # What the setting keeps is the heap's; where brk cannot grow it (the address space above it taken, a limit
        # on data size), glibc maps each allocation by itself and unmaps it when freed, setting or not
        pytest.skip("brk could not grow this process's heap by 1 GiB here: the setting has no heap to keep freed "
                    "tensors in")
    assert kept["applied"] is True
    assert default["from_heap"] == 0    # glibc's default: every allocation over 32 MiB is mapped afresh
    assert default["settled_after"] == 48 and default["faults"] >= 4 * pages * 0.9, default
    assert kept["from_heap"] == 4, kept             # kept: from the heap, ...
    assert kept["faults"] < pages * 0.1, kept       # ... which hands the same pages back, once it settled
