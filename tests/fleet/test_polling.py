"""gRPC polls on grpc.aio's completion-queue thread in every daemon: the experiments exist, and the CLI sets them first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stratamesh.fleet.wire.polling import CLASSIC_POLLING, use_classic_polling

# a server and a channel of grpc.aio, one call between them: what loads gRPC's core and reads GRPC_EXPERIMENTS
_ONE_CALL = """
import asyncio, grpc
async def main():
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await channel.unary_unary("/no.Such/Method")(b"", timeout=5)
        except grpc.aio.AioRpcError as exc:
            print(exc.code().name)
    await server.stop(None)
asyncio.run(main())
"""


def _one_call(experiments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GRPC_EXPERIMENTS": experiments, "GRPC_VERBOSITY": "ERROR"}
    return subprocess.run([sys.executable, "-c", _ONE_CALL], env=env, capture_output=True, text=True, timeout=60)


def test_the_installed_grpc_knows_every_experiment_the_mesh_turns_off() -> None:
    """A gRPC upgrade that drops one of them must fail here, not quietly poll as before (or log an error a start)."""
    ours = _one_call(CLASSIC_POLLING)
    assert ours.returncode == 0 and ours.stdout.strip() == "UNIMPLEMENTED", ours.stderr
    assert "Unknown experiment" not in ours.stderr, ours.stderr
    bogus = _one_call("-no_such_experiment")    # ... which gRPC does say, for a name it does not know
    assert "Unknown experiment: no_such_experiment" in bogus.stderr, bogus.stderr


@pytest.mark.parametrize(("before", "after"), [
    (None, CLASSIC_POLLING),                                    # the mesh's polling, by default
    ("", ""),                                                   # an operator's "": gRPC's own default
    ("-event_engine_client", "-event_engine_client"),           # an operator's own list
])
def test_classic_polling_is_the_default_and_an_operators_choice_stands(before: str | None, after: str) -> None:
    environ = {} if before is None else {"GRPC_EXPERIMENTS": before}
    use_classic_polling(environ)
    assert environ == {"GRPC_EXPERIMENTS": after}


def test_the_cli_sets_it_before_any_command_can_load_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = subprocess.run([sys.executable, "-c", "import sys, stratamesh.cli; print('grpc' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "False", loaded.stderr     # importing the CLI loads no gRPC ...
    from stratamesh.cli import main

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    with pytest.raises(SystemExit):
        main(["agent", "--help"])
    assert os.environ["GRPC_EXPERIMENTS"] == CLASSIC_POLLING     # ... and its main sets it before a command runs
