"""The package's import graph has no cycles: every import between two of its modules, at module level or
inside a function, read with ``ast`` (an import inside a function hides a cycle from Python, not from a reader)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "iprox_lightning"


def module_files(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (file, is a package __init__)}`` for every ``.py`` file under ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(name: str, path: Path, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules that module ``name`` imports (a ``from X import y`` of a submodule ``X.y`` counts as
    ``X.y`` only; the importer's own parent packages are left out: Python initialises them first anyway)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for top in ast.walk(tree) if _type_checking_only(top) for n in ast.walk(top)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{a.name}" for a in node.names} & modules
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in ``source`` itself
                found.add(source)
    parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in modules and m != name and m not in parents}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(root)
    return {name: imported_modules(name, path, is_pkg, set(files)) for name, (path, is_pkg) in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]


def test_import_graph_reads_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from ..c import C\n")
    (pkg / "c.py").write_text("")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"}, "pkg.c": set()}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["iprox_lightning.cli"]  # the package was read, not an empty tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each sub-package's modules merged into one node (``iprox_lightning.data.sft`` ->
    ``data``); a top-level module is its own node (``iprox_lightning.compression.apply`` -> ``compress``)."""
    def node(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 1 else m

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(node(a), set()).update(node(b) for b in targets if node(b) != node(a))
    return out


def test_folder_graph_merges_subpackages():
    graph = {"p": set(), "p.a": {"p.sub.b"}, "p.sub": set(), "p.sub.b": {"p.sub.c"}, "p.sub.c": {"p.a"}}
    assert folder_graph(graph) == {"p": set(), "a": {"sub"}, "sub": {"a"}}
    assert find_cycle(folder_graph(graph)) == ["a", "sub", "a"]


def test_package_folders_have_no_import_cycle():
    """The folders layer too: io (artifact and record formats) < models < data < ... (no folder leans on a
    folder that leans back on it)."""
    graph = folder_graph(import_graph())
    assert {"data", "io", "models", "scoring", "commands"} <= set(graph)
    assert "io" in graph["models"] and "io" in graph["data"]  # the edges the layering is about exist
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle)


# The wings, lowest first: a folder imports only from its own floor's wings or lower ones, never from a wing on the
# same floor (they are peers) or a higher one. The package root holds only its public face: ``errors``/``progress``
# (ground floor), ``console`` (above them), ``cli`` and ``__init__`` (roof); ``modules/`` and ``callbacks/`` are faces that keep users'
# ``class_path``s (``iprox_lightning.modules.ProxyAlignModule``, ``iprox_lightning.callbacks.IPSVDCallback``) working.
WING_FLOORS = [
    {"errors", "progress", "lazy"},  # progress: every long loop's progress; lazy: names imported on first use
    {"console"},
    {"engine"},  # tracking, batch, target layers, low-rank layer, block surgery, model modes, damping, settings
    {"io"},  # artifact and record formats
    {"models"},
    {"data"},
    {"training", "compression", "scoring"},  # warm-up/fine-tune, Stage 1, influence scoring and stores
    {"alignment"},  # Stage 2 (reads Stage 1's proxy and scores fidelity with the scoring wing)
    {"selection"},
    {"evaluation"},
    {"analysis"},
    {"baselines"},
    {"callbacks", "modules"},
    {"workflow"},  # the pipeline's orchestration: its stages run or reused, per-task selection, summary
    {"commands"},
    {"cli", "iprox_lightning"},
]


def test_every_folder_and_root_module_is_on_a_wing_floor():
    placed = set().union(*WING_FLOORS)
    assert set(folder_graph(import_graph())) == placed


def test_wings_import_only_downwards():
    floor = {w: i for i, ws in enumerate(WING_FLOORS) for w in ws}
    graph = folder_graph(import_graph())
    upward = [(a, b) for a, targets in graph.items() for b in targets if floor[b] >= floor[a]]
    assert not upward, "imports that do not go down a floor: " + ", ".join(f"{a} -> {b}" for a, b in sorted(upward))


@pytest.mark.parametrize("importer, forbidden", [
    ("iprox_lightning.models.loading", "iprox_lightning.data.synthetic"),  # the built-in model lives in models/
    ("iprox_lightning.models.loading", "iprox_lightning.compression.apply"),
    ("iprox_lightning.io.proxy", "iprox_lightning.compression.apply"),
    # Stage 2 reports its fidelity through its callbacks (issue 26), not through the analysis wing
    ("iprox_lightning.alignment.module", "iprox_lightning.analysis.retention"),
    # Stage 1 cuts blocks with the neutral block surgery, not through a baseline
    ("iprox_lightning.compression.apply", "iprox_lightning.baselines.layer_extraction"),
])
def test_low_layers_do_not_import_high_ones(importer, forbidden):
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert forbidden not in reachable(importer)
