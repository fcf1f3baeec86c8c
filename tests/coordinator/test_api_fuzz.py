"""Schemathesis against the coordinator's OpenAPI document, schema-valid and schema-breaking requests alike, on the
OpenAI API (over a fake mesh) and the admin API (over a real registry and deployer with agents reduced to message
lists): no 5xx, and every status, content type and body as the document says."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.api.admin import admin_router
from stratamesh.coordinator.api.auth import install_access
from stratamesh.coordinator.api.errors import install_error_handlers
from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.text import Tokenizer
from tests.coordinator.test_admin_api import mesh  # noqa: F401 (a fixture)
from tests.coordinator.test_api import FakeServing, chat_tokenizers  # noqa: F401 (a fixture)
from tests.coordinator.test_deployer import model_dir  # noqa: F401 (a fixture)

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

CASES_PER_OPERATION = 20      # per mode; `stratamesh`'s fuzz benchmark runs many more against a real mesh
# Not "schema-valid data is accepted": a request can fit the document and still be refused by name (max_tokens
# beyond the model's context is a 400).
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]


def fuzz_app(app: FastAPI, skip: tuple[str, ...] = (), headers: dict[str, str] | None = None) -> dict[str, int]:
    """Fuzzes every documented operation of the app, valid and invalid requests; the cases run per operation."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    counts: dict[str, int] = {}
    for operation in (result.ok() for result in schema.get_all_operations()):
        if operation.label in skip:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            # derandomized: the same cases on every run, so CI never fails at random (explore with more elsewhere)
            @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                counts[operation.label] = counts.get(operation.label, 0) + 1
                case.call_and_validate(checks=CHECKS, headers=headers)

            try:
                fuzz()
            except Unsatisfiable:   # nothing to break: an operation without parameters or body has no bad request
                assert mode is GenerationMode.NEGATIVE, operation.label
    print("\ncases per operation:", ", ".join(f"{label} {n}" for label, n in sorted(counts.items())))
    return counts


def test_the_openai_api_answers_any_request_as_documented(chat_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    counts = fuzz_app(create_app(FakeServing(*chat_tokenizers)))
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages", "POST /v1/responses",
                  "POST /v1/embeddings"):
        assert counts[label] >= CASES_PER_OPERATION, (label, counts)


def test_the_admin_api_answers_any_request_as_documented(mesh, model_dir: Path) -> None:  # noqa: F811
    app = mesh[-1]
    # the stream never ends by itself; a drain of a real agent is no fuzz target (test_drain covers it)
    counts = fuzz_app(app, skip=("GET /admin/api/stream",))
    for label in ("POST /admin/api/models", "POST /admin/api/models/{model_id}/replan", "GET /admin/api/stats"):
        assert counts[label] >= CASES_PER_OPERATION, (label, counts)


def test_the_admin_api_behind_access_control_answers_as_documented(mesh, model_dir: Path) -> None:  # noqa: F811
    """The same with the login routes and access control in front, as the coordinator serves it, as an operator."""
    registry, admin = mesh[0], mesh[4]
    access = AccessStore(registry)
    access.add_user("ada", "correct horse", "viewer", time.time())
    app = FastAPI()
    app.include_router(admin_router(admin))
    install_access(app, access)
    install_error_handlers(app)
    key, _ = access.create_key("operator", "fuzzer", time.time())
    counts = fuzz_app(app, skip=("GET /admin/api/stream",), headers={"Authorization": f"Bearer {key}"})
    for label in ("POST /admin/api/login", "POST /admin/api/agents/{agent_id}/revoke", "GET /admin/api/whoami"):
        assert counts[label] >= 1, (label, counts)
