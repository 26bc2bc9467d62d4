"""A pipeline run's summary (``<workdir>/summary.json`` and the lines printed): proxy size, seconds per stage,
retention (pooled and per task), the selections explained, the fine-tuned effect, the artifacts and the next
command."""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis.retention import format_per_task, per_task_retention, per_task_scores, retention_metrics, worst_task
from ..data.synthetic import BUILTIN_VALIDATION_FAMILIES, oracle_share
from ..engine.target_layers import count_parameters
from ..evaluation.effect import format_effect
from ..io.proxy import read_manifest
from ..io.scores import read_table
from ..io.selection import read_meta
from ..io.stages import format_provenance
from ..models.loading import load_model
from ..selection.rules import rule_order
from ..selection.summary import format_selection


def _count_params(path: str) -> int:
    model, _ = load_model(path, tokenizer=False)
    return count_parameters(model)


def _artifacts(wd: Path, finetune: bool, tasks: list[str] | None = None) -> dict[str, str]:
    """What the pipeline leaves for the user, by what it is (every path exists when the summary is printed)."""
    out = {"warmed-up target": wd / "warmup" / "model", "proxy": wd / "proxy" / "model",
           "proxy's scores": wd / "scores" / "proxy" / "scores.parquet",
           "target's scores": wd / "scores" / "target" / "scores.parquet"}
    for task in tasks or [None]:
        name, label = ("proxy", "") if task is None else (f"proxy.{task}", f" ({task})")
        out[f"proxy's selection{label}"] = wd / "selected" / f"{name}.jsonl"
        if finetune:
            out[f"fine-tuned on it{label}"] = wd / "finetune" / name / "model"
    out.update({"summary": wd / "summary.json", "stage configs": wd / "configs"})
    return {k: str(v) for k, v in out.items()}


CHECK_SAMPLE = 64  # pool examples the next command's check scores on a real model (three models score each: minutes)


def _next_command(wd: Path, warm: Path, proxy: Path, pool, validation, data_args: dict,
                  proxy_validation: str = "target") -> str:
    """``train.py check`` of this run's proxy against its warmed-up target, on the same pool and validation sets, the
    proxy scored against the validation gradients this run's proxy selection used."""

    args = ["python", "train.py", "check", "--target", str(warm), "--proxy", str(proxy)]
    for flag, value in (("--pool", pool), ("--validation", validation)):
        if value != "builtin":
            args += [flag, value if isinstance(value, str) else json.dumps(value)]
    if pool != "builtin":  # a real model: the README recipe's sample (check's default, 200, on the demo)
        args += ["--sample", str(CHECK_SAMPLE)]
    for key in ("val_per_task", "max_length"):  # in the README's order
        if data_args.get(key):
            args += [f"--{key}", str(data_args[key])]
    if proxy_validation != "target":  # check's default for an IProX proxy is the target's
        args += ["--proxy_validation", proxy_validation]
    args += ["--output_dir", str(wd / "check")]
    return " ".join(shlex.quote(a) for a in args)


def rule_task_scores(path: str | Path, rule: str, tasks: list[str]) -> dict[str, dict[str, float]]:
    """``id -> {task: score}`` of a score table under a per-task rule: each task's value is what ranks that task's
    selection (e.g. ``max``: the max over the task's subtask columns)."""

    _, table = read_table(path)
    ids = [str(i) for i in table.column("id").to_pylist()]
    columns = {c: np.asarray([np.nan if v is None else float(v) for v in table.column(c).to_pylist()], np.float64)
               for c in table.column_names if c.startswith("score/")}
    values = {task: rule_order(rule, ids, columns, task)[1] for task in tasks}
    return {i: {task: float(values[task][j]) for task in tasks} for j, i in enumerate(ids)}


