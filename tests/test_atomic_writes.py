"""Issue 61 (Deliver 5) / issue 62 (item 4): one temp-and-rename helper (``io/atomic.py``) for every file the package
writes, and one JSON reader (``io/jsonfile.py``) for every small JSON file it reads back. A write that fails (the
file system's size limit, a full disk, a stop) leaves the old file whole and no temporary beside it, and its error
names the file, not the temporary."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "iprox_lightning"

# Each writer: old content written first (small), then a new content above the file size limit.
WRITERS = {
    "write_json": """
        from iprox_lightning.io.jsonfile import write_json
        write_json(path, {"old": 1})
        old = path.read_bytes()
        write_json(path, {"new": "x" * 200_000})""",
    "write_text_atomic": """
        from iprox_lightning.io.atomic import write_text_atomic
        write_text_atomic(path, "old")
        old = path.read_bytes()
        write_text_atomic(path, "new" * 100_000)""",
    "open_atomic": """
        from iprox_lightning.io.atomic import open_atomic
        with open_atomic(path) as f:
            f.write("old\\n")
        old = path.read_bytes()
        with open_atomic(path) as f:
            for i in range(100_000):
                f.write(f"line {i}\\n")""",
    "save_tensors (safetensors)": """
        import torch
        from iprox_lightning.io.gradient_store import save_tensors
        save_tensors(path, {"a": torch.zeros(2)})
        old = path.read_bytes()
        save_tensors(path, {"a": torch.zeros(100_000)})""",
    "write_parquet_atomic": """
        import pyarrow as pa
        from iprox_lightning.io.scores import write_parquet_atomic
        write_parquet_atomic(pa.table({"x": [1]}), path)
        old = path.read_bytes()
        write_parquet_atomic(pa.table({"x": [str(i) * 20 for i in range(20_000)]}), path)""",
    "write_selection (the selection and its meta)": """
        from iprox_lightning.io.selection import write_selection
        write_selection(path, [("a", 1.0)], None, {"k": 1})
        old = path.read_bytes()
        write_selection(path, [(f"id-{i}", float(i)) for i in range(20_000)], None, {"k": 20_000})""",
}

SCRIPT = """
import errno, json, resource, signal, sys
from pathlib import Path
path = Path(sys.argv[1]) / "artifact"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
{body}
    print(json.dumps({{"raised": None}}))
except BaseException as e:
    print(json.dumps({{"raised": type(e).__name__, "errno": getattr(e, "errno", None),
                      "filename": getattr(e, "filename", None), "old_kept": path.read_bytes() == old}}))
