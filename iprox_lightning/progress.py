"""Progress of every long loop, on a terminal and off it: one mechanism, :func:`progress`.

* **On a terminal** (the stream's ``isatty()``), :func:`progress` is tqdm's bar, as before, or nothing when the caller
  turned its bar off (``enabled=False``: the pipeline's stages, tests, ``progress=False`` from Python).
* **Off a terminal** (``nohup``, ``| tee run.log``, a CI log, a stage's log file) a bar is ``\\r``-separated noise and
  no bar is silence for as long as the loop lasts (36 minutes between two stage lines in issue 55). There every loop
  prints one plain line at most every :data:`INTERVAL_S` seconds (``$IPROX_PROGRESS_INTERVAL``; ``0`` turns the lines
  off), whether or not its bar was on::

      [progress] IPSVD factors (ipsvd): 12/30 (40%), 0.21 it/s, ETA 1:26

  and, when it printed any, one closing line (``... 30/30 in 2:31``). A loop shorter than the interval prints
  nothing: the happy path of a short run stays quiet.

The loops: IPSVD probes, rank allocation spectra and factors, influence weights, block importance, validation
gradients, K-FAC factors, the check's scoring, the baselines' loops (:func:`progress`), and Lightning's
training / alignment / scoring / store-build loops (:class:`iprox_lightning.console.ProgressLinesCallback`, which
the command line's Trainers get off a terminal). Lines go to stderr, like tqdm's bars.

**Never silent for a minute** (issue 65: one 84 s fine-tuning batch, a 281 s evaluation, 12 minutes of ``build_proxy``
in a resumed run on a terminal printed nothing). A step of a loop can itself take minutes, and a stage has phases
that are no loop (loading, evaluation): a heartbeat thread prints the innermost open counter's line (its counts so far)
or :func:`activity`'s ``still running`` line whenever nothing was shown for an interval, on a terminal too (a bar
that moved, a stage's line, any progress line counts as shown: :func:`touch`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, TextIO

INTERVAL_ENV = "IPROX_PROGRESS_INTERVAL"
INTERVAL_S = 60.0
"""Seconds between two progress lines off a terminal (default; ``$IPROX_PROGRESS_INTERVAL`` overrides, 0: none)."""


def interval_s() -> float:
    """:data:`INTERVAL_S`, or ``$IPROX_PROGRESS_INTERVAL`` when set (a bad value is ignored)."""
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, INTERVAL_S)))
    except ValueError:
        return INTERVAL_S


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _clock_text(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


_OPEN: list = []  # weak references to the open counters (ProgressLines, activity), innermost last
_OPEN_LOCK = threading.Lock()
_SHOWN = [time.monotonic()]  # when something was last shown (a progress line, a bar that moved, a stage line)
_BEAT: list[threading.Thread] = []


HEARTBEAT_SHARE = 0.9
"""The heartbeat speaks after this share of the interval without a line, so that a line lands within the interval."""


def touch() -> None:
    """Something was shown just now: the heartbeat waits a full interval from here."""
    _SHOWN[0] = time.monotonic()


def _heartbeat() -> None:
    while True:
        time.sleep(1.0)
        with _OPEN_LOCK:
            alive = [r() for r in _OPEN]
            _OPEN[:] = [r for r, c in zip(_OPEN, alive) if c is not None and not c.closed]
            top = next((c for c in reversed(alive) if c is not None and not c.closed), None)
        # at 0.9 of the interval: a loaded machine delays the thread by seconds (66 s gaps at 60 s, load 9)
        if top is not None and top.interval > 0 and time.monotonic() - _SHOWN[0] >= HEARTBEAT_SHARE * top.interval:
            try:
                top.beat()
            except Exception:  # pragma: no cover - a closed stream at exit: nothing to say
                pass


def _register(counter: "ProgressLines") -> None:
    with _OPEN_LOCK:
        if not any(r() is not None and not r().closed for r in _OPEN):
            touch()  # the first open counter: silence counts from here (a counter inside it changes nothing)
        _OPEN.append(weakref.ref(counter))
        if not _BEAT:
            t = threading.Thread(target=_heartbeat, name="iprox-progress-heartbeat", daemon=True)
            t.start()
            _BEAT.append(t)


class ProgressLines:
    """A tqdm-like counter (iterate it, or ``update(n)`` / ``close()``; a context manager) that prints one line at most
    every ``interval`` seconds: done/total, share, rate, ETA (module docstring)."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", file: TextIO | None = None, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic, initial: int = 0) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.file = file
        self.interval = interval_s() if interval is None else interval
        self.clock = clock
        self.n = initial
        self.start = self.last = clock()
        self.printed = 0
        self.closed = False
        if self.interval > 0 and clock is time.monotonic:  # a counter on the real clock has a heartbeat
            _register(self)

    # tqdm's interface, as far as the package uses it
    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:  # type: ignore[union-attr]
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        return self.total if self.total is not None else len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total
        self.start = self.last = self.clock()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.interval > 0 and now - self.last >= self.interval:
            self.last = now
            self._write(self.line(now))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.printed:
            now = self.clock()
            of = f"/{self.total}" if self.total is not None else ""
            self._write(f"[progress] {self.desc}: {self.n}{of} {self.unit} in {_clock_text(now - self.start)}")

    def beat(self) -> None:
        """The heartbeat's line: the counts so far (nothing was shown for an interval, e.g. one step takes minutes)."""
        now = self.clock()
        self.last = now
        self._write(self.line(now))

    def line(self, now: float) -> str:
        """``[progress] <desc>: <done>/<total> (<share>), <rate> <unit>/s, ETA <m:ss>``."""
        elapsed = max(now - self.start, 1e-9)
        if self.unit is None:  # an activity: no counts
            return f"[progress] {self.desc}: still running, {_clock_text(elapsed)} so far"
        rate = self.n / elapsed
        text = f"[progress] {self.desc}: {self.n}"
        if self.total:
            text += f"/{self.total} ({self.n / self.total:.0%})"
        text += f", {rate:.3g} {self.unit}/s" if rate >= 0.1 or not self.n else f", {1 / rate:.3g} s/{self.unit}"
        if self.total and self.n:
            text += f", ETA {_clock_text((self.total - self.n) / rate)}"
        else:
            text += f", {_clock_text(elapsed)} so far"
        return text

    def _write(self, text: str) -> None:
        stream = self.file if self.file is not None else sys.stderr
        print(text, file=stream, flush=True)
        self.printed += 1
        touch()


