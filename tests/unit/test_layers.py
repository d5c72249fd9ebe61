"""The import rule of DESIGN.md: the HTTP layer reaches models only through `Service`."""

from __future__ import annotations

import ast
from pathlib import Path

import fulcrum

SERVER = Path(fulcrum.__file__).parent / "server"
# Modules that own models, engines or batches: only the service may use them.
FORBIDDEN_MODULES = (
    "fulcrum.repository",
    "fulcrum.servable",
    "fulcrum.batcher",
    "fulcrum.instances",
    "fulcrum.service_llm",
    "fulcrum.service_stream",
    "fulcrum.backends",
    "fulcrum.llm.engine",
    "fulcrum.llm.sync_engine",
    "fulcrum.llm.runner",
    "fulcrum.llm.scheduler",
)
# Attributes through which a route could reach past the facade.
FORBIDDEN_ATTRIBUTES = {"repository", "_repository", "engine", "llm_engine", "batcher", "pool"}


def _imports(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = [
        f"{path.name} imports {name}"
        for name in _imports(tree)
        if any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES)
    ]
    found += [
        f"{path.name}:{node.lineno} uses .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES
    ]
    return found


def test_server_modules_reach_models_only_through_the_service() -> None:
    modules = sorted(SERVER.glob("*.py"))
    assert len(modules) >= 4
    assert [v for path in modules for v in _violations(path)] == []


def test_the_rule_catches_a_route_that_reaches_past_the_facade(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from fulcrum.llm.engine import AsyncLLMEngine\n"
        "def route(service):\n    return service.repository.get('m')\n"
    )
    assert _violations(bad) == [
        "bad.py imports fulcrum.llm.engine",
        "bad.py imports fulcrum.llm.engine.AsyncLLMEngine",
        "bad.py:3 uses .repository",
    ]