def _per_task(wd, rule: str | None = None, tasks: list[str] | None = None) -> dict[str, Any]:
    """Proxy vs target per validation task (the score tables' ``score/<task>`` columns, or with a per-task rule each
    task's ranking under it, :func:`rule_task_scores`; lengths = the target table's response tokens):
    :func:`~iprox_lightning.analysis.retention.per_task_retention` and its worst task."""

    target = wd / "scores" / "target" / "scores.parquet"
    proxy = wd / "scores" / "proxy" / "scores.parquet"
    _, table = read_table(target)
    lengths = dict(zip(map(str, table.column("id").to_pylist()), map(float, table.column("n_tokens").to_pylist())))
    scores = (lambda p: rule_task_scores(p, rule, tasks)) if tasks else per_task_scores
    per_task = per_task_retention(scores(proxy), scores(target), lengths)
    return {"retention_proxy_vs_target_per_task": per_task, "retention_proxy_vs_target_worst_task": worst_task(per_task)}


def _uncompressible(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the proxy cannot compress, from its manifest: ``{"uncompressible": {"params": share of the target's
    parameters outside the targeted layers, "flops": share of per-token matmul FLOPs outside them}}`` (empty for a
    manifest of an older version, which lacks the counts)."""
    before, targeted = manifest.get("params_before"), manifest.get("target_params_before")
    if not before or targeted is None:
        return {}
    other = manifest.get("untargeted_matmul_params")
    return {"uncompressible": {"params": round(1 - targeted / before, 4),
                               "flops": None if other is None else round(other / max(other + targeted, 1), 4)}}


def _summary(wd, warm, proxy, scores, selected, times, pool, rule=None, tasks=None) -> dict[str, Any]:
    manifest = read_manifest(proxy)
    out: dict[str, Any] = {
        "workdir": str(wd),
        # the manifest records both counts; load a model only for a manifest that lacks them
        "target_params": manifest.get("params_before") or _count_params(str(warm)),
        "proxy_params": manifest.get("params_after") or _count_params(str(proxy)),
        "proxy_manifest": {k: manifest[k] for k in ("sparsity", "method", "mode", "damping", "damping_mode") if k in manifest},
        **_uncompressible(manifest),
        "seconds_per_stage": {k: round(v, 2) for k, v in times.items()},
        "retention_proxy_vs_target": retention_metrics(scores["proxy"], scores["target"]),
        "retention_random_vs_target": retention_metrics(scores["random"], scores["target"]),
        **_per_task(Path(wd), rule, tasks),
    }
    if pool == "builtin":
        ids = {who: [json.loads(l)["id"] for l in Path(p).read_text().splitlines() if l.strip()] for who, p in selected.items()}
        out["oracle"] = {
            "validation_families": list(BUILTIN_VALIDATION_FAMILIES),
            "base_rate": oracle_share(sorted(scores["target"])),
            **{f"{who}_selection": oracle_share(i) for who, i in ids.items()},
            "per_family": {who: {f: oracle_share(i, [f]) for f in BUILTIN_VALIDATION_FAMILIES} for who, i in ids.items()},
        }
    out["selection"] = {}
    for who, p in selected.items():
        expl = (read_meta(p) or {}).get("explanation")
        if expl:
            out["selection"][who] = expl
    return out


def _format_task_selections(selection: dict[str, Any], tasks: list[str], who: str = "proxy") -> list[str]:
    """A few lines per task on ``who``'s per-task selections: size, the pool categories it over-weights, lengths, the
    top examples (the full explanation is in ``selected/<who>.<task>.jsonl.meta.json``)."""
    lines = [f"{who}'s selections : one per task, best first (explained in full in selected/{who}.<task>.jsonl.meta.json)"]
    for task in tasks:
        e = selection.get(f"{who}.{task}")
        if not e:
            continue
        cats = ", ".join(f"{c['category']} {c['selected']}" for c in e["share_by_category"][:3] if c["selected"])
        ln = e["length"]
        length = (f"; {ln['unit']} median {ln['selected']['median']:.0f} (pool {ln['pool']['median']:.0f})"
                  if ln["selected"] and ln["pool"] else "")
        lines.append(f"   {task:<10}: {e['count']} of {e['pool_size']} ({cats}{', ...' if len(e['share_by_category']) > 3 else ''})"
                     f"{length}")
        for ex in e.get("top", [])[:2]:
            text = ex["instruction"] + (f" [{ex['context']}]" if ex["context"] else "") + f" -> {ex['response']}"
            lines.append(f"      top {ex['id']} ({ex['category']}): {text[:90]!r}")
    return lines


def _format_summary(s: dict[str, Any]) -> str:
    lines = ["", "=" * 72, "IProX pipeline summary", "=" * 72]
    tp, pp = s["target_params"], s["proxy_params"]
    lines.append(f"target parameters : {tp:,}")
    lines.append(f"proxy parameters  : {pp:,} ({pp / tp:.1%} of the target; {s['proxy_manifest']})")
    if "uncompressible" in s:
        u = s["uncompressible"]
        flops = f", {u['flops']:.1%} of the per-token matmul FLOPs (LM head)" if u.get("flops") is not None else ""
        lines.append(f"   not compressible: {u['params']:.1%} of the target's parameters (embedding, LM head, norms)"
                     f"{flops}")
    lines.append("seconds per stage : " + ", ".join(f"{k} {v:.1f}" for k, v in s["seconds_per_stage"].items()))
    if "stages" in s:
        lines.extend(format_provenance(s))
    if "selection_rule" in s:
        sr = s["selection_rule"]
        if sr.get("tasks"):
            lines.append(f"selection rule    : {sr['rule']} over each task's score columns, one subset per task "
                         f"({', '.join(sr['tasks'])}) for target and proxy (random: one uniform subset), "
                         f"k = {sr['k']:g} of the pool each")
        else:
            lines.append(f"selection rule    : {sr['rule']} (target and proxy; random: uniform), k = {sr['k']:g} of the pool")
    r = s["retention_proxy_vs_target"]
    lines.append(f"proxy vs target   : Spearman {r['spearman']:.3f}, Kendall {r['kendall']:.3f}, top-5% overlap {r['top5%']:.2f}")
    if s.get("retention_proxy_vs_target_per_task"):  # the pooled score mixes the tasks; each task on its own
        lines.extend(format_per_task(s["retention_proxy_vs_target_per_task"]))
    r = s["retention_random_vs_target"]
    lines.append(f"random vs target  : Spearman {r['spearman']:.3f}, top-5% overlap {r['top5%']:.2f}")
    if "oracle" in s:
        o = s["oracle"]
        lines.append(f"selection oracle  : share of selected examples from the validation families {o['validation_families']}")
        names = [k[: -len("_selection")] for k in o if k.endswith("_selection")]
        lines.append("   " + " | ".join(f"{who} {o[who + '_selection']:.3f}" for who in names)
                     + f" | base rate {o['base_rate']:.3f}")
        if "per_family" in o:
            for fam in o["validation_families"]:
                lines.append(f"   {fam + ' share':<17}: " + " | ".join(
                    f"{who} {o['per_family'][who][fam]:.3f}" for who in names if who in o["per_family"]))
    if s.get("selection", {}).get("proxy"):
        lines.append("proxy's selection :")
        lines.extend("   " + l for l in format_selection(s["selection"]["proxy"]).splitlines())
    elif s.get("selection_rule", {}).get("tasks"):
        lines.extend(_format_task_selections(s["selection"], s["selection_rule"]["tasks"]))
    if s.get("selection_effect"):
        lines.extend(format_effect(s["selection_effect"]))
    lines.append("=" * 72)
    if s.get("artifacts"):
        lines.append("artifacts:")
        width = max(len(k) for k in s["artifacts"])
        lines.extend(f"   {k:<{width}} : {v}" for k, v in s["artifacts"].items())
    if s.get("next_command"):
        lines.append("next: is the proxy worth using (per-task retention vs the free baselines, a verdict)?")
        lines.append(f"   {s['next_command']}")
    return "\n".join(lines)


