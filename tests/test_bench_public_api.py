"""The benchmarks drive the product through its commands and public API: every name ``bench/*.py`` imports from the
package (or names in a config's ``class_path``) is listed in the package's or a wing's ``__all__``; the commands'
entry point ``iprox_lightning.cli.main`` is the one other way in."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("iprox_lightning.cli", "main")


def package_imports(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` of every import from ``iprox_lightning`` in a file, and of every ``class_path``
    string naming one of its classes (``module`` the dotted path before the class)."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "iprox_lightning":
            out += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "iprox_lightning"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                re.fullmatch(r"iprox_lightning(\.\w+)+", node.value):
            module, _, name = node.value.rpartition(".")
            out.append((module, name, node.lineno))
    return out


def public(module: str, name: str) -> bool:
    if (module, name) == COMMANDS:
        return True
    parts = module.split(".")
    if len(parts) > 2 or not name:  # the package or one wing, never a module inside a wing
        return False
    return name in getattr(importlib.import_module(module), "__all__", ())


def test_bench_imports_only_public_names():
    found = {f"{p.name}:{line}: {module}.{name}" for p in sorted((ROOT / "bench").glob("*.py"))
             for module, name, line in package_imports(p) if not public(module, name)}
    assert found == set()


def test_the_check_sees_a_private_import(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from iprox_lightning.io.scores import read_table\nfrom iprox_lightning.io import read_table\n"
                   "def f():\n    from iprox_lightning.engine import batch\n"
                   "CFG = {'class_path': 'iprox_lightning.scoring.InfluenceWriter'}\n")
    verdicts = [(m, n, public(m, n)) for m, n, _ in package_imports(src)]
    assert verdicts == [("iprox_lightning.io.scores", "read_table", False), ("iprox_lightning.io", "read_table", True),
                        ("iprox_lightning.engine", "batch", False),
                        ("iprox_lightning.scoring", "InfluenceWriter", True)]
