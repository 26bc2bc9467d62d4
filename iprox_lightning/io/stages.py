"""Pipeline stage records: a stage's output is reused only when its fingerprint matches.

Each stage's fingerprint is a digest of everything it was run from: the contents of its config files,
the generated overlay (paths, sparsity, method, seed, ...), the identity of the run's sources (target
model, pool, validation set: :func:`~iprox_lightning.io.fingerprint.source_identity`), the fingerprints of
the stages it reads, and the identity of any input file (e.g. the selection a fine-tune trains on). It is
written to ``<workdir>/stages/<stage>.json`` after the stage succeeds, with content digests (sizes + SHA-256 of
the files) of the stage's own output and of the outputs of the stages it read.

On the next run a stage whose output exists is reused when the fingerprints match; otherwise the
pipeline stops with :class:`~iprox_lightning.io.fingerprint.FingerprintMismatch` listing what differs
(``--force true`` re-runs, or use a new ``--workdir``). An output without a record (an older workdir, or
one written by hand) is refused the same way: its provenance is unknown. An output replaced by hand after it was
recorded is used as it is, and the stages that read it run again (the output digests they recorded differ).

A stage that starts writing first marks itself running (``<workdir>/stages/<stage>.running``, removed once its record
is written) and drops its old record. A run stopped by a fault (a full disk, a killed process) before the record was
written leaves that mark: on the next run the stage's output is known to be partial and the stage runs again from its
last safe point (a fine-tune or proxy from its start, overwriting the files it writes; a scoring run from its shards),
instead of being refused as an output of unknown provenance. Nothing is deleted for it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .fingerprint import FingerprintMismatch, diff, digest, file_identity, source_identity
from .jsonfile import read_json
from .scores import read_settings, write_json_atomic

STAGES_DIR = "stages"

RESULT_NEUTRAL_TRAINER = ("enable_progress_bar", "enable_model_summary", "log_every_n_steps", "logger",
                          "default_root_dir", "enable_checkpointing")
"""Trainer settings of a stage's overlay that change how a run looks or where its logs go, never what it computes:
left out of the fingerprint, so a run started under ``tee``/``nohup`` resumes in a terminal and the reverse."""


def result_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` without the :data:`RESULT_NEUTRAL_TRAINER` settings of its overlay (what the fingerprint digests)."""
    out = json.loads(json.dumps(inputs, default=str))
    trainer = (out.get("overlay") or {}).get("trainer")
    if isinstance(trainer, dict):
        for k in RESULT_NEUTRAL_TRAINER:
            trainer.pop(k, None)
    return out


def sources_identity(sources: Mapping[str, Any]) -> dict[str, Any]:
    """Identity of the pipeline's named sources. A value ``{"eval": <dir>, "suites": [...]}`` (an
    ``eval:<dir>[:suites]`` source, parsed by the caller) is identified by its directory and suites."""
    out = {}
    for k, v in sources.items():
        if isinstance(v, Mapping) and set(v) == {"eval", "suites"}:
            out[k] = {"eval": source_identity(v["eval"]), "suites": list(v["suites"])}
        else:
            out[k] = source_identity(v)
    return out


def output_identity(path: str | os.PathLike, known: Mapping[str, Any] | None = None) -> dict[str, dict]:
    """``{file: {"size", "sha256", "stat"}}`` of a stage's output (one file, or every file below a directory but
    hidden ones). A file whose size, mtime, ctime and inode equal those recorded in ``known`` (``"stat"``) keeps
    its recorded SHA-256 instead of being read again (ctime cannot be set back by hand)."""
    p = Path(path)
    if p.is_file():
        files = [(p.name, p)]
    elif p.is_dir():
        files = [(str(f.relative_to(p)), f) for f in sorted(p.rglob("*"))
                 if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)]
    else:
        return {}
    out = {}
    for rel, f in files:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        old = (known or {}).get(rel)
        if isinstance(old, Mapping) and old.get("stat") == stamp and old.get("sha256"):
            out[rel] = dict(old)
        else:
            out[rel] = {"size": st.st_size, "sha256": file_identity(f, hash_limit=None)["sha256"], "stat": stamp}
    return out


def _content(identity: Mapping[str, Mapping]) -> dict[str, str]:
    """The content part of :func:`output_identity`: ``{file: sha256}``."""
    return {rel: v.get("sha256") for rel, v in identity.items()}


