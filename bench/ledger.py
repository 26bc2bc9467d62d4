"""The benchmarks' stage ledger: each stage is a ``python train.py ...`` command, run as a subprocess one at a time
and recorded in ``OUT/state.json``; it is skipped when its output exists and its fingerprint (the JSON of its settings)
matches the recorded one (up to :func:`canonical_fingerprint`), so an interrupted run resumes.

Not :mod:`iprox_lightning.io.stages`: that ledger fingerprints other inputs (config file digests, source identities,
output digests, one record file per stage), and the recorded benchmark results (``bench/results/*/state.json``) hold
hours of finished stages under these fingerprints; switching would re-run them all.
"""
from __future__ import annotations

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
    settings (``PRESENTATION_KEYS``) dropped: editing a comment or the logger of a shipped config does not re-run a
    stage; any other change of the config does."""
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
        return x
    return json.dumps(norm(json.loads(fp)), sort_keys=True)


class Stages:
    """Runs ``python train.py ...`` stages one at a time and records them in ``OUT/state.json``."""

    def __init__(self, out: Path, threads: int | None, log: Callable[[str], None], dry_run: bool = False):
        self.out, self.threads, self.log, self.dry_run = out, threads, log, dry_run
        self.path = out / "state.json"
        self.state = json.loads(self.path.read_text()) if self.path.exists() else {"stages": {}}
        self.ran: list[str] = []  # stages run (or, in a dry run, that would run) by this process

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.path)

    def run(self, key: str, subcommand: str, configs: list[Path], overlay: dict, fingerprint: dict,
            done: Path, clean: Path | None = None) -> dict:
        rec = self.state["stages"].get(key)
        fp = json.dumps(fingerprint, sort_keys=True)
        if done.exists() and rec is not None and (rec.get("fingerprint") == fp or canonical_fingerprint(
                rec["fingerprint"]) == canonical_fingerprint(fp)):
            return rec  # (the stored record: stages downstream were fingerprinted with it)
        self.ran.append(key)
        if self.dry_run:
            self.log(f"stage {key}: would run")
            return {}
        if done.exists() or (clean is not None and clean.exists()):
            why = "no record" if rec is None else "settings changed"
            self.log(f"stage {key}: existing output from another setting ({why}): removing {clean or done}")
            target = clean or done
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        ov = self.out / "configs" / f"{dir_name(key)}.yaml"
        ov.parent.mkdir(parents=True, exist_ok=True)
        ov.write_text(yaml.safe_dump(overlay, sort_keys=False))
        args = [subcommand] + [a for c in [*configs, ov] for a in ("--config", str(c))]
        cmd = [sys.executable, "train.py", *args]
        printable = "python train.py " + " ".join(shlex.quote(str(a)) for a in args)
        self.log(f"stage {key}: {printable}")
        env = dict(os.environ)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        logf = self.out / "logs" / f"{dir_name(key)}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        with open(logf, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            tail = logf.read_text()[-3000:]
            raise RuntimeError(f"stage {key} failed (exit {proc.returncode}); log {logf}:\n{tail}")
        if not done.exists():
            raise RuntimeError(f"stage {key} finished but {done} is missing; log {logf}")
        # a re-run whose settings equal the record's up to outcome-neutral lines (a re-made output, e.g. a proxy
        # whose weights were not kept) keeps the recorded fingerprint text: downstream stages embed it, and a new
        # text would re-run them although nothing they depend on changed
        same = rec is not None and canonical_fingerprint(rec["fingerprint"]) == canonical_fingerprint(fp)
        rec = {"fingerprint": rec["fingerprint"] if same else fp, "command": printable, "wall_s": wall,
               "cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
               "peak_rss_mib": ru1.ru_maxrss / 1024, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
               "commit": git_commit(dirty=True),
               "load_average": os.getloadavg()[0]}
        self.state["stages"][key] = rec
        self.save()
        self.log(f"stage {key}: done in {wall:.0f}s (CPU {rec['cpu_s']:.0f}s)")
        return rec


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
