"""Which threads of a daemon read and write its gRPC sockets: the one that waits for gRPC's completions.

By default gRPC-Python (1.85) hands its sockets to EventEngine: threads of EventEngine's own poll them and pass
each event to the completion queue that grpc.aio's poller thread waits on, which passes it to the event loop, so
every message wakes three threads. With EventEngine off for channels, listeners and their connections (gRPC's
classic I/O manager, chosen with the GRPC_EXPERIMENTS variable gRPC documents), the thread waiting on the
completion queue polls the sockets itself: one wake-up less a message, a quarter of a stage-to-stage hop on
this project's 2-core VM (benchmarks/hop_floor.py --event-engine-too). gRPC reads the variable as it loads, so
a daemon's entry point sets it before anything imports grpc (stratamesh.cli.main); the processes it starts
inherit it. This module imports nothing of gRPC's for that reason.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# gRPC experiments turned off ("-name"): EventEngine's clients, listeners and the connections of both
CLASSIC_POLLING = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def use_classic_polling(environ: MutableMapping[str, str] = os.environ) -> None:
    """Has gRPC poll on the completion queue's thread in this process and those it starts, unless GRPC_EXPERIMENTS
    is set already (an operator's choice stands; "" keeps gRPC's default). Call it before grpc is imported."""
    environ.setdefault("GRPC_EXPERIMENTS", CLASSIC_POLLING)
