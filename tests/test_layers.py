"""The layer rules of docs/architecture.md, checked on the source: imports point down only,
and the pure layers import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import headspace

PACKAGE = Path(headspace.__file__).parent
# the layers, lowest first: a module may import from its own layer and those below
LAYERS = {
    "errors": 0,
    "model": 1,
    "kv": 2,
    "attention": 3,
    "budgets": 3,
    "planner": 4,
    "parallel": 4,
    "tiers": 5,
    "engine": 6,
    "eval": 7,
    "api": 7,
    "server": 7,
    "cli": 8,
    "__init__": 9,
    "__main__": 9,
}
PURE = ["headspace.planner", "headspace.planner.context", "headspace.parallel.balance",
        "headspace.parallel.solvers", "headspace.parallel.rank_plan",
        "headspace.kv.spec"]  # fmt: skip


def _layer(module: str) -> str:
    """``headspace.X.y`` -> ``X``."""
    return module.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``headspace`` import in ``path``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("headspace."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("headspace.")]
    return found


def test_every_package_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if not p.name.startswith("_") or p.name == "__init__.py"}  # fmt: skip
    names -= {"__pycache__"}
    assert names - {"__init__"} <= set(LAYERS) - {"__init__"}, names - set(LAYERS)


def test_imports_point_down():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        own = LAYERS[parts[0]]
        for line, module in _imports(path):
            target = _layer(module)
            if target in LAYERS and LAYERS[target] > own:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_pure_layers_import_no_torch():
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))"
    code = f"import sys; import {', '.join(PURE)}; print({loaded})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_benchmarks_import_only_names_that_exist():
    """Every ``from headspace... import name`` in bench/ (module level or inside a function,
    which only a GPU run would reach) names something the package has: a refactor that
    moves a name must move the benchmarks with it."""
    import importlib

    missing = []
    for path in sorted((PACKAGE.parents[1] / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("headspace")
            ):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
    assert not missing, "\n".join(missing)