class StageLedger:
    """Decides, per stage, between reuse and run, and records what each run was made from.

    Besides its inputs, each record holds a content digest of the stage's output (:func:`output_identity`) and of
    the outputs of the stages it read (``upstream_outputs``). An output replaced by hand (or re-made differently) is
    therefore used as it is, and every stage that read the old one runs again (:attr:`notes` says why) instead of
    being reused; a difference in the inputs still stops the pipeline."""

    def __init__(self, workdir: str | os.PathLike, sources: Mapping[str, Any], *, force: bool = False,
                 hint: str = "re-run with --force true to recompute (overwrites the stage outputs), or use a new --workdir"):
        self.dir = Path(workdir) / STAGES_DIR
        self.sources = sources_identity(sources)
        self.force = force
        self.hint = hint
        self.inputs: dict[str, dict] = {}
        self.fingerprints: dict[str, str] = {}
        self.status: dict[str, str] = {}
        self.outputs: dict[str, dict] = {}  # stage -> output_identity of its output now
        self.output_paths: dict[str, Path] = {}  # stage -> its output (file or directory)
        self.upstream: dict[str, tuple] = {}  # stage -> the stages it reads
        self.notes: dict[str, str] = {}  # stage -> why it runs again / what changed in its output
        self.recorded: dict[str, str] = {}  # reused stage -> the fingerprint its record holds
        self.partial: set[str] = set()  # stages whose last run was stopped before its record (:meth:`start`)

    def record_path(self, key: str) -> Path:
        return self.dir / f"{key.replace(':', '_')}.json"

    def running_path(self, key: str) -> Path:
        """The mark of stage ``key`` while it writes its output (a record path ends in ``.json``, this never does)."""
        return self.dir / f"{key.replace(':', '_')}.running"

    def start(self, key: str) -> Path:
        """Mark stage ``key`` running before it writes its output, then drop its old record (which no longer
        describes the output once it is being rewritten): a fault before :meth:`record` leaves the mark, and the next
        run redoes the stage (:meth:`reuse`). The mark is written first, so a fault while writing it changes nothing."""
        output = self.output_paths.get(key)
        path = write_json_atomic(self.running_path(key), {
            "stage": key, "fingerprint": self.fingerprints.get(key), "output": None if output is None else str(output),
            "pid": os.getpid()})
        self.record_path(key).unlink(missing_ok=True)
        return path

    def prepare(self, key: str, configs: Sequence[str | os.PathLike], overlay: Mapping, *,
                upstream: Iterable[str] = (), files: Iterable[str | os.PathLike] = ()) -> str:
        """Compute and remember the fingerprint of stage ``key``; returns it."""
        inputs = {
            "configs": {f"{Path(c).parent.name}/{Path(c).name}": file_identity(c).get("sha256") for c in configs},
            "overlay": json.loads(json.dumps(overlay, default=str)),
            "sources": self.sources,
            "upstream": {u: self.fingerprints.get(u) for u in upstream},
            "files": {str(f): file_identity(f) if Path(f).is_file() else None for f in files},
        }
        self.upstream[key] = tuple(upstream)
        self.inputs[key] = result_inputs(inputs)
        self.fingerprints[key] = digest(self.inputs[key])
        return self.fingerprints[key]

    def reuse(self, key: str, done: str | os.PathLike, output: str | os.PathLike | None = None) -> bool:
        """``True``: reuse the existing output; ``False``: run the stage (also when the only difference is the
        output of an upstream stage, :attr:`notes` says which). Raises on any other mismatch. ``output``: the
        stage's output (file or directory; default ``done``'s directory) whose content digest downstream stages
        depend on."""
        done = Path(done)
        self.output_paths[key] = Path(output) if output is not None else done.parent
        if self.force or not done.exists():
            self.status[key] = "ran"
            return False
        running = self.running_path(key)
        if running.exists():  # a run of this stage was stopped before its record: its output is partial
            self.status[key] = "ran"
            self.partial.add(key)
            self.notes[key] = (f"its last run stopped before it finished ({running} marks it), so {self.output_paths[key]} "
                               "is partial; it runs again from its last safe point")
            return False
        rec_path = self.record_path(key)
        if not rec_path.exists():
            raise FingerprintMismatch(
                f"stage {key}: {done} exists but {rec_path} does not record what produced it (an older or hand-made "
                f"output), so it cannot be reused safely; {self.hint}")
        rec = self.read_record(key, done)
        if rec.get("fingerprint") != self.fingerprints[key] and not self._same_result_inputs(key, rec):
            old, now = result_inputs(rec.get("inputs", {})), self.inputs[key]
            lines = diff(old, now)
            if [k for k in set(old) | set(now) if old.get(k) != now.get(k)] == ["files"]:
                # only an input file another stage wrote (the selection a fine-tune reads) changed: run again
                self.status[key] = "ran"
                self.notes[key] = "an input file changed: " + "; ".join(lines)
                return False
            raise FingerprintMismatch(
                f"stage {key}: {done} was produced from different inputs (fingerprint {rec.get('fingerprint')} -> "
                f"{self.fingerprints[key]}); refusing to reuse it. What differs (previous -> now):\n  "
                + "\n  ".join(lines or ["(no field listed)"]) + f"\n{self.hint}")
        read = rec.get("upstream_outputs")  # absent in records written before output digests existed
        if isinstance(read, Mapping):
            now = self._upstream_outputs(key)
            if read != now:  # an upstream output was replaced or re-made since this stage read it: run again
                self.status[key] = "ran"
                self.notes[key] = "the output of a stage it reads changed: " + "; ".join(
                    diff({"upstream_outputs": read}, {"upstream_outputs": now}))
                return False
        self.status[key] = "reused"
        self.recorded[key] = rec.get("fingerprint")
        recorded = rec.get("output")
        self.outputs[key] = output_identity(self.output_paths[key], recorded if isinstance(recorded, Mapping) else None)
        if isinstance(recorded, Mapping) and _content(recorded) != _content(self.outputs[key]):
            self.notes[key] = ("its output changed since it was recorded (used as it is now): "
                               + "; ".join(diff(_content(recorded), _content(self.outputs[key]))))
        return True

    def _same_result_inputs(self, key: str, rec: Mapping) -> bool:
        """A record written before the fingerprint left out :data:`RESULT_NEUTRAL_TRAINER` (or upstream of one): the
        same inputs but for those settings, its upstream stages the records reused now."""
        old, now = result_inputs(rec.get("inputs", {})), dict(self.inputs[key])
        now["upstream"] = {u: self.recorded.get(u, f) for u, f in now.get("upstream", {}).items()}
        return old == now

    def read_record(self, key: str, done: str | os.PathLike) -> dict:
        """The record of stage ``key``; an unreadable one (cut short, not a JSON object) is refused like a missing
        one: what produced ``done`` is unknown."""
        rec_path = self.record_path(key)

        class Unreadable(Exception):
            pass

        try:
            rec = read_json(rec_path, error=Unreadable, what="stage record", object_=False, fix="")
        except Unreadable as e:
            raise FingerprintMismatch(f"stage {key}: {e}, so what produced {done} is unknown and it cannot be reused "
                                      f"safely; {self.hint}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("inputs", {}), dict):
            raise FingerprintMismatch(f"stage {key}: {rec_path} is not a stage record (a JSON object with "
                                      f"'fingerprint' and 'inputs'); {self.hint}")
        return rec

    def record(self, key: str, output: str | os.PathLike | None = None) -> Path:
        """Write the record of stage ``key`` (after it succeeded), with the content digest of its ``output``
        (default: the one :meth:`reuse` was told)."""
        rec = {"stage": key, "fingerprint": self.fingerprints[key], "inputs": self.inputs[key],
               "upstream_outputs": self._upstream_outputs(key)}
        output = output if output is not None else self.output_paths.get(key)
        if output is not None:
            self.outputs[key] = rec["output"] = output_identity(output)
        path = write_json_atomic(self.record_path(key), rec)
        self.running_path(key).unlink(missing_ok=True)  # finished: the output is whole
        return path

    def _upstream_outputs(self, key: str) -> dict[str, dict[str, str]]:
        """``{upstream stage: {file: sha256}}``: the current outputs of the stages ``key`` reads."""
        return {u: _content(self.outputs.get(u, {})) for u in self.upstream.get(key, ())}

    def summary(self) -> dict[str, dict[str, str]]:
        """``{stage: {"status": "ran" | "reused", "fingerprint": ...}}`` in run order."""
        return {k: {"status": self.status.get(k, "ran"), "fingerprint": fp} for k, fp in self.fingerprints.items()}


def format_stages(stages: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Summary lines: which stages were reused (with fingerprints) and which ran."""
    reused = [f"{k} ({v['fingerprint'][:12]})" for k, v in stages.items() if v.get("status") == "reused"]
    ran = [k for k, v in stages.items() if v.get("status") != "reused"]
    lines = []
    if reused:
        lines.append("stages reused     : " + ", ".join(reused) + " (fingerprints match)")
    if ran:
        lines.append("stages run        : " + ", ".join(ran))
    return lines


def pipeline_provenance(ledger: StageLedger, *, method: str, sparsity: float,
                        score_dirs: Mapping[str, str | os.PathLike], proxy_validation: str = "target") -> dict[str, Any]:
    """The pipeline summary's provenance fields: method, ρ, whose validation gradients the proxy scored against,
    each stage's status and fingerprint, and the examples the scoring stages dropped (no response token left after
    truncation), from their settings."""
    dropped = {}
    for who, d in score_dirs.items():
        data = read_settings(d).get("data") or {}
        dropped[who] = {split: {"dropped": v.get("dropped", 0), "dropped_ids": v.get("dropped_ids", [])[:20],
                                "max_length": v.get("max_length"), "truncation": v.get("truncation")}
                        for split, v in data.items()}
    return {"method": method, "sparsity": sparsity, "proxy_validation": proxy_validation, "stages": ledger.summary(),
            "truncation_dropped": dropped}


def format_provenance(s: Mapping[str, Any]) -> list[str]:
    """Summary lines for :func:`pipeline_provenance`'s fields."""
    lines = [f"method / sparsity : {s.get('method')} / rho = {s.get('sparsity')}"]
    if s.get("proxy_validation"):
        lines.append(f"proxy validation  : the {s['proxy_validation']}'s validation gradients")
    lines += format_stages(s.get("stages", {}))
    drops = s.get("truncation_dropped") or {}
    parts = []
    for who, splits in drops.items():
        for split, v in splits.items():
            if v.get("dropped"):
                parts.append(f"{who} {split} {v['dropped']} (e.g. {', '.join(v['dropped_ids'][:3])})")
    if parts:
        lines.append("dropped by truncation (no response token left): " + "; ".join(parts))
    return lines