"""


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, writer):
    """A real failure of the operating system (the file size limit, EFBIG, as a full disk gives ENOSPC) in the middle
    of each writer: the old file is intact, nothing else is left in the directory, and the error is an ``OSError``
    naming the file itself (safetensors' own ``SafetensorError`` included)."""
    script = SCRIPT.format(body=textwrap.indent(textwrap.dedent(WRITERS[writer]).strip(), "    "))
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["raised"] is not None, "the write should have gone past the limit"
    assert out["errno"] == 27 and out["old_kept"], out  # EFBIG: File too large
    assert out["filename"] == str(tmp_path / "artifact"), out
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left in (["artifact"], ["artifact", "artifact.meta.json"]), left  # no temporary


def test_a_stop_in_the_middle_leaves_the_old_file_and_no_temporary(tmp_path):
    """Ctrl-C (or any error) while the file is written: the old file stays, the temporary is removed."""
    from iprox_lightning.io.atomic import open_atomic, write_text_atomic

    path = write_text_atomic(tmp_path / "a.jsonl", "old\n")
    with pytest.raises(KeyboardInterrupt):
        with open_atomic(path) as f:
            f.write("new\n")
            raise KeyboardInterrupt
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_a_directory_is_written_whole_or_not_at_all(tmp_path):
    """``atomic_path(directory=True)`` (a converted model's cache): on an error nothing is left, on success the
    directory appears with everything written into it."""
    from iprox_lightning.io.atomic import atomic_path

    target = tmp_path / "cache" / "model"
    with pytest.raises(RuntimeError):
        with atomic_path(target, directory=True) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("the weights failed")
    assert list((tmp_path / "cache").iterdir()) == []
    with atomic_path(target, directory=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in target.iterdir()] == ["config.json"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["model"]


def test_a_library_error_carrying_an_os_error_is_that_os_error_naming_the_file(tmp_path):
    """safetensors reports a full disk as ``SafetensorError: ... No space left on device (os error 28)``, which is no
    ``OSError``: the command line printed its traceback. Inside ``atomic_path`` it is the ``OSError`` (ENOSPC) naming
    the file, which ``train.py`` prints as its one disk-full line."""
    import errno

    from iprox_lightning.cli import disk_full_message
    from iprox_lightning.io.atomic import atomic_path

    class SafetensorError(Exception):  # the message safetensors gives on a full disk (checked on a 64 KB tmpfs)
        pass

    with pytest.raises(OSError) as e:
        with atomic_path(tmp_path / "w.safetensors"):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "w.safetensors")
    assert disk_full_message(e.value).startswith(f"the disk is full writing {tmp_path / 'w.safetensors'} ")
    assert list(tmp_path.iterdir()) == []


# Writes that do not go through io/atomic.py, each with the reason it need not.
NOT_ATOMIC = {
    ("io/proxy.py", "rename"): "upgrade_proxy moves the version-1 weights aside and back (no content written)",
    ("io/proxy_export.py", "os.replace"): "the export directory (written whole in a temporary) swapped with the old",
    ("io/proxy_export.py", "tempfile.mkdtemp"): "the export's temporary directory and the old one's place",
    ("io/fingerprint.py", "open"): "sort_safetensors_metadata rewrites the header of a temporary inside atomic_path",
    ("workflow/stages.py", "open"): "a stage process's log, streamed while it runs (not an artifact)",
    ("io/atomic.py", "open"): "the helper itself",
    ("io/atomic.py", "os.replace"): "the helper itself",
    ("io/atomic.py", "write_bytes"): "the helper itself",
}


def _writes(tree: ast.AST):
    """``(call name, line)`` of each call that writes a file: ``write_text`` / ``write_bytes`` / ``rename`` of a
    path, ``os.replace``, ``os.rename``, ``json.dump``, ``tempfile.mkstemp`` / ``mkdtemp``, ``open`` in a writing
    mode."""
    modules = ("os", "json", "tempfile", "shutil")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute):
            module = f.value.id if isinstance(f.value, ast.Name) and f.value.id in modules else None
            name = f"{module}.{f.attr}" if module else f.attr
        else:
            name = f.id if isinstance(f, ast.Name) else None
        if name in ("write_text", "write_bytes", "rename", "os.replace", "os.rename", "json.dump", "tempfile.mkstemp",
                    "tempfile.mkdtemp"):
            yield name, node.lineno
        elif name == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                  None)
            if mode is not None and (not isinstance(mode, ast.Constant) or any(c in str(mode.value) for c in "wax+")):
                yield "open", node.lineno


def test_every_writer_in_the_package_goes_through_the_atomic_helper():
    """No hand-written temp-and-rename and no direct write of an artifact is left in the package: every file is
    written with io/atomic.py (or io/jsonfile.write_json on top of it), except the few listed with their reason."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name, line in _writes(ast.parse(path.read_text())):
            if (rel, name) not in NOT_ATOMIC:
                found.append(f"{rel}:{line} {name}")
    assert found == [], "write through iprox_lightning.io.atomic (or io.jsonfile.write_json):\n" + "\n".join(found)


def _reads(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "loads") \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "json":
            arg = ast.unparse(node.args[0]) if node.args else ""
            if "read_text" in arg or "read_bytes" in arg or node.func.attr == "load":
                yield node.lineno, arg


def test_every_small_json_file_is_read_by_the_one_reader():
    """``json.loads(path.read_text())`` raised a bare JSONDecodeError / AttributeError on a cut, binary or foreign
    file (locks, speeds, seconds per stage, summaries, metas, stage records); each goes through
    io/jsonfile.read_json, which names the file and says what it holds instead. (Record formats read line by line,
    JSONL, and the evaluation suites' own files have their own readers naming the line.)"""
    allowed = {"evaluation/tydiqa.py", "data/eval_readers.py"}  # the evaluation suites' files: EvalDataError readers
    found = [f"{path.relative_to(PACKAGE).as_posix()}:{line} json.loads({arg})"
             for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).as_posix() not in allowed
             for line, arg in _reads(ast.parse(path.read_text()))]
    assert found == [], "read with iprox_lightning.io.jsonfile.read_json:\n" + "\n".join(found)
