"""What a local mesh's start tells while it waits for /health: each stage an agent could not load, once, as `up`
prints it; and, if the mesh never gets ready, why. Against a real HTTP server that answers as a coordinator would."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stratamesh.launcher import LaunchError, LocalMesh

FAILED = {"model_id": "m", "assignment_id": "as-1", "agent_id": "a2", "error": "out of memory", "at": 1.0}


@pytest.fixture
def coordinator() -> Iterator[tuple[str, list[dict]]]:
    """(its url, the /health bodies it answers in turn, the last one from then on)."""
    answers: list[dict] = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answers.pop(0) if len(answers) > 1 else answers[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", answers
    finally:
        server.shutdown()


def test_each_load_failure_is_told_once_while_the_mesh_gets_ready(coordinator) -> None:
    url, answers = coordinator
    retried = {**FAILED, "assignment_id": "as-2", "agent_id": "a3", "error": "no tensor 'lm_head.weight'"}
    answers += [{"status": "starting"}, {"status": "starting", "load_errors": [FAILED]},
                {"status": "starting", "load_errors": [FAILED]}, {"status": "starting", "load_errors": [FAILED, retried]},
                {"status": "ok"}]
    told: list[str] = []
    mesh = LocalMesh("unused", url=url, say=told.append)
    mesh.wait_ready(timeout_s=60)
    assert told == ["agent a2 could not load its stage of m: out of memory",
                    "agent a3 could not load its stage of m: no tensor 'lm_head.weight'"]


def test_a_mesh_that_never_gets_ready_says_which_stages_failed(coordinator) -> None:
    url, answers = coordinator
    answers.append({"status": "starting", "load_errors": [FAILED]})
    with pytest.raises(LaunchError, match="not ready after .* stages failed to load: agent a2: out of memory"):
        LocalMesh("unused", url=url).wait_ready(timeout_s=0.5)
