"""Check every evaluation input before any prompt is built (fails in the first second).

:func:`check_inputs` resolves each suite's files from the data module's options and returns
``(suites to run, {skipped suite: reason})``:

* MMLU: ``<path>/dev`` and ``<path>/<split>`` must exist, and the requested subjects must have
  both a dev and a ``<split>`` CSV;
* BBH: ``<path>`` and ``<path>/cot-prompts`` must exist, and the requested tasks both files; without
  ``tasks`` every task must be complete (a partial folder is an error listing the missing files, unless
  ``bbh.allow_partial``: then the complete tasks run and the skipped ones are recorded in the metrics);
* TyDiQA: ``eval_file`` (default ``<path>/tydiqa-goldp-v1.1-dev.json``, the public GoldP dev set,
  not shipped here) and, with shots, ``shots_file`` (default ``<path>/tydiqa-one-shot.json``).
  When ``eval_file`` is *not set* and the GoldP file is absent the suite is **skipped** (one line);
  an ``eval_file`` that is set but missing is an error.

Relative ``eval_file`` / ``shots_file`` names resolve against the suite folder first (so
``tydiqa.eval_file: tydiqa-one-shot.json`` works from any directory), then the working directory.
A missing input raises ``FileNotFoundError`` naming the file and the option that points to it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..data.eval_readers import EvalDataError, bbh_dropped_tasks
from ..errors import InputNotFoundError

GOLDP_DEV = "tydiqa-goldp-v1.1-dev.json"
ONE_SHOT = "tydiqa-one-shot.json"


def suite_root(name: str, cfg: Any, data_dir: Optional[str]) -> Path:
    return Path(cfg.path) if getattr(cfg, "path", None) else Path(data_dir or ".") / name


def resolve_in(root: Path, name: str | None, default: str) -> Path:
    """``name`` (or ``default``) resolved against ``root``, then the working directory."""
    if not name:
        return root / default
    p = Path(name)
    if p.is_absolute():
        return p
    return root / p if (root / p).exists() or not p.exists() else p


def _need(path: Path, option: str, kind: str = "file") -> None:
    ok = path.is_dir() if kind == "directory" else path.is_file()
    if not ok:
        raise InputNotFoundError(f"evaluation input not found: {path} ({kind}; set by {option})")


def check_inputs(suites: list[str], configs: dict[str, Any], data_dir: Optional[str]) -> tuple[list[str], dict[str, str]]:
    """See the module doc. Returns the suites to run and the skipped ones with the reason."""
    run, skipped = [], {}
    for name in suites:
        cfg = configs[name]
        root = suite_root(name, cfg, data_dir)
        where = f"{name}.path" if getattr(cfg, "path", None) else "data_dir"
        if name == "mmlu":
            for sub in ("dev", cfg.split):
                _need(root / sub, where, "directory")
            for s in cfg.subjects or []:
                for sub in (cfg.split, "dev"):
                    _need(root / sub / f"{s}_{sub}.csv", "mmlu.subjects")
        elif name == "bbh":
            _need(root, where, "directory")
            _need(root / "cot-prompts", where, "directory")
            for t in cfg.tasks or []:
                _need(root / f"{t}.json", "bbh.tasks")
                _need(root / "cot-prompts" / f"{t}.txt", "bbh.tasks")
            if not cfg.tasks:
                missing = bbh_dropped_tasks(root)
                if missing and not getattr(cfg, "allow_partial", False):
                    raise EvalDataError(
                        f"{root}: partial BBH directory, {len(missing)} task(s) incomplete: " + "; ".join(missing[:10])
                        + (f"; ... and {len(missing) - 10} more" if len(missing) > 10 else "")
                        + " (restore the files, name the tasks with bbh.tasks, or set bbh.allow_partial: true — "
                        "--data.bbh.allow_partial true — to evaluate the complete tasks only; the skipped ones are "
                        "recorded in the metrics)")
        elif name == "tydiqa":
            eval_path = resolve_in(root, cfg.eval_file, GOLDP_DEV)
            if not eval_path.is_file():
                if cfg.eval_file:
                    raise InputNotFoundError(f"evaluation input not found: {eval_path} (set by tydiqa.eval_file; "
                                             f"relative names are looked up in {root} first)")
                skipped[name] = (f"{eval_path} not found (the GoldP dev set is not shipped); set "
                                 f"tydiqa.eval_file: {ONE_SHOT} for the 9-question smoke set")
                continue
            if cfg.shots > 0:
                _need(resolve_in(root, cfg.shots_file, ONE_SHOT), "tydiqa.shots_file")
        run.append(name)
    return run, skipped
