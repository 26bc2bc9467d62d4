"""The benchmarks' stage ledger: each stage is a ``python train.py ...`` command, run as a subprocess one at a time
(``in_process``, the benchmarks' ``--in-process``: the same command line in this process, for the tests) and recorded
in ``OUT/state.json``; it is skipped when its output exists and its fingerprint (the JSON of its settings)
matches the recorded one (up to :func:`canonical_fingerprint`), so an interrupted run resumes.

Not :mod:`iprox_lightning.io.stages`: that ledger fingerprints other inputs (config file digests, source identities,
output digests, one record file per stage), and the recorded benchmark results (``bench/results/*/state.json``) hold
hours of finished stages under these fingerprints; switching would re-run them all.
"""
from __future__ import annotations

import gzip
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from variants import dir_name  # bench/: a stage's file names

ROOT = Path(__file__).resolve().parents[1]

# trainer options that change what a run writes or prints, never what it computes: a config line setting one of them
# does not enter a stage's fingerprint, so adding it does not make finished stages stale (e.g. warm-up: 47 min)
OUTCOME_NEUTRAL = ("enable_checkpointing", "enable_progress_bar", "enable_model_summary")


def config_text(path) -> str:
    """A stage config's text for a fingerprint: the file without lines that set an :data:`OUTCOME_NEUTRAL` option."""
    lines = Path(path).read_text().splitlines(keepends=True)
    return "".join(x for x in lines if x.split(":", 1)[0].strip() not in OUTCOME_NEUTRAL)


# trainer settings that change where a stage logs or how it looks, never what it computes
PRESENTATION_KEYS = ("logger", "default_root_dir", "log_every_n_steps", "enable_progress_bar", "enable_model_summary")


def canonical_fingerprint(fp: str) -> str:
    """``fp`` (a stage fingerprint, JSON) with every ``config`` text parsed as YAML and its trainer's presentation
    settings (``PRESENTATION_KEYS``) dropped, and every absolute path that exists resolved (a model reached through a
    symlink is the same model): editing a comment or the logger of a shipped config does not re-run a stage; any
    other change of the config does."""
    def norm(x: Any) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if k == "config" and isinstance(v, str):
                    v = yaml.safe_load(v) or {}
                    if isinstance(v.get("trainer"), dict):
                        v["trainer"] = {tk: tv for tk, tv in v["trainer"].items() if tk not in PRESENTATION_KEYS}
                out[k] = norm(v)
            return out
        if isinstance(x, list):
            return [norm(v) for v in x]
        if isinstance(x, str) and x.startswith("/") and os.path.exists(x):
            return os.path.realpath(x)  # the same file through a link or another spelling is the same input
        return x
    return json.dumps(norm(json.loads(fp)), sort_keys=True)


def same_settings(recorded: str | None, fp: str) -> bool:
    """Whether a recorded stage fingerprint and ``fp`` (JSON) are the same settings, up to outcome-neutral lines
    (:func:`canonical_fingerprint`): what decides that a recorded stage stands."""
    return recorded is not None and (recorded == fp or canonical_fingerprint(recorded) == canonical_fingerprint(fp))


LOCAL_SUFFIXES = (".gguf", ".jsonl", ".json", ".parquet", ".arrow", ".csv", ".safetensors")


def check_local_inputs(ap, args, names=("model", "pool", "eval_dir")) -> None:
    """Refuse (``ap.error``, naming the option) a ``--model`` / ``--pool`` / ``--eval-dir`` that is meant as a local
    path -- absolute, relative with ``./``, or a file name with a data/model suffix -- and does not exist, before any
    stage runs (a default under ``../shared`` seen from another checkout, a typo). Hub ids and ``builtin`` pass."""
    for name in names:
        value = getattr(args, name, None)
        if not isinstance(value, str) or value == "builtin":
            continue
        local = value.startswith(("/", "./", "../", "~")) or value.endswith(LOCAL_SUFFIXES)
        if local and not Path(value).expanduser().exists():
            ap.error(f"--{name.replace('_', '-')} {value}: no such file or directory (the defaults are under "
                     f"{ROOT.parent / 'shared'}; pass the path)")


def _merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s entries, nested dicts merged (a stage's overlay and its resumption's)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _remove(path: Path) -> None:
    """Delete a stage output, a directory or a file."""
    shutil.rmtree(path) if path.is_dir() else path.unlink()


