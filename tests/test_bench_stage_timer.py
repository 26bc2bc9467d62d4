"""bench/stage_timer.py: the benchmarks' wall-clock and peak-memory timer."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from stage_timer import StageTimer  # noqa: E402


def test_stage_timer_records_time_memory_and_logs():
    logged = []

    class Logger:
        def log_metrics(self, metrics, step):
            logged.append((metrics, step))

    timer = StageTimer(logger=Logger(), device="cpu")
    with timer.stage("probe", flops=1e6):
        time.sleep(0.05)
        buf = torch.ones(20_000_000)  # 80 MB
        del buf
    with timer.stage("probe"):
        time.sleep(0.01)
    rec = timer.records["probe"]
    assert rec.calls == 2 and rec.wall_s >= 0.06 and rec.flops == 1e6
    assert rec.peak_memory_bytes is not None and rec.peak_memory_bytes > 80e6
    assert logged[-1][0]["time/probe_s"] == rec.wall_s and "memory/probe_peak_mb" in logged[-1][0]
    assert "probe" in timer.table()
