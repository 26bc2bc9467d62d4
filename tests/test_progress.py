"""Progress off a terminal (issue 55: 36 minutes without a line under ``tee``): every long loop prints a line at most
every interval with done/total, rate and ETA; on a terminal the usual tqdm bar; nothing for a short loop."""
from __future__ import annotations

import io
import re
from contextlib import contextmanager

import pytest

from iprox_lightning.progress import ProgressLines, progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


LINE = re.compile(r"^\[progress\] IPSVD probes: (\d+)/10 \((\d+)%\), ([\d.]+ (?:batch/s|s/batch)), ETA (\d+):(\d\d)$")


def test_off_a_terminal_a_line_per_interval_with_done_total_rate_and_eta():
    clock, out = FakeClock(), io.StringIO()
    seen = []
    for i in progress(range(10), desc="IPSVD probes", unit="batch", enabled=False, file=out, interval=60, clock=clock):
        clock.t += 25.0  # one item every 25 s: a line after the 3rd (75 s), 6th (150 s) and 9th (225 s)
        seen.append(i)
    assert seen == list(range(10))
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    parsed = [LINE.match(ln) for ln in lines[:3]]
    assert all(parsed), lines
    assert [int(m.group(1)) for m in parsed] == [3, 6, 9]
    m = parsed[0]  # 3 of 10 in 75 s: 25 s a batch (slow loops say s/batch), 7 left at 25 s each = 175 s
    assert int(m.group(2)) == 30 and m.group(3) == "25 s/batch" and int(m.group(4)) * 60 + int(m.group(5)) == 175
    assert lines[-1] == "[progress] IPSVD probes: 10/10 batch in 4:10"


def test_a_short_loop_prints_nothing_and_a_terminal_gets_the_bar():
    clock, out = FakeClock(), io.StringIO()
    for _ in progress(range(100), desc="quick", file=out, interval=60, clock=clock):
        clock.t += 0.1
    assert out.getvalue() == ""
    from tqdm.auto import tqdm

    tty = Terminal()
    bar = progress(range(3), desc="on a terminal", file=tty)
    assert isinstance(bar, tqdm)
    list(bar)
    assert "on a terminal" in tty.getvalue()
    # a terminal, the bar turned off (a pipeline stage): the lines, as off a terminal (issue 65: a resumed stage in a
    # pseudo-terminal printed nothing for 12 minutes); a short loop prints nothing
    off = progress(range(3), desc="bar off", file=tty, enabled=False, interval=60, clock=clock)
    assert list(off) == [0, 1, 2] and "bar off" not in tty.getvalue()
    for _ in progress(range(3), desc="bar off", file=tty, enabled=False, interval=60, clock=clock):
        clock.t += 40.0
    assert "[progress] bar off: 2/3 (67%)" in tty.getvalue()


def test_manual_counter_without_total_and_the_interval_setting(monkeypatch):
    clock, out = FakeClock(), io.StringIO()
    with ProgressLines(desc="store", unit="batch", file=out, interval=10, clock=clock) as bar:
        for _ in range(4):
            clock.t += 6.0
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[progress] store: 2, ") and "so far" in lines[0]
    monkeypatch.setenv("IPROX_PROGRESS_INTERVAL", "0")
    out = io.StringIO()
    for _ in progress(range(3), desc="off", file=out, clock=clock):
        clock.t += 1e6
    assert out.getvalue() == ""


