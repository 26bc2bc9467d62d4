"""A pipeline stopped by a fault resumes (issue 61): a full disk in the middle of a stage leaves its output partial
and the same command, with space made again, redoes that stage instead of refusing it; a SIGTERM that lands between
two stages prints the same ``stopped`` line as one within a stage, and the same command finishes the run.

Both drive ``python train.py pipeline`` on the built-in model and data (``--finetune false`` where the fine-tunes are
not the point), on a pool of 400 examples."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STOPPED = ("stopped (SIGTERM): the finished stages, shards and checkpoints written so far are kept; run the same "
           "command again to resume")


def _pipeline(wd: Path, *extra: str) -> list[str]:
    # a pool of 400 built-in examples (2000 by default): the stages are the same, the run about 3x shorter
    return [sys.executable, str(ROOT / "train.py"), "pipeline", "--workdir", str(wd), "--data_args",
            '{"builtin_size": 400}', *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted at ``tmp_path/disk`` (its size set by the test with ``remount``), unmounted after the test;
    skipped where this process may not mount (CI runs as root on this kind of machine, as here)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True,
                              text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here: the full-disk fault needs a small tmpfs")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): the full-disk fault "
                    "needs one (run as root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _resize(mount: Path, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(mount)], check=True, capture_output=True)


def _used(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_full_disk_in_the_middle_of_the_pipeline_leaves_a_stage_the_next_run_redoes(small_disk, tmp_path):
    """The fault lands in the first fine-tune's save: the disk is sized to what the finished stages hold plus 128 KiB,
    less than the model's weights (about 340 KiB), so ``save_pretrained`` has written ``config.json`` (the stage's
    completion file) and fails in the weights. Before: the re-run refused with '... config.json exists but
    stages/... does not record what produced it'."""
    wd = small_disk / "w"
    first = _run(_pipeline(wd, "--finetune", "false"), tmp_path)  # every stage up to the selections, recorded
    assert first.returncode == 0, first.stderr[-3000:]
    _resize(small_disk, _used(small_disk) + 128 * 1024)
    full = _run(_pipeline(wd), tmp_path)
    assert full.returncode != 0, full.stdout[-2000:]
    assert "No space left on device" in full.stderr, full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]  # one error: line naming the directory, no traceback
    partial = [p for p in (wd / "finetune").glob("*/model") if not (wd / "stages" / f"finetune_{p.parent.name}.json").exists()]
    assert len(partial) == 1 and (partial[0] / "config.json").exists(), sorted((wd / "finetune").rglob("*"))
    name = partial[0].parent.name

    _resize(small_disk, 256 * 1024 * 1024)  # space made again: the same command finishes the run
    again = _run(_pipeline(wd), tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[pipeline] finetune:{name}: runs again: its last run stopped before it finished" in again.stdout
    summary = json.loads((wd / "summary.json").read_text())
    status = {k: v["status"] for k, v in summary["stages"].items()}
    assert status[f"finetune:{name}"] == "ran"
    assert all(status[k] == "reused" for k in ("warmup", "build_proxy", "score:target", "score:proxy"))
    assert not list((wd / "stages").glob("*.running"))
    # the redone stage's model is whole (its weights load), and recorded: the next run reuses every stage
    from safetensors.torch import load_file

    redone = load_file(partial[0] / "model.safetensors")
    assert redone and all(bool(v.isfinite().all()) for v in redone.values())
    rerun = _run(_pipeline(wd), tmp_path)
    assert rerun.returncode == 0 and "runs again" not in rerun.stdout, rerun.stdout[-2000:]
    assert {v["status"] for v in json.loads((wd / "summary.json").read_text())["stages"].values()} == {"reused"}


def test_sigterm_between_two_stages_prints_the_stopped_line_and_the_same_command_resumes(tmp_path):
    """SIGTERM right after the warm-up's record is written: between two stages, or as the next stage loads its
    model, before Lightning's own handler is installed. Before: killed by the signal (exit 143, no line)."""
    wd = tmp_path / "w"
    cmd = _pipeline(wd, "--finetune", "false")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (wd / "stages" / "warmup.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 300, "the warm-up did not finish in time"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    assert STOPPED in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "[pipeline] build_proxy: fit" not in out  # stopped before the next stage finished
    assert not (wd / "summary.json").exists()

    again = _run(cmd, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[pipeline] warmup: reused" in again.stdout
    summary = json.loads((wd / "summary.json").read_text())
    assert summary["stages"]["warmup"]["status"] == "reused" and summary["stages"]["build_proxy"]["status"] == "ran"
    assert not list((wd / "stages").glob("*.running"))


def test_a_stage_marked_running_is_redone_and_an_unmarked_unrecorded_output_still_refused(tmp_path):
    """The ledger's rule (``io/stages.py``): a stage started and not recorded is redone, whether or not an older record
    of it exists (a ``--force`` run stopped half-way must not leave the old record vouching for a half-new output);
    recording it removes the mark; an output without a record and without a mark is still refused (provenance
    unknown)."""
    from iprox_lightning.io.fingerprint import FingerprintMismatch
    from iprox_lightning.io.stages import StageLedger

    wd, cfg = tmp_path / "wd", tmp_path / "stage.yaml"
    cfg.write_text("seed_everything: 0\n")
    done = wd / "warmup" / "model" / "config.json"

    def ledger(force=False):
        led = StageLedger(wd, {"target": "builtin", "pool": "builtin", "validation": "builtin"}, force=force)
        led.prepare("warmup", [cfg], {"model": {"init_args": {"save_dir": str(done.parent)}}})
        return led

    first = ledger()
    assert first.reuse("warmup", done) is False
    first.start("warmup")
    done.parent.mkdir(parents=True)
    done.write_text("{}")  # the stage wrote its completion file, then the disk filled before its record
    second = ledger()
    assert second.reuse("warmup", done) is False and "warmup" in second.partial
    assert "its last run stopped before it finished" in second.notes["warmup"]
    second.start("warmup")
    second.record("warmup")
    assert not second.running_path("warmup").exists()
    assert ledger().reuse("warmup", done) is True

    forced = ledger(force=True)  # a forced re-run stopped half-way: its old record no longer describes the output
    assert forced.reuse("warmup", done) is False
    forced.start("warmup")
    assert not forced.record_path("warmup").exists()
    assert ledger().reuse("warmup", done) is False

    forced.running_path("warmup").unlink()  # neither record nor mark: an output of unknown provenance
    with pytest.raises(FingerprintMismatch, match="does not record what produced it"):
        ledger().reuse("warmup", done)