class activity:
    """A phase without counts (a stage, an evaluation, loading): off a terminal and on it, ``[progress] <desc>: still
    running, <m:ss> so far`` whenever nothing was shown for an interval while the block runs (a counter opened inside
    it speaks instead, with its counts); nothing for a phase shorter than the interval. A context manager."""

    def __init__(self, desc: str, *, file: TextIO | None = None, interval: float | None = None) -> None:
        self.desc, self.file = desc, file
        self.interval = interval_s() if interval is None else interval
        self._lines: ProgressLines | None = None

    def __enter__(self) -> "activity":
        if self.interval > 0:
            self._lines = ProgressLines(desc=self.desc, unit=None, file=self.file, interval=self.interval)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lines is not None:
            self._lines.closed = True  # no closing line: the caller says how it ended


class _Silent:
    """What :func:`progress` gives on a terminal with the bar off: the iterable itself, counters that do nothing."""

    def __init__(self, iterable: Iterable | None, total: int | None) -> None:
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self) -> Iterator:
        return iter(self.iterable)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, desc: str, refresh: bool = True) -> None:
        pass

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total


def _bar_class():
    """tqdm's bar, telling the heartbeat that it moved (:func:`touch`)."""
    from tqdm.auto import tqdm  # lazy: --help (0.06 s)

    class Bar(tqdm):
        def update(self, n=1):
            touch()
            return super().update(n)

        def __iter__(self):
            for item in super().__iter__():
                touch()
                yield item

    return Bar


def progress(iterable: Iterable | None = None, *, desc: str, total: int | None = None, unit: str = "it",
             enabled: bool = True, leave: bool = False, file: TextIO | None = None, interval: float | None = None,
             clock: Callable[[], float] = time.monotonic):
    """Progress over ``iterable`` (or a counter to ``update``, ``total`` steps): tqdm's bar on a terminal when
    ``enabled``, else :class:`ProgressLines` (a line at most every ``interval`` seconds, default :func:`interval_s`;
    on a terminal with the bar off too: a long loop is never silent there either). ``file``: the stream (default
    stderr, tqdm's)."""
    stream = file if file is not None else sys.stderr
    if is_terminal(stream) and enabled:
        return _bar_class()(iterable, desc=desc, total=total, unit=unit, leave=leave, file=file)
    every = interval_s() if interval is None else interval
    if every <= 0:
        return _Silent(iterable, total)
    return ProgressLines(iterable, total=total, desc=desc, unit=unit, file=file, interval=every, clock=clock)