class StageNotRun(RuntimeError):
    """A read-only :class:`Stages` (``--summary-only``) was asked for a stage that has not run with these settings."""


def kept(path: Path) -> Path:
    """Where a result's JSON is kept: ``path``, or ``path.gz`` when that exists (the large ledgers and summaries under
    ``bench/results`` are kept gzipped; a run writes plain JSON where it finds none)."""
    gz = Path(f"{path}.gz")
    return gz if gz.exists() and not Path(path).exists() else Path(path)


def read_kept(path: Path) -> Any:
    """The JSON at ``path`` (or at ``path.gz``: :func:`kept`)."""
    p = kept(path)
    return json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text())


def write_kept(path: Path, obj: Any) -> Path:
    """Write ``obj`` to ``path`` atomically, in the form it is kept in (gzipped, reproducibly, where ``path.gz`` is
    what exists); returns the file written."""
    p = kept(path)
    text = json.dumps(obj, indent=1)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_bytes(gzip.compress(text.encode(), mtime=0) if p.suffix == ".gz" else text.encode())
    os.replace(tmp, p)
    return p


class Stages:
    """Runs ``python train.py ...`` stages one at a time and records them in ``OUT/state.json``."""

    def __init__(self, out: Path, threads: int | None, log: Callable[[str], None], dry_run: bool = False,
                 in_process: bool = False, read_only: bool = False):
        self.out, self.threads, self.log, self.dry_run = out, threads, log, dry_run
        # read_only (a summary rewrite): never run a stage; a recorded stage with the same settings stands for its
        # output even where that output was deleted since (a gradient store, a fine-tuned model)
        self.read_only = read_only
        # in_process (the tests): each stage is the same command run by ``iprox_lightning.cli.main`` in this process
        # (no interpreter and Lightning import per stage); see :meth:`call_in_process`
        self.in_process = in_process
        self.path = out / "state.json"
        self.state = read_kept(self.path) if kept(self.path).exists() else {"stages": {}}
        self.ran: list[str] = []  # stages run (or, in a dry run, that would run) by this process

    def save(self) -> None:
        write_kept(self.path, self.state)

    def recorded(self, key: str, fingerprint: dict) -> dict | None:
        """Stage ``key``'s record when it ran with these settings (:func:`same_settings`), else None."""
        rec = self.state["stages"].get(key)
        ok = rec is not None and same_settings(rec.get("fingerprint"), json.dumps(fingerprint, sort_keys=True))
        return rec if ok else None

    def run(self, key: str, subcommand: str, configs: list[Path], overlay: dict, fingerprint: dict,
            done: Path, clean: Path | None = None, resume: Callable[[], dict] | None = None) -> dict:
        """Run stage ``key`` unless its record has these settings and ``done`` exists. ``resume`` (a stage whose
        command continues its own partial output: a score directory's writer skips the ids it holds, a fit restarts
        from its last checkpoint): a run of the same settings that did not finish (its ``pending`` mark in the
        state, written before the command starts) keeps its partial output, which is not set aside, and the command
        gets ``resume()``'s overlay too (e.g. ``ckpt_path``); the record lists the resumed attempts."""
        rec = self.state["stages"].get(key)
        fp = json.dumps(fingerprint, sort_keys=True)
        same = self.recorded(key, fingerprint) is not None
        if same and (done.exists() or self.read_only):
            # the stored record (stages downstream were fingerprinted with it); a read-only summary rewrite takes it
            # for an output deleted since
            return rec
        if self.read_only:
            why = "no record" if rec is None else "settings changed"
            raise StageNotRun(f"stage {key} has not run with these settings ({why}); a summary rewrite runs no stage: "
                              "run the command without --summary-only")
        self.ran.append(key)
        if self.dry_run:
            self.log(f"stage {key}: would run")
            return {}
        target = clean or done
        pending = self.state.setdefault("pending", {})
        resuming = resume is not None and not same and same_settings(pending.get(key, {}).get("fingerprint"), fp) \
            and target.exists()
        if resuming:
            overlay = _merged(overlay, resume())
            self.log(f"stage {key}: resuming the unfinished run of these settings in {target}")
        set_aside = self._set_aside(key, target, "no record" if rec is None else "settings changed") \
            if not resuming and (done.exists() or (clean is not None and clean.exists())) else None
        if resume is not None:
            attempts, walls = (pending[key]["attempts"], pending[key].get("walls", [])) if resuming else ([], [])
            pending[key] = {"fingerprint": fp, "attempts": [*attempts, time.strftime("%Y-%m-%d %H:%M:%S")],
                            "walls": walls}
            self.save()
        t0 = time.perf_counter()
        try:
            printable, wall, cpu_s, peak_rss = self._execute(key, subcommand, configs, overlay, done)
        except BaseException:  # a failure or Ctrl-C: the previous output comes back, whatever was half-written goes
            if resume is not None:  # the attempt's seconds, which a resumption's record adds up
                pending[key]["walls"].append(time.perf_counter() - t0)
                self.save()
            if set_aside is not None:
                if target.exists():
                    _remove(target)
                os.replace(set_aside, target)
                self.log(f"stage {key}: failed; the previous output is back at {target}")
            raise
        if set_aside is not None:
            _remove(set_aside)
        run = {"command": printable, "wall_s": wall, "cpu_s": cpu_s, "peak_rss_mib": peak_rss,
               "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(dirty=True),
               "load_average": os.getloadavg()[0]}
        run["host"] = host_info()  # where it ran: a summary rewritten elsewhere reports this, not its own machine
        if self.in_process:  # cpu_s and peak_rss_mib are this process's, not a stage process's
            run["in_process"] = True
        if same:
            # a re-run whose settings equal the record's up to outcome-neutral lines (a re-made output, e.g. a proxy
            # or warmed target whose weights were not kept) keeps the record, fingerprint text included (downstream
            # stages embed it, and a new text would re-run them although nothing they depend on changed), and adds
            # this run to its ``rebuilt`` list: the first run's host and seconds stay what the results cite
            rec = {**rec, "rebuilt": [*rec.get("rebuilt", []), run]}
        else:
            rec = {"fingerprint": fp, **run}
        if resume is not None and len(pending.get(key, {}).get("attempts", [])) > 1:
            rec["resumed"] = pending[key]["attempts"]  # this run's starts: the first, then each resumption
            rec["attempt_walls_s"] = [*pending[key].get("walls", []), wall]  # each attempt's seconds where known
        pending.pop(key, None)
        self.state["stages"][key] = rec
        self.save()
        self.log(f"stage {key}: done in {wall:.0f}s (CPU {cpu_s:.0f}s)")
        return rec

    def _set_aside(self, key: str, target: Path, why: str) -> Path:
        """Move a stage's old output aside (not deleted) until the new one exists: a stage that fails (a wrong path,
        an interrupted run) puts it back, so a mistyped argument never costs a finished warm-up."""
        set_aside = target.with_name(target.name + ".replaced")
        if set_aside.exists():
            _remove(set_aside)
        self.log(f"stage {key}: existing output from another setting ({why}): moved to {set_aside}, "
                 "deleted once this stage has finished")
        os.replace(target, set_aside)
        return set_aside

    def _execute(self, key: str, subcommand: str, configs: list[Path], overlay: dict,
                 done: Path) -> tuple[str, float, float, float]:
        """Write the stage's overlay and run ``python train.py SUBCOMMAND --config ...`` (a subprocess, or in this
        process); ``(printable command, wall seconds, CPU seconds, peak RSS MiB)``. Raises when it fails or
        leaves no ``done``."""
        ov = self.out / "configs" / f"{dir_name(key)}.yaml"
        ov.parent.mkdir(parents=True, exist_ok=True)
        ov.write_text(yaml.safe_dump(overlay, sort_keys=False))
        args = [subcommand] + [a for c in [*configs, ov] for a in ("--config", str(c))]
        printable = "python train.py " + " ".join(shlex.quote(str(a)) for a in args)
        self.log(f"stage {key}: {printable}")
        env = dict(os.environ)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        logf = self.out / "logs" / f"{dir_name(key)}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        who = resource.RUSAGE_SELF if self.in_process else resource.RUSAGE_CHILDREN
        ru0 = resource.getrusage(who)
        t0 = time.perf_counter()
        with open(logf, "w") as f:
            if self.in_process:
                returncode = self.call_in_process(args, f)
            else:
                returncode = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, stdout=f,
                                            stderr=subprocess.STDOUT, env=env).returncode
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(who)
        if returncode != 0:
            raise RuntimeError(f"stage {key} failed (exit {returncode}); log {logf}:\n{logf.read_text()[-3000:]}")
        if not done.exists():
            raise RuntimeError(f"stage {key} finished but {done} is missing; log {logf}")
        cpu_s = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        return printable, wall, cpu_s, ru1.ru_maxrss / 1024

    def call_in_process(self, args: list[str], log) -> int:
        """``python train.py ARGS`` as :meth:`run`'s subprocess runs it, in this process: from the checkout's root,
        ``--threads`` intra-op threads, its output in the stage's log; its exit status (an exception's traceback goes
        to the log, status 1). What a stage changes process-wide is put back afterwards: the working directory, the
        environment (Lightning's ``PL_GLOBAL_SEED``), the thread count, the random states and the warning filters."""
        import contextlib
        import random
        import traceback
        import warnings

        import numpy as np
        import torch

        from iprox_lightning.cli import main

        cwd, env, threads, argv = os.getcwd(), dict(os.environ), torch.get_num_threads(), sys.argv
        states = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), \
                    contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                os.chdir(ROOT)
                if self.threads:
                    torch.set_num_threads(self.threads)
                sys.argv = ["train.py", *args]  # main() reads the command line as train.py does (its one-line errors)
                try:
                    main()
                except SystemExit as e:  # jsonargparse's and the command line's errors (status 0: --help)
                    if e.code is None or isinstance(e.code, int):
                        return e.code or 0
                    print(e.code, file=log)  # what the interpreter prints for SystemExit("message")
                    return 1
                except Exception:
                    traceback.print_exc(file=log)
                    return 1
                return 0
        finally:
            sys.argv = argv
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(threads)
            random.setstate(states[0])
            np.random.set_state(states[1])


