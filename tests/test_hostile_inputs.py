"""Issue 24: inputs a careful or a hostile user gives that used to exit 0 with wrong, lost or mislabelled output,
or stop with a raw traceback. Each test goes through the command line (``iprox_lightning.cli.main``) or the public
Python API, as a user hits it."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from iprox_lightning.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(n, prefix="r"):
    return [{"id": f"{prefix}{j}", "instruction": f"say {j}", "context": "", "response": f"ok {j}",
             "category": "a" if j % 2 else "b"} for j in range(n)]


def _write_jsonl(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ------------------------------------------------------------------------------------------------ hidden files
def test_directory_pool_skips_hidden_files_and_folders_and_says_how_many(tmp_path, caplog):
    """A Jupyter checkpoint (``.ipynb_checkpoints/``) or a dotfile next to the data is not data."""
    from iprox_lightning.data.sft import SFTDataModule

    pool = tmp_path / "pool"
    _write_jsonl(pool / "data.jsonl", _records(4))
    _write_jsonl(pool / ".ipynb_checkpoints" / "data-checkpoint.jsonl", _records(2))  # an older copy: same ids
    _write_jsonl(pool / ".scratch.jsonl", _records(3, prefix="x"))
    dm = SFTDataModule(pool=str(pool), validation=None, tokenizer="builtin")
    with caplog.at_level(logging.WARNING):
        recs = dm.pool_records
    assert [r["id"] for r in recs] == ["r0", "r1", "r2", "r3"]
    assert "skipped 2 hidden file(s)" in caplog.text and ".ipynb_checkpoints/data-checkpoint.jsonl" in caplog.text
