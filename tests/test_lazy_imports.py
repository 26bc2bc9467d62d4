"""Imports sit at the top of a module (issue 62). One stays inside a function only for a measured need, named by a
trailing ``# lazy: <reason>`` on its first line:

- ``--help``: the module is imported while ``python train.py <command> --help`` runs, which loads no torch, Lightning,
  transformers & co. (``tests/test_cli_help.py::test_help_loads_no_heavy_module``);
- ``optional extra <name>``: a package of ``pyproject.toml``'s ``[project.optional-dependencies]`` (peft, ...);
- ``a cached plan loads no ...``: the module is imported by a ``train.py plan`` answered from its cache, which loads
  neither transformers nor Lightning (``tests/test_plan_memory.py``);
- a free one-line reason, in the few files listed in :data:`FREE_REASONS` only.

Hiding an import cycle is no reason: ``tests/test_import_graph.py`` reads imports inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "iprox_lightning"

REASONS = ("--help", "optional extra ", "a cached plan loads no ")
"""The accepted kinds of reason: the first words of the comment after ``# lazy: ``."""

FREE_REASONS: dict[str, str] = {}
"""Files (relative to the package) where a lazy import may give another one-line measured reason, each with what was
measured: none today."""


def function_imports(tree: ast.AST) -> list[ast.stmt]:
    """Every ``import`` / ``from ... import`` inside a function (at any depth) of ``tree``."""
    found: dict[int, ast.stmt] = {}
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[id(node)] = node
    return sorted(found.values(), key=lambda n: n.lineno)


def lazy_reason(line: str) -> str | None:
    """The reason of a ``# lazy: <reason>`` comment on ``line`` (``None`` without one); a further ``#`` comment after
    it (``# noqa: ...``) is not part of the reason."""
    _, tag, reason = line.partition("# lazy:")
    return reason.split("#")[0].strip() if tag else None


def unexplained_imports(path: Path, rel: str) -> list[str]:
    """``file:line: problem`` for each import inside a function of ``path`` without an accepted reason."""
    lines = path.read_text().splitlines()
    bad = []
    for node in function_imports(ast.parse("\n".join(lines), str(path))):
        reason = lazy_reason(lines[node.lineno - 1])
        where = f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}"
        if not reason:
            bad.append(f"{where}  (an import inside a function: move it to the top, or say `# lazy: <reason>`)")
        elif not reason.startswith(REASONS) and rel not in FREE_REASONS:
            bad.append(f"{where}  (reason {reason!r} is none of {REASONS})")
    return bad


def test_every_import_inside_a_function_says_why_it_is_lazy():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the package was read
    bad = []
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        bad += unexplained_imports(path, rel)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, problems", [
    ("import os\n\ndef f():\n    return os.sep\n", 0),
    ("def f():\n    import os\n    return os.sep\n", 1),
    ("def f():\n    import peft  # lazy: optional extra peft\n", 0),
    ("def f():\n    from . import less  # lazy: --help  # noqa: F401\n", 0),
    ("def f():\n    import torch  # lazy:\n", 1),  # no reason
    ("def f():\n    import torch  # lazy: it is faster\n", 1),  # not an accepted kind, and not a listed file
    ("class A:\n    def f(self):\n        def g():\n            from x import (\n                y,\n            )\n", 1),
])
def test_the_check_finds_unexplained_imports(tmp_path, source, problems):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert len(unexplained_imports(path, "m.py")) == problems
