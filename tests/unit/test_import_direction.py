"""Dependencies point one way: down the layers of service/, never back up; scoring never pulls in the service stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scoring", "service")


def modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return set(out.split())


def test_scoring_imports_no_http_sql_or_prometheus():
    loaded = modules_loaded_by("import scoring, scoring.estimators, scoring.samplers, scoring.snr_filter")
    assert not loaded & {"fastapi", "sqlalchemy", "prometheus_client", "service", "starlette", "uvicorn"}


def test_the_torch_free_parts_of_scoring_load_no_torch():
    loaded = modules_loaded_by(
        "import scoring, scoring.estimators, scoring.samplers, scoring.snr_filter, scoring.partition, scoring.batch"
    )
    assert "torch" not in loaded
    assert "torch" in modules_loaded_by("from scoring import score_batch")  # the lazy names still resolve


def test_wire_schemas_import_no_web_framework_database_or_torch():
    loaded = modules_loaded_by("import " + ", ".join(modules_under("service/schemas")))
    assert not loaded & {"fastapi", "starlette", "sqlalchemy", "torch"}


def modules_under(*folders: str) -> list[str]:
    """The dotted names of every module below ``folders`` (relative to the root), migrations aside."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "migrations" not in path.parts:
                parts = path.relative_to(ROOT).with_suffix("").parts
                found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_use_cases_storage_metrics_and_alerts_import_no_web_framework():
    below_the_api = modules_under(
        "service/storage", "service/alerts", "service/ingest", "service/reads", "service/jobs"
    )
    loaded = modules_loaded_by("import " + ", ".join([*below_the_api, "service.metrics", "service.snapshot"]))
    assert not loaded & {"fastapi", "starlette", "uvicorn"}


def test_routers_never_load_the_composition_root_and_an_api_process_never_loads_torch():
    routers = modules_loaded_by("import " + ", ".join(modules_under("service/api")))
    assert "service.app" not in routers
    api_process = modules_loaded_by("import " + ", ".join(["service.app", *modules_under("service/ingest")]))
    assert not api_process & {"torch", "transformers", "service.jobs.worker"}


def _imports(path: Path, module: str) -> set[str]:
    """Every scoring/service module ``path`` imports, at any depth (deferred and TYPE_CHECKING ones too)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {module: _imports(path, module) & set(files) - {module} for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_scoring_or_service_imports_itself_back():
    graph = import_graph()
    # A package's __init__ that re-exports its modules is not a cycle of logic; leave it out.
    graph = {m: {o for o in deps if o not in PACKAGES} for m, deps in graph.items() if m not in PACKAGES}
    assert cycles(graph) == []


# The layers of the tree, top first (docs/architecture.md): a module imports its own package or a
# lower layer, never a higher one or another package of its own layer. A module belongs to the
# entry that is its longest prefix.
LAYERS = (
    ("service.cli",),
    ("service.app",),
    ("service.runtime",),
    ("service.api",),
    ("service.ingest",),
    ("service.reads",),
    ("service.jobs",),
    ("service.alerts",),
    ("service.access", "service.loops", "service.metrics", "service.snapshot"),
    ("service.schemas",),
    ("service.storage", "service.web"),
    ("service.settings", "service.errors"),
    ("scoring",),
)


def home(module: str) -> tuple[int, str]:
    """The layer and the entry of ``LAYERS`` a module belongs to (the longest matching prefix)."""
    entries = [(level, entry) for level, row in enumerate(LAYERS) for entry in row]
    matches = [(level, entry) for level, entry in entries if module == entry or module.startswith(entry + ".")]
    assert matches, f"{module} is in no layer of LAYERS: add its package there"
    return max(matches, key=lambda match: len(match[1]))


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair that goes to a higher layer or sideways into another package."""
    found = []
    for module, deps in sorted(graph.items()):
        level, entry = home(module)
        for other in sorted(deps):
            other_level, other_entry = home(other)
            if other_entry != entry and other_level <= level:
                found.append((module, other))
    return found


def test_every_import_points_down_the_layers():
    # The top packages sit in no layer; a module that imports none of the tree cannot point up.
    graph = {m: deps - set(PACKAGES) for m, deps in import_graph().items() if m not in PACKAGES and deps}
    assert upward_imports(graph) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"service.storage.tables": {"service.api.deps"}}, [("service.storage.tables", "service.api.deps")]),
        ({"service.jobs.worker": {"service.ingest.runs"}}, [("service.jobs.worker", "service.ingest.runs")]),
        ({"service.access": {"service.loops"}}, [("service.access", "service.loops")]),
        ({"service.api.runs": {"service.ingest.runs", "service.api.deps"}, "service.schemas": {"scoring.batch"}}, []),
    ],
)
def test_the_layer_check_finds_upward_and_sideways_imports(graph, expected):
    assert upward_imports(graph) == expected


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected
