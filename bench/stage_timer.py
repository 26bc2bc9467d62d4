"""Wall-clock time and peak memory of named stages, for the benchmarks (``bench/fidelity.py``).

Not part of the package: the product's stages time themselves (``seconds_per_stage.json`` of a pipeline
run); the benchmarks wrap their own loops in :class:`StageTimer`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch


def _read_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


@dataclass
class StageRecord:
    """Measured cost of one stage: wall-clock seconds, peak memory (bytes) and where it was measured."""

    name: str
    wall_s: float = 0.0
    peak_memory_bytes: int | None = None
    memory_kind: str = ""
    calls: int = 0
    flops: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StageTimer:
    """Measure wall-clock time and peak memory of named stages::

        timer = StageTimer(logger=trainer.logger)
        with timer.stage("probe"):
            ...
        print(timer.table())

    Peak memory is ``torch.cuda.max_memory_allocated`` (reset on entry) when CUDA is in use,
    otherwise the process's peak resident set size ``VmHWM`` (reset on entry through
    ``/proc/self/clear_refs`` on Linux; where that is not permitted, the lifetime peak is
    reported and ``memory_kind`` says so). CUDA work is synchronised before reading the clock.
    Re-entering a stage name accumulates time and keeps the maximum peak. With a Lightning
    ``logger`` (or anything with ``log_metrics``), each stage logs ``time/<name>_s`` and
    ``memory/<name>_peak_mb``.
    """

    def __init__(self, logger: Any = None, *, device: str | torch.device | None = None) -> None:
        self.logger = logger
        self.records: dict[str, StageRecord] = {}
        dev = torch.device(device) if device is not None else None
        self.cuda = (dev is None or dev.type == "cuda") and torch.cuda.is_available()

    @contextlib.contextmanager
    def stage(self, name: str, *, flops: float | None = None) -> Iterator[StageRecord]:
        rec = self.records.setdefault(name, StageRecord(name))
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            kind = "cuda_max_allocated"
        else:
            kind = "cpu_peak_rss" if _reset_peak_rss() else "cpu_peak_rss_lifetime"
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            if self.cuda:
                torch.cuda.synchronize()
                peak = int(torch.cuda.max_memory_allocated())
            else:
                kb = _read_status_kb("VmHWM")
                peak = kb * 1024 if kb is not None else None
            rec.wall_s += time.perf_counter() - t0
            rec.calls += 1
            rec.memory_kind = kind
            if peak is not None:
                rec.peak_memory_bytes = max(peak, rec.peak_memory_bytes or 0)
            if flops is not None:
                rec.flops = (rec.flops or 0.0) + flops
            self._log(rec)

    def _log(self, rec: StageRecord) -> None:
        if self.logger is None or not hasattr(self.logger, "log_metrics"):
            return
        metrics = {f"time/{rec.name}_s": rec.wall_s}
        if rec.peak_memory_bytes is not None:
            metrics[f"memory/{rec.name}_peak_mb"] = rec.peak_memory_bytes / 2**20
        self.logger.log_metrics(metrics, step=rec.calls)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {k: v.as_dict() for k, v in self.records.items()}

    def table(self) -> str:
        """A plain-text table of the recorded stages."""
        lines = [f"{'stage':<16}{'wall s':>10}{'peak MiB':>12}{'TFLOPs':>10}"]
        for r in self.records.values():
            mem = f"{r.peak_memory_bytes / 2**20:.1f}" if r.peak_memory_bytes is not None else "-"
            fl = f"{r.flops / 1e12:.3f}" if r.flops is not None else "-"
            lines.append(f"{r.name:<16}{r.wall_s:>10.2f}{mem:>12}{fl:>10}")
        return "\n".join(lines)
