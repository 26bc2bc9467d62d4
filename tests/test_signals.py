"""A long command stops at a safe point on SIGTERM or Ctrl-C, says so in one line, and the same command resumes
(issue 55): scoring, whose predict loop Lightning's SIGTERM handler used to let run to its end."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _score_command(out: Path, size: int) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "predict", "--config", str(ROOT / "configs" / "score.yaml"),
            "--config", str(ROOT / "configs" / "builtin" / "score.yaml"), "--model.model", "builtin",
            "--data.tokenizer", "builtin", "--data.builtin_size", str(size), "--data.batch_size", "8",
            "--trainer.callbacks.output_dir", str(out),
            "--trainer.callbacks.write_every_n_batches", "1"]


def _wait_for_shards(proc, out: Path, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not list((out / "shards").glob("*.parquet")):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "scoring wrote no shard in time"
        time.sleep(0.2)


@pytest.mark.parametrize("sig, code, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_a_signal_stops_scoring_at_a_safe_point_and_the_same_command_resumes(tmp_path, sig, code, name):
    from iprox_lightning.io.scores import read_table
    from iprox_lightning.io.score_dir import read_shards

    out = tmp_path / "scores"
    cmd = _score_command(out, 600)
    # run from tmp_path: the config's logger (outputs/logs) and saved config.yaml land there, not in the checkout
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_shards(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert f"stopped ({name}): the finished stages, shards and checkpoints written so far are kept; run the same " \
           "command again to resume" in err
    assert not (out / "scores.parquet").exists()  # stopped before the merge
    kept = sum(t.num_rows for t in read_shards(out, ["id"])[1])
    assert 0 < kept < 600
    # the same command resumes: every id once
    done = subprocess.run(_score_command(out, 600), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    _, table = read_table(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 600


def test_sigterm_stops_a_store_build_and_the_same_command_resumes(tmp_path):
    """Issue 57: SIGTERM during ``build_store`` was ignored until the build ended."""
    from iprox_lightning.io import gradient_store as gs

    out = tmp_path / "store"
    cmd = [sys.executable, str(ROOT / "train.py"), "build_store", "--model", "builtin", "--pool", "builtin",
           "--builtin_size", "600", "--batch_size", "8", "--max_length", "64", "--write_every_n_batches", "1",
           "--progress", "false", "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not gs.shard_files(out):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 120
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "stopped (SIGTERM)" in err, err[-2000:]
    assert not gs.read_info(out).get("complete")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    info = gs.read_info(out)
    ids = [i for s in gs.iter_shards(out, vectors=False) for i in s["ids"]]
    assert info["complete"] and info["rows"] == len(ids) == len(set(ids)) == 600
