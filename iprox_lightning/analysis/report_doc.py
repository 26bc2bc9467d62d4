"""``report --workdir``: find a pipeline run's outputs, and write ``report.md`` a person can read.

:func:`discover_workdir` maps a workdir laid out like the pipeline's (and like the stage-by-stage
commands' ``outputs/``) to the report's inputs::

    <wd>/scores/target/scores.parquet     the target's scores (reference)
    <wd>/scores/<name>/scores.parquet     every other score table: proxy, random, baselines
    <wd>/warmup/model, <wd>/proxy/model   models for the FLOPs columns (manifest: probe / alignment sizes)
    <wd>/selected/<name>.jsonl.meta.json  the selections' explanations (written by ``select``)
    <wd>/summary.json                     the pipeline summary (oracle, fine-tuned effect), if any

:func:`render_markdown` writes a heading, the settings, the table with a column legend (what each
metric means and which direction is better), links to the plots, the selections explained and the
fine-tuned effect.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import InputNotFoundError
from ..evaluation.effect import format_effect
from ..io.jsonfile import read_json
from ..io.proxy import PROXY_MANIFEST, read_manifest
from ..selection.summary import format_selection
from .tables import format_table

LEGEND = {
    "spearman / pearson / kendall": "rank / linear / pair-order correlation of the proxy's scores with the target's (higher is better; 1 = same ranking)",
    "top1% / top5% / top10%": "share of the target's top-k examples the proxy also ranks in its top-k (higher is better)",
    "n": "examples scored by both",
    "SA": "subspace affinity ×100: how much of the validation gradients' principal subspace the selection's target-model gradients span (higher is better)",
    "1-NND": "mean distance from each selected example's gradient to its nearest selected neighbour: diversity of the selection (higher = more diverse)",
    "n_selected": "size of the selection used for SA / 1-NND (top 5%)",
    "TFLOPs_probe / _alignment / _scoring / _total": "estimated compute of building the proxy (IPSVD probes, alignment) and scoring the pool with it, 10^12 FLOPs (lower is cheaper); the `target` row is scoring with the target itself",
    "params_tracked": "parameters whose gradients the scorer uses",
}


def _scores(d: Path) -> Path | None:
    for name in ("scores.parquet", "scores.jsonl"):
        if (d / name).is_file():
            return d / name
    return None


def discover_workdir(wd: str | Path) -> dict[str, Any]:
    """The report's inputs found under ``wd`` (see the module doc); ``FileNotFoundError`` names what is missing."""
    wd = Path(wd)
    target = _scores(wd / "scores" / "target")
    if target is None:
        raise InputNotFoundError(f"report --workdir {wd}: no target score table at {wd / 'scores' / 'target' / 'scores.parquet'} "
                                 "(run the target scoring stage first)")
    proxies = {d.name: _scores(d) for d in sorted((wd / "scores").iterdir()) if d.is_dir() and d.name != "target" and _scores(d)}
    proxies.update({p.stem: p for p in sorted((wd / "scores").glob("*.parquet"))})  # e.g. regression_scorer.parquet
    if not proxies:
        raise InputNotFoundError(f"report --workdir {wd}: no score table besides the target's under {wd / 'scores'}")
    out: dict[str, Any] = {"target_scores": str(target), "proxy_scores": {k: str(v) for k, v in proxies.items()}}
    if (wd / "warmup" / "model" / "config.json").exists():
        out["target_model"] = str(wd / "warmup" / "model")
    models = {"proxy": wd / "proxy" / "model", "layer_extraction": wd / "layer_extraction" / "model"}
    out["proxy_models"] = {k: str(v) for k, v in models.items() if k in proxies and (v / "config.json").exists()}
    out["selections"] = {}

    for meta in sorted((wd / "selected").glob("*.jsonl.meta.json")) if (wd / "selected").is_dir() else []:
        e = read_json(meta, what="selection meta").get("explanation")
        if e:
            out["selections"][meta.name[: -len(".jsonl.meta.json")]] = e
    if (wd / "summary.json").exists():
        out["summary"] = read_json(wd / "summary.json", what="the pipeline's summary",
                                   fix="run the same pipeline again to write it afresh")
    return out


def manifest_sizes(proxy_dir: str | Path, align_batch_size: int = 4) -> dict[str, int]:
    """``n_probe_examples`` and (≈ steps × batch size) ``n_align_examples`` from a proxy's manifest."""
    if not (Path(proxy_dir) / PROXY_MANIFEST).exists():
        return {}
    m = read_manifest(proxy_dir)
    steps = int((m.get("alignment") or {}).get("steps") or 0)
    return {"n_probe_examples": int(m.get("probe_examples") or 0), "n_align_examples": steps * align_batch_size}


def render_markdown(rows: Sequence[Mapping[str, Any]], settings: Mapping[str, Any], plots: Sequence[str],
                    selections: Mapping[str, Any] | None = None, summary: Mapping[str, Any] | None = None) -> str:
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    lines = ["# IProX proxy report", "", "## Settings", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in settings.items()]
    lines += ["", "## Retention, selection quality and cost", "", format_table(rows), "", "Columns:", ""]
    lines += [f"- **{key}** — {text}" for key, text in LEGEND.items()]
    if plots:
        lines += ["", "## Plots", ""] + [f"- [{Path(p).name}]({Path(p).name})" for p in plots]
    if summary and summary.get("oracle"):
        o = summary["oracle"]
        lines += ["", "## Oracle (built-in data)", "",
                  f"Share of each selection from the validation families {o['validation_families']} (base rate {o['base_rate']:.3f}):", ""]
        # one selection per name the summary holds: target / proxy / random (one pooled selection each), or
        # target.<task> / proxy.<task> / random (a pipeline run's per-task selections)
        for who in [k[: -len("_selection")] for k in o if k.endswith("_selection")]:
            fam = ", ".join(f"{f} {v:.3f}" for f, v in o.get("per_family", {}).get(who, {}).items())
            lines.append(f"- {who}: {o[f'{who}_selection']:.3f}" + (f" ({fam})" if fam else ""))
    if summary and summary.get("selection_effect"):
        lines += ["", "## Fine-tuned effect", "", "```"] + format_effect(summary["selection_effect"]) + ["```"]
    for name, e in (selections or {}).items():
        lines += ["", f"## Selection `{name}` explained", "", "```", format_selection(e), "```"]
    return "\n".join(lines) + "\n"
