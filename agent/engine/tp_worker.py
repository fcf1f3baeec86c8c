"""A rank > 0 of a tensor-parallel stage: `python -m stratamesh.agent.engine.tp_worker`, started by rank 0.

It loads its shard of the stage, says Ready, joins the group, then runs what rank 0 hands it until Stop or
until rank 0 goes away (its pipe closes or a collective breaks): it never outlives its group."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.agent.engine.tp_group import (Collectives, Forward, LoadFailed, Ready, ReadKv, Stop, WriteKv,
                                              backend_for, rank_device, recv, send, store_for)
from stratamesh.agent.heap import keep_freed_memory
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.tp import load_tp_stage

log = logging.getLogger("stratamesh.tp_worker")


def serve(runner: StageRunner, conn: Connection) -> None:
    """Runs rank 0's commands until Stop; EOFError or a collective's error ends it too."""
    while True:
        command = recv(conn)
        if isinstance(command, Forward):
            runner.forward(command.inputs, command.seqs)
        elif isinstance(command, ReadKv):
            send(conn, runner.read_kv(list(command.block_table), command.num_tokens))
        elif isinstance(command, WriteKv):
            runner.write_kv(list(command.block_table), command.kv)
        elif isinstance(command, Stop):
            return
        else:
            raise TypeError(f"unknown command {type(command).__name__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--fd", type=int, required=True, help="this rank's end of its pipe to rank 0")
    parser.add_argument("--spec", required=True, help="the stage, as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    conn = Connection(socket.socket(fileno=args.fd).detach())
    keep_freed_memory()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    spec = StageSpec(**json.loads(args.spec))
    device = rank_device(spec.device, args.rank)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        group: list[Collectives] = []      # bound once every rank is in
        model = load_tp_stage(replace(spec, device=device), args.rank, lambda t: group[0].all_reduce(t))
    except Exception as exc:  # whatever stops the load, rank 0 hears why
        send(conn, LoadFailed(f"{type(exc).__name__}: {exc}"))
        return 1
    send(conn, Ready())
    # joining blocks until every rank is in: rank 0 joins once all said Ready
    group.append(Collectives(store_for(args.rank, spec.tp_degree, args.store_port), args.rank, spec.tp_degree,
                             backend_for(device)))
    runner = StageRunner(model, args.num_blocks, rank=args.rank)
    try:
        serve(runner, conn)
    except EOFError:
        log.info("rank 0 went away; exiting")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
