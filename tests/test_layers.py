"""Imports flow one way (docs/architecture.md, "The rules of the house"): checked on the source of every module, with
ast."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"stratamesh": "stratamesh", "fleet": "stratamesh.fleet", "agent": "stratamesh.agent",
           "coordinator": "stratamesh.coordinator", "partitioner": "stratamesh.partitioner",
           "kernels": "stratamesh.kernels"}
# The vocabulary agents, coordinator and partitioner share, by concern: frozen values, no I/O.
VOCABULARY = ("stratamesh.fleet.stages", "stratamesh.fleet.boxes", "stratamesh.fleet.sessions", "stratamesh.fleet.kv",
              "stratamesh.fleet.control_messages")
PURE = (*VOCABULARY, "stratamesh.fleet.errors", "stratamesh.fleet.prefix", "stratamesh.fleet.weights",
        "stratamesh.fleet.states")
IO_AND_DEVICE = ("torch", "grpc", "zeroconf", "sqlite_utils", "sqlite3", "onnxruntime")

# module prefix -> (stratamesh packages it may import, external modules it must not import)
RULES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    *((module, PURE, IO_AND_DEVICE) for module in PURE),
    ("stratamesh.fleet", ("stratamesh.fleet",), ("torch",)),
    ("stratamesh.partitioner", ("stratamesh.partitioner", *PURE), IO_AND_DEVICE),
    # (and the GGUF file reader: files, as kernels read safetensors, no network)
    ("stratamesh.kernels", ("stratamesh.kernels", *PURE, "stratamesh.fleet.gguf_files"),
     ("grpc", "zeroconf", "sqlite_utils")),
    ("stratamesh.agent.engine.scheduler", ("stratamesh.agent.engine", *PURE), IO_AND_DEVICE),
    ("stratamesh.agent.engine.block_manager", ("stratamesh.agent.engine", *PURE), IO_AND_DEVICE),
    ("stratamesh.agent", ("stratamesh.agent", "stratamesh.kernels", "stratamesh.fleet"), ()),
    ("stratamesh.coordinator", ("stratamesh.coordinator", "stratamesh.partitioner",
                                "stratamesh.fleet"), ("torch",)),
]


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [FOLDERS[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str) -> set[str]:
    """Every module an import statement in source names, relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
            names.add(base)
    return names


def violations(module: str, imported: set[str]) -> list[str]:
    for prefix, allowed, forbidden in RULES:
        if module == prefix or module.startswith(prefix + "."):
            break
    else:
        return []
    found = []
    for name in sorted(imported):
        internal = name == "stratamesh" or name.startswith("stratamesh.")
        if internal and not any(name == a or name.startswith(a + ".") for a in allowed):
            found.append(f"{module} imports {name}")
        if not internal and name.split(".")[0] in forbidden:
            found.append(f"{module} imports {name}")
    return found


def all_modules() -> list[tuple[str, Path]]:
    return [(module_name(p), p) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_imports_flow_one_way() -> None:
    modules = all_modules()
    assert len(modules) > 20
    found = [v for module, path in modules for v in violations(module, imports_of(path.read_text(), module))]
    assert found == []


@pytest.mark.parametrize("module, source, bad", [
    ("stratamesh.agent.daemon", "from stratamesh.coordinator import registry", True),
    ("stratamesh.coordinator.serving.origin", "import torch", True),
    ("stratamesh.partitioner.x", "from stratamesh.fleet.wire import convert", True),
    ("stratamesh.partitioner.x", "def f():\n    import grpc", True),
    ("stratamesh.kernels.models.decoder", "from ..ops import rope", False),
    ("stratamesh.fleet.stages", "import pydantic", False),
    ("stratamesh.fleet.sessions", "from stratamesh.fleet.wire import convert", True),
])
def test_the_checker_catches_violations(module: str, source: str, bad: bool) -> None:
    assert bool(violations(module, imports_of(source, module))) == bad


# The coordinator's gRPC edge: its servicers (control.servicer, enrollment, the origin's Deliver), its clients of the
# agents' services (KV moves, span fetches) and the modules that wire them into servers (a coordinator's front, and
# what it starts once it leads). Only these speak protobuf; the domain code
# (the rest of control/: roster, routes, plans, drains, the deployer; placement, registry, admin, the HTTP API)
# sends and receives fleet types.
GRPC_EDGE = {f"stratamesh.coordinator.{m}"
             for m in ("control.servicer", "enrollment", "serving.sessions", "serving.servicer", "serving.kv_moves",
                       "traces", "front", "leader")}
PROTOBUF = {f"stratamesh.fleet.wire.{m}" for m in ("mesh_pb2", "mesh_pb2_grpc", "convert")}


def protobuf_imports(module: str, source: str) -> list[str]:
    """What a coordinator module outside the gRPC edge imports of the wire's protobuf modules."""
    if not module.startswith("stratamesh.coordinator") or module in GRPC_EDGE:
        return []
    names = imports_of(source, module)
    for node in ast.walk(ast.parse(source)):    # "from stratamesh.fleet.wire import convert" names the package
        if isinstance(node, ast.ImportFrom) and node.module == "stratamesh.fleet.wire":
            names |= {f"stratamesh.fleet.wire.{alias.name}" for alias in node.names}
    return [f"{module} imports {name}" for name in sorted(names & PROTOBUF)]


def test_in_the_coordinator_only_the_grpc_edge_speaks_protobuf() -> None:
    assert [v for module, path in all_modules() for v in protobuf_imports(module, path.read_text())] == []


@pytest.mark.parametrize("module, source, bad", [
    ("stratamesh.coordinator.control.deployer", "from stratamesh.fleet.wire import convert", True),
    ("stratamesh.coordinator.api.admin", "from stratamesh.fleet.wire import mesh_pb2 as pb", True),
    ("stratamesh.coordinator.control.drainer", "import stratamesh.fleet.wire.mesh_pb2_grpc", True),
    ("stratamesh.coordinator.control.roster", "from stratamesh.fleet.wire import mesh_pb2 as pb", True),
    ("stratamesh.coordinator.control", "from stratamesh.fleet.wire import convert", True),
    ("stratamesh.coordinator.control.servicer", "from stratamesh.fleet.wire import convert", False),
    ("stratamesh.coordinator.control.deployer", "from stratamesh.fleet.wire.channels import make_channel", False),
])
def test_the_protobuf_check_catches_domain_code_that_speaks_it(module: str, source: str, bad: bool) -> None:
    assert bool(protobuf_imports(module, source)) == bad


# The request path points one way (docs/architecture.md, section 7): the HTTP API (api/) calls the origin (serving/),
# which asks the control plane (control/) for routes; control/ reaches the origin's sessions only through the
# Sessions protocol it defines, and nothing calls back up.
ONE_WAY: list[tuple[str, tuple[str, ...]]] = [
    ("stratamesh.coordinator.control", ("stratamesh.coordinator.serving", "stratamesh.coordinator.api")),
    ("stratamesh.coordinator.serving", ("stratamesh.coordinator.api",)),
]


def backward_imports(module: str, imported: set[str]) -> list[str]:
    found = []
    for prefix, above in ONE_WAY:
        if module == prefix or module.startswith(prefix + "."):
            found += [f"{module} imports {name}" for name in sorted(imported)
                      if any(name == a or name.startswith(a + ".") for a in above)]
    return found


def test_the_request_path_points_one_way() -> None:
    assert [v for module, path in all_modules() for v in backward_imports(module, imports_of(path.read_text(), module))] == []


@pytest.mark.parametrize("module, source, bad", [
    ("stratamesh.coordinator.control.routes", "from stratamesh.coordinator.serving.router import RouteWork", True),
    ("stratamesh.coordinator.serving.origin", "from stratamesh.coordinator.api.openai import ModelCard", True),
    ("stratamesh.coordinator.control.drainer", "def f():\n    from stratamesh.coordinator.serving import sessions", True),
    ("stratamesh.coordinator.serving.router", "from stratamesh.coordinator.control.routes import Routes", False),
    ("stratamesh.coordinator.api.openai", "from stratamesh.coordinator.serving.request import Request", False),
])
def test_the_one_way_check_catches_a_call_back_up(module: str, source: str, bad: bool) -> None:
    assert bool(backward_imports(module, imports_of(source, module))) == bad


def project_imports(module: str, source: str, modules: set[str]) -> set[str]:
    """The project's modules that module imports ("from package import module" names the module)."""
    names = set()
    for name in imports_of(source, module):
        if name in modules:
            names.add(name)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else ".".join(
                module.split(".")[:-node.level] + [node.module])
            names |= {f"{base}.{alias.name}" for alias in node.names} & modules
    return names - {module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, each of more than one module (Tarjan's strongly connected
    components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_coordinator_imports_a_module_that_imports_it_back() -> None:
    """The coordinator holds the request path (api/, serving/, control/ and what they use): no cycle of imports
    there, direct or through others, type-checking imports included."""
    modules = dict(all_modules())
    graph = {m: project_imports(m, p.read_text(), set(modules)) for m, p in modules.items()}
    assert [c for c in import_cycles(graph) if any(m.startswith("stratamesh.coordinator") for m in c)] == []


@pytest.mark.parametrize("graph, cycles", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_cycle_check_finds_modules_that_import_each_other(graph: dict[str, set[str]],
                                                              cycles: list[list[str]]) -> None:
    assert import_cycles(graph) == cycles


# The stratamesh/ folder (SDK, CLI, bench, launcher, test beds) sits on top of the others: none of them may depend on
# it, by an import or by naming one of its modules for a process to run (`python -m stratamesh.cli ...`).
TOP = "stratamesh"
LOWER = tuple(f"stratamesh.{folder}" for folder in FOLDERS if folder != TOP)


def top_modules() -> set[str]:
    """The modules and packages of the stratamesh/ folder itself (stratamesh.cli, stratamesh.sdk, ...)."""
    return {m for m, _ in all_modules() if m.startswith(f"{TOP}.") and not m.startswith(LOWER)}


def names_of_top_modules(module: str, source: str, top: set[str]) -> list[str]:
    """The stratamesh/ modules a lower module names: imported, or in a string (a docstring aside)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    named = {name for name in imports_of(source, module) if name in top or name.startswith(tuple(f"{t}." for t in top))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            named |= {t for t in top if re.search(rf"\b{re.escape(t)}\b", node.value)}
    return [f"{module} names {name}" for name in sorted(named)]


def test_no_folder_below_depends_on_the_sdk_cli_or_test_beds() -> None:
    top = top_modules()
    assert {"stratamesh.cli", "stratamesh.launcher", "stratamesh.testbed"} <= top
    assert [v for module, path in all_modules() if module.startswith(LOWER)
            for v in names_of_top_modules(module, path.read_text(), top)] == []


@pytest.mark.parametrize("source, bad", [
    ("from stratamesh.launcher import LocalMesh", True),
    ("import subprocess\nsubprocess.run(['python', '-m', 'stratamesh.cli', 'agent'])", True),
    ("def f():\n    from stratamesh.testbed import sim", True),
    ('"""Started by stratamesh.cli."""\nfrom stratamesh.fleet import stages', False),
])
def test_the_top_check_catches_a_hidden_dependency(source: str, bad: bool) -> None:
    top = {"stratamesh.cli", "stratamesh.launcher", "stratamesh.testbed", "stratamesh.testbed.sim"}
    assert bool(names_of_top_modules("stratamesh.fleet.x", source, top)) == bad