def test_lightning_loops_print_lines_off_a_terminal(tmp_path):
    """The callback the command line's Trainers get off a terminal: a fit epoch and a predict run, fake clock."""
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader

    from iprox_lightning.console import ProgressLinesCallback, add_console_callbacks, quiet_lightning_tips

    quiet_lightning_tips()

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def training_step(self, batch, i):
            clock.t += 40.0
            return self.w(batch).sum()

        def predict_step(self, batch, i):
            clock.t += 40.0
            return self.w(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    clock, out = FakeClock(), io.StringIO()
    data = DataLoader(torch.randn(8, 2), batch_size=2)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[ProgressLinesCallback(interval=60, file=out, clock=clock)])
    trainer.fit(Tiny(), data)
    trainer.predict(trainer.lightning_module, data, return_predictions=False)
    lines = out.getvalue().splitlines()
    # counted in examples (8, in batches of 2): a fit over all its epochs, the epoch in the line
    assert any(ln.startswith("[progress] Tiny fit, epoch 1/1: 4/8 (50%)") and "ETA" in ln for ln in lines), lines
    assert any(ln.startswith("[progress] Tiny predict: 4/8 (50%)") for ln in lines), lines
    assert "[progress] Tiny predict: 8/8 example in 2:40" in lines
    # the command line adds it off a terminal only (pytest's capture is not one)
    assert any(isinstance(c, ProgressLinesCallback) for c in add_console_callbacks({})["callbacks"])


@contextmanager
def lines_to_a_file(path):
    """Everything printed inside the block (``sys.stdout`` and ``sys.stderr``, the progress heartbeat's thread
    included) goes to the file ``path`` (not a terminal); a watcher notes when each line lands there. Yields the list
    of ``(time.monotonic(), line)``, complete when the block ends."""
    import threading
    import time
    from contextlib import redirect_stderr, redirect_stdout

    seen: list[tuple[float, str]] = []
    done = threading.Event()

    def watch():
        pos, part = 0, ""
        while True:
            finished = done.is_set()
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            now = time.monotonic()
            part += chunk
            *lines, part = part.split("\n")
            seen.extend((now, ln) for ln in lines if ln.strip())
            if finished:
                return
            time.sleep(0.1)

    with open(path, "w", encoding="utf-8") as out:
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with redirect_stdout(out), redirect_stderr(out):
                yield seen
        finally:
            out.flush()
            done.set()
            watcher.join()


def largest_gap(seen: list[tuple[float, str]]) -> tuple[float, str]:
    """``(seconds, the line before)`` of the longest wait between two lines."""
    return max((b[0] - a[0], a[1]) for a, b in zip(seen, seen[1:]))


def test_the_demo_pipeline_is_never_silent_for_an_interval(tmp_path, monkeypatch):
    """Issue 65 (the README recipe under tee: 15 gaps over 60 s, one fine-tuning batch of 84 s, an evaluation of
    281 s without a line): the demo pipeline with its output to a file, the interval scaled down to 3 s and one
    fine-tuning batch slowed to 12 s (a step longer than the interval). From the first line to the last no gap
    exceeds the interval plus the heartbeat's 1 s tick and scheduling slack on a loaded machine, and the slowed batch
    is covered by heartbeat lines with its counts."""
    import time

    from iprox_lightning.commands.pipeline import pipeline
    from iprox_lightning.training.finetune import FinetuneModule

    interval, slow_s = 3.0, 12.0
    monkeypatch.setenv("IPROX_PROGRESS_INTERVAL", str(interval))
    real_step, slowed = FinetuneModule.training_step, []

    def slow_step(self, *a, **k):
        if not slowed:
            slowed.append(time.monotonic())
            time.sleep(slow_s)
        return real_step(self, *a, **k)

    monkeypatch.setattr(FinetuneModule, "training_step", slow_step)
    with lines_to_a_file(tmp_path / "pipeline.log") as seen:
        pipeline(workdir=str(tmp_path / "wd"))
    assert slowed and seen[-1][1].strip().startswith("python train.py check")
    worst = largest_gap(seen)
    assert worst[0] <= interval + 4.0, (worst, len(seen))
    during = [ln for t, ln in seen if slowed[0] < t < slowed[0] + slow_s]
    assert sum(ln.startswith("[progress] FinetuneModule fit, epoch 1/") for ln in during) >= 2, during
    assert not any("\r" in ln for _, ln in seen)  # no bar in the log
