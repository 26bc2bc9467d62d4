"""The pipeline's workdir lock (issue 65): removed when a run stops cleanly, SIGTERM included, and a lock file left by
a run that was killed outright is reported as stale when the next run takes it."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from iprox_lightning.io.score_dir import ScoreDirLock

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_stale_lock_is_reported_taken_over_and_removed_on_release(tmp_path, capsys):
    import socket

    wd = tmp_path / "wd"
    wd.mkdir()
    pid = _dead_pid()
    (wd / ".pipeline.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                   "started": "2026-01-01 00:00:00"}))
    with ScoreDirLock(wd, ".pipeline.lock", "pipeline run", remove=True) as lock:
        assert lock.held and json.loads((wd / ".pipeline.lock").read_text())["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert out == (f"{wd / '.pipeline.lock'}: a stale lock (pid {pid} on host {socket.gethostname()}, started "
                   "2026-01-01 00:00:00, no longer running (a process it started may still hold the lock)) left by a "
                   "pipeline run that stopped without releasing it; taken over\n")
    assert not (wd / ".pipeline.lock").exists()  # removed on release
    # a lock released normally (emptied) is not stale: nothing said
    with ScoreDirLock(wd, ".scoring.lock"):
        pass
    with ScoreDirLock(wd, ".scoring.lock"):
        pass
    assert capsys.readouterr().out == "" and (wd / ".scoring.lock").read_text() == ""


def test_a_lock_file_removed_by_its_holder_is_never_held_twice(tmp_path, monkeypatch):
    """Between a run's open and its flock, the holder releases and removes the file: the run locks the file that
    exists afterwards, not the removed one (else a third run could lock a new file alongside it)."""
    import fcntl

    wd = tmp_path / "wd"
    holder = ScoreDirLock(wd, ".pipeline.lock", "pipeline run", remove=True).acquire()
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        if op & fcntl.LOCK_EX:
            if not calls:  # the holder lets go right after our open
                holder.release()
            calls.append(os.fstat(fd).st_nlink)  # 0: the file is removed
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with ScoreDirLock(wd, ".pipeline.lock", "pipeline run", remove=True) as lock:
        assert calls == [0, 1]  # the removed file locked first, then the one there now, which is held
        assert os.stat(wd / ".pipeline.lock").st_ino == os.fstat(lock._fd).st_ino
    assert not (wd / ".pipeline.lock").exists()


def test_sigterm_stops_the_pipeline_and_removes_its_lock(tmp_path):
    wd = tmp_path / "wd"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "pipeline", "--workdir", str(wd)], cwd=tmp_path,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((wd / ".pipeline.lock").exists() and (wd / ".pipeline.lock").read_text()):
            assert p.poll() is None and time.monotonic() < deadline, "the pipeline ended before it took its lock"
            time.sleep(0.2)
        time.sleep(1.0)  # inside the warm-up
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert not (wd / ".pipeline.lock").exists()
