"""Each stage of a pipeline run: run as ``python train.py <command>`` with its configs and an overlay of this run's
paths (in this process, or with several devices in its own), or reused when its output exists with the same
fingerprint (:class:`~iprox_lightning.io.stages.StageLedger`); its seconds and peak device memory recorded in the
workdir; a SIGTERM stopping the run with the CLI's one ``stopped`` line."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .. import console
from ..analysis.fit import merge_overlay
from ..console import quiet_stage
from ..data.eval_validation import parse_eval_source
from ..errors import InputNotFoundError, UserError, UserInputError
from ..io.atomic import write_text_atomic
from ..io.jsonfile import Fields, read_json, write_json
from ..io.score_dir import clear_output
from ..io.stages import StageLedger
from ..progress import activity, touch

log = logging.getLogger(__name__)


DEFAULT_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _write_overlay(path: Path, content: dict) -> Path:
    return write_text_atomic(path, yaml.safe_dump(content, sort_keys=False))


class _SigtermStop:
    """SIGTERM during a pipeline run stops it as SIGTERM within a stage does: ``train.py`` prints its one ``stopped``
    line and exits 143 (before, a SIGTERM between two stages killed the process with no line).

    Inside a stage run in this process Lightning's own handler is installed (it calls this one too): the stage stops at
    its next safe point and raises ``SIGTERMException``; one that ends anyway is recorded and the run stops after it.
    Anywhere else (between stages, loading a stage's model, saving its output) the run stops at once, as Ctrl-C does:
    every artifact is written to a temporary and renamed, and a stage stopped before its record is redone by the next
    run (:meth:`~iprox_lightning.io.stages.StageLedger.start`). A stage in its own processes gets the signal passed on
    and stops at its safe point; the run stops when it has."""

    def __init__(self) -> None:
        self.pending = False
        self.child = None  # the stage process running now (several devices), if any
        self._previous = None
        self._installed = False

    def _handler(self, signum, frame) -> None:
        self.pending = True
        if self.child is not None:
            self.child.send_signal(signum)
        elif signal.getsignal(signal.SIGTERM) == self._handler:  # no Lightning run is stopping at its safe point
            self.stop()

    def stop(self) -> None:
        raise SIGTERMException()

    def check(self) -> None:
        """Stop now if a SIGTERM came while a stage ran to its end."""
        if self.pending:
            self.stop()

    def __enter__(self):
        self.pending, self.child = False, None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self._installed = True
        except ValueError:  # not the main thread: no handler of ours
            self._installed = False
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


_SIGTERM = _SigtermStop()


def _processes(trainer: dict[str, Any]) -> int:
    return int(trainer.get("devices") or 1) * int(trainer.get("num_nodes") or 1)


def _run_stage_process(args: list[str], log_file: Path, threads: int | None) -> None:
    """``python -m iprox_lightning.cli <args>`` in its own process (Lightning's launcher starts the other ranks from
    it), its output into ``log_file``; a stage's one-line user error is raised as one, any other failure with the end
    of the output."""

    root = str(Path(__file__).resolve().parents[2])  # the directory holding the package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "iprox_lightning.cli", *args], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
        _SIGTERM.child = child  # a SIGTERM is passed on: the stage stops at its safe point
        try:
            code = child.wait()
        finally:
            _SIGTERM.child = None
    _SIGTERM.check()  # the stage was stopped by (or ran to its end despite) a SIGTERM: stop here
    if code == 0:
        return
    lines = log_file.read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    if code == 2 and errors:
        raise UserInputError(f"{errors[-1][len('error: '):]} (stage output: {log_file})")
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    raise StageProcessFailed(f"stage failed (exit {code}): python -m iprox_lightning.cli {' '.join(args)}; its last "
                             f"line: {last[:500]} (its whole output, the traceback included: {log_file})")


class StageProcessFailed(UserError, RuntimeError):
    """A stage run in its own processes failed: one line with its last line of output and the log holding the rest
    (the stage's own traceback is in the log; the pipeline's would say nothing more)."""


@dataclass(frozen=True)
class _StageRunner:
    """Runs the stages of one pipeline run (:meth:`run`) and holds what they share: the stage configs, the ledger of
    fingerprints, the seconds per stage (``<workdir>/seconds_per_stage.json``) and the trainer settings."""

    wd: Path
    cfg_dir: Path
    demo: bool
    force: bool
    ledger: Any  # io.stages.StageLedger
    times: dict[str, float]
    run_lightning: Callable
    trainer: dict[str, Any]  # every stage's trainer settings
    fit_trainer: dict[str, Any]  # the training stages'
    logger: dict[str, Any]
    threads: int | None = None  # torch threads of a stage run in its own processes (OMP_NUM_THREADS)
    plan_overlays: dict | None = None  # pipeline --plan: {stage config: overlay merged into the stage's}

    def named_logger(self, name: str) -> dict[str, Any]:
        return {**self.logger, "init_args": {**self.logger["init_args"], "name": name}}

    def run(self, name: str, subcommand: str, overlay: dict, done: Path, tag: str | None = None,
            upstream: tuple = (), files: tuple = ()) -> None:
        """Run stage ``name`` (``python train.py <subcommand>`` with its configs and ``overlay``), or reuse ``done``
        when the stage's fingerprint matches."""

        ledger, times = self.ledger, self.times
        if self.plan_overlays and name in self.plan_overlays:  # pipeline --plan: the fit's levers for this stage
            overlay = merge_overlay(overlay, self.plan_overlays[name])
        key = f"{name}:{tag}" if tag else name
        configs = [self.cfg_dir / f"{name}.yaml"]
        if self.demo and (self.cfg_dir / "builtin" / f"{name}.yaml").exists():
            configs.append(self.cfg_dir / "builtin" / f"{name}.yaml")
        fp = ledger.prepare(key, configs, overlay, upstream=upstream, files=files)
        output = done if done.name == "scores.parquet" else done.parent  # what downstream stages read
        if ledger.reuse(key, done, output):
            log.info("stage %s: %s exists with fingerprint %s, reused", key, done, fp)
            print(f"[pipeline] {key}: reused ({done}, fingerprint {fp[:12]} matches)")
            if key in ledger.notes:
                print(f"[pipeline] {key}: note: {ledger.notes[key]}")
            return
        if key in ledger.notes:
            print(f"[pipeline] {key}: runs again: {ledger.notes[key]}")
        if done.name == "scores.parquet":  # start the scoring output fresh (force, or an upstream output changed)
            if self.force or (key in ledger.notes and key not in ledger.partial):  # a partial one resumes its shards
                clear_output(done.parent)
        configs.append(_write_overlay(self.wd / "configs" / f"{key.replace(':', '_')}.yaml", overlay))
        args = [subcommand] + [a for c in configs for a in ("--config", str(c))]
        log.info("stage %s: python train.py %s", key, " ".join(args))
        ledger.start(key)  # a fault from here to its record leaves the stage marked partial: the next run redoes it
        t0 = time.perf_counter()
        with activity(f"{key}: {subcommand} {configs[0].name}"):  # a line at least every interval, loops or not
            if _processes(self.trainer) > 1:  # its own processes: Lightning's launcher re-runs the command it was given
                _run_stage_process(args, self.wd / "logs" / f"{key.replace(':', '_')}.out", self.threads)
            else:
                with quiet_stage(), _device_memory_peak(self.wd / PEAK_MEMORY_FILE, key):  # the one line below
                    self.run_lightning(args)
        ledger.record(key, output)
        _SIGTERM.check()  # a SIGTERM the stage's Lightning run received but ran to its end: stop after its record
        self.took(key, time.perf_counter() - t0)
        print(f"[pipeline] {key}: {subcommand} {configs[0].name}, {times[key]:.1f} s -> {output}", flush=True)
        touch()

    def took(self, key: str, seconds: float) -> None:
        """Record that stage ``key`` took ``seconds`` (in :attr:`times` and ``<workdir>/seconds_per_stage.json``, written
        at once: every stage the summary shows, the last one, ``evaluate``, included)."""

        self.times[key] = seconds
        write_json(self.wd / "seconds_per_stage.json", self.times)


def _read_numbers(path: Path) -> dict[str, float]:
    """A ``{stage: number}`` record of the workdir (seconds per stage, peak memory), read with its checks; a
    damaged one is refused naming the file (remove it: the numbers are recorded afresh)."""

    data = read_json(path, what="the pipeline's numbers per stage", fix="remove it: the numbers are recorded afresh")
    fields = Fields(path)
    for k, v in data.items():
        fields.check(k, v, "number", minimum=0)
    return data


PEAK_MEMORY_FILE = "peak_device_memory_per_stage.json"
"""``{stage: peak bytes allocated on the CUDA device}`` of the stages run in the pipeline's own process on a GPU."""


@contextlib.contextmanager
def _device_memory_peak(path: Path, key: str):
    """Record the stage's peak CUDA memory (``torch.cuda.max_memory_allocated`` since the stage began) in ``path``;
    nothing on a machine without CUDA (a CPU process's peak RSS cannot be told apart per stage)."""

    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        peaks = _read_numbers(path) if path.exists() else {}
        peaks[key] = int(torch.cuda.max_memory_allocated())
        write_json(path, peaks)


def _stage_runner(wd: Path, config_dir, demo: bool, force: bool, sources: dict, hardware: dict,
                  run_lightning, threads: int | None = None, plan_overlays: dict | None = None) -> _StageRunner:
    """The stage configs (checked), the seconds of earlier runs (none with ``force``), the trainer settings and the
    stage ledger of a pipeline run in ``wd``."""
    cfg_dir = Path(config_dir) if config_dir else DEFAULT_CONFIG_DIR
    if not (cfg_dir / "warmup.yaml").exists():
        raise InputNotFoundError(f"stage configs not found in {cfg_dir} (pass --config_dir)")
    times_path = wd / "seconds_per_stage.json"
    times: dict[str, float] = _read_numbers(times_path) if times_path.exists() and not force else {}
    # one line per stage (below): no model summary, and progress bars only on a terminal
    # absolute log/root paths: TensorBoard's writer thread opens its events file by the path it was given, later, from
    # whatever the working directory is then (a relative one failed mid-run on SmolLM2: FileNotFoundError)
    trainer_common = {**hardware, "default_root_dir": str(wd.resolve() / "lightning"),
                      "enable_model_summary": False, "enable_progress_bar": console.interactive()}
    # training stages log every step: a small run (a few batches: a sample, a 5% selection) then logs at all, without
    # Lightning's warning that its batches are fewer than the logging interval
    fit_common = {**trainer_common, "log_every_n_steps": 1}
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(wd.resolve() / "logs")}}

    # a stage's output is reused only when its fingerprint (configs, overlay, sources, upstream stages) matches;
    # an eval:<dir>[:suites] validation source is identified by its directory and suites
    for k, v in sources.items():
        if isinstance(v, str) and (parsed := parse_eval_source(v)):
            sources[k] = {"eval": parsed[0], "suites": list(parsed[1])}
    ledger = StageLedger(wd, sources, force=force)
    return _StageRunner(wd, cfg_dir, demo, force, ledger, times, run_lightning, trainer_common, fit_common, logger,
                        threads, plan_overlays)