def attempts_wall(rec: dict) -> tuple[float | None, bool]:
    """``(seconds, complete)`` a stage's record took: its ``wall_s``, or for a run resumed over several attempts the
    sum of every attempt's seconds (``attempt_walls_s``). ``complete`` is False where an attempt's seconds were not
    recorded (an attempt killed outright, or one recorded before attempts were timed): then the seconds are the last
    attempt's, a lower bound."""
    wall = rec.get("wall_s")
    n = len(rec.get("resumed") or [])
    if wall is None or n < 2:
        return wall, True
    walls = rec.get("attempt_walls_s") or []
    return (float(sum(walls)), True) if len(walls) == n else (wall, False)


def host_info() -> dict:
    """The machine a stage runs on: architecture, CPU count, accelerator (the first CUDA device's name, or ``cpu``)
    and the versions of torch / transformers / lightning."""
    import importlib.metadata as im
    import platform

    import torch

    versions = {}
    for pkg in ("torch", "transformers", "lightning"):
        try:
            versions[pkg] = im.version(pkg)
        except im.PackageNotFoundError:
            versions[pkg] = None
    return {"machine": platform.machine(), "cpus": os.cpu_count(),
            "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "versions": versions}


def recorded_hosts(state: dict) -> list[dict]:
    """The distinct hosts the recorded stages ran on (``host_info`` of each stage record that has one), in the order
    first seen; ``[]`` for stages recorded before hosts were."""
    out: list[dict] = []
    for rec in state.get("stages", {}).values():
        h = rec.get("host")
        if h and h not in out:
            out.append(h)
    return out


def hosts_text(hosts: list[dict]) -> str:
    """One line for a summary's header: each host as ``accelerator (machine, N CPUs; torch V, transformers V)``."""
    if not hosts:
        return "hosts not recorded (stages from before the ledger recorded them)"
    return "; ".join(f"{h['accelerator']} ({h['machine']}, {h['cpus']} CPUs; "
                     + ", ".join(f"{k} {v}" for k, v in h["versions"].items() if v) + ")" for h in hosts)


def logger_overlay(out: Path, name: str) -> dict:
    return {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(out / "logs" / "tensorboard"), "name": name}}


def git_commit(dirty: bool = False) -> str:
    """Short HEAD commit of the checkout (``+dirty`` appended when ``dirty`` and tracked files differ)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        if dirty and subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0:
            head += "+dirty"
        return head
    except Exception:
        return "unknown"


def splice_docs(doc: Path, md: str, begin: str, end: str) -> None:
    """Replace the text between the generated-section markers ``begin`` … ``end`` of ``doc`` with ``md`` (the
    markers must exist)."""
    text = doc.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{doc}: markers {begin!r} … {end!r} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    body = md.split("\n", 1)[1] if md.startswith("# ") else md  # the page has its own heading
    doc.write_text(f"{head}{begin}\n{body.strip()}\n{end}{tail}")
