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
    "lazy": 0,
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
        "headspace.kv.spec",
        # what the command line's flags are built from (its help answers without torch)
        "headspace.cli.options", "headspace.engine.config", "headspace.budgets.spec",
        "headspace.tiers.settings", "headspace.parallel.launch"]  # fmt: skip


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


def test_no_class_or_module_defines_a_function_twice():
    """A second ``def`` of a name in one class silently replaces the first, and its callers
    then call the other one (only the code path that runs reveals it: a GPU's graph capture
    did, a CPU test could not)."""
    twice = []
    for path in PACKAGE.rglob("*.py"):
        for scope in ast.walk(ast.parse(path.read_text())):
            if not isinstance(scope, (ast.Module, ast.ClassDef)):
                continue
            seen = set()
            for node in scope.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                decorators = " ".join(ast.unparse(d) for d in node.decorator_list)
                again = ("setter", "deleter", "overload", "register")  # (defs meant twice)
                if node.name in seen and not any(w in decorators for w in again):
                    twice.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
                seen.add(node.name)
    assert not twice, twice


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
    """Every ``from headspace... import name`` in bench/ and bench/profiles/ (module level
    or inside a function, which only a GPU run would reach) names something the package
    has: a refactor that moves a name must move the benchmarks with it."""
    import importlib

    missing = []
    bench = PACKAGE.parents[1] / "bench"
    for path in sorted([*bench.glob("*.py"), *bench.glob("profiles/*.py")]):
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


# the runner's methods that change a lane's layout: its step plan's executor calls them
LAYOUT_METHODS = ("_apply", "_lay_out", "_lay_out_plan", "_resize", "_grow_host", "_swap")
# the tier modes' options: the engine reads them through engine/config.py's helpers only
MODE_FLAGS = ("per_head_pages", "cpu_sparsity", "kv_budget", "retrieval_heads",
              "sparse_pattern", "kv_policy", "kv_pool", "cpu_query_blocks", "maw_alpha",
              "window_on_gpu", "gpu_window", "hybrid_cpu_share", "cpu_threads",
              "head_group")  # fmt: skip


def _attributes(path: Path) -> list[tuple[int, str, str]]:
    """(line, attribute, the expression it is read on) of every ``x.attribute`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr, ast.unparse(node.value)))
    return found


def test_only_the_runner_changes_its_layout_and_only_a_lane_asks_it():
    """A lane's layout changes only through its runner's ``prepare(step plan)`` (the
    plan's layout, resize, host pages and page copies), which only ``engine/lane.py`` and
    ``engine/lanes.py`` (teacher forcing, a benchmark's prepared lane) call; the runner's
    layout methods are its own; a part of the arena is rebound only by its split
    (``engine/arena_split.py``)."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        for line, attribute, owner in _attributes(path):
            outside = name != "engine/paged_runner.py"
            if attribute in LAYOUT_METHODS and outside and "runner" in owner:
                wrong.append(f"{name}:{line} {owner}.{attribute}")
            lanes = ("engine/lane.py", "engine/lanes.py")
            if attribute == "prepare" and "runner" in owner and name not in lanes:
                wrong.append(f"{name}:{line} {owner}.prepare")
            if attribute == "rebind" and "runner" in owner and name != "engine/arena_split.py":
                wrong.append(f"{name}:{line} {owner}.rebind")
    assert not wrong, "\n".join(wrong)


def test_no_engine_module_but_its_config_names_a_tier_mode():
    """Tier modes (per-entry pages, the sparse hybrid mode, budgets, patterns, the hybrid
    tier's settings) are decided behind the tier contract and engine/config.py's helpers:
    no other module of engine/ names their options."""
    named = []
    for path in (PACKAGE / "engine").glob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        named += [f"engine/{path.name}: {flag}" for flag in MODE_FLAGS if flag in text]
    assert not named, "\n".join(named)


def _chain(node: ast.expr) -> set[str]:
    """The names and attributes an expression such as ``a.b.c`` or ``a.b(x).c`` is built
    of (``{"a", "b", "c"}``)."""
    names = set()
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    if isinstance(node, ast.Name):
        names.add(node.id)
    return names


def test_tests_and_benchmarks_set_nothing_on_a_runner():
    """Hooks for tests and benchmarks are explicit arguments (``EngineHooks``), never
    attributes set on a runner or its graphs after the engine is made."""
    roots = [PACKAGE.parents[1] / "tests", PACKAGE.parents[1] / "bench"]
    wrong = []
    for path in (p for root in roots for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            for target in targets:
                items = target.elts if isinstance(target, ast.Tuple) else [target]
                for item in items:
                    if isinstance(item, ast.Attribute) and \
                            _chain(item.value) & {"runner", "_graphs", "runners"}:  # fmt: skip
                        wrong.append(f"{path.name}:{node.lineno} {ast.unparse(item)}")
    assert not wrong, "\n".join(wrong)
