"""Proxy fidelity benchmark v2: every proxy and every score made by the product's own stages.

Each stage is the command a user runs (``python train.py fit|predict|layer_extraction`` with the shipped
``configs/*.yaml`` plus a generated overlay kept in ``OUT/configs/``), run as a subprocess one at a time:

1. **warm-up** (``configs/warmup.yaml``, ``WarmupModule``): the target fine-tuned on the pool's warm-up split
   (a random 5%, 1 epoch, lr 1e-5, wd 0.01, embeddings/LM head frozen) -> ``OUT/warmed`` (git-ignored);
2. **sample** (in this script): a sample (stratified by ``--stratify-by``, default ``source``, largest remainder;
   the recorded 512 are a uniform draw, ``--stratify-by none``: the canonical records had lost ``source``) of ``--sample`` pool
   examples outside the warm-up and construction splits -> ``OUT/sample.jsonl``; and the validation set:
   **every** few-shot example of the suites under ``--eval-dir`` (LESS-style, MMLU dev 5 × 57, BBH CoT 3 × 27,
   TyDiQA 1 × 9) with each suite split in two alternating halves, tasks ``<suite>.half0|half1`` ->
   ``OUT/validation.jsonl``;
3. **references**: the warmed target and the target as shipped score the sample (``configs/score.yaml``,
   TracIn, ``per_task``) -> ``OUT/scores/<key>/scores.parquet``;
4. **proxies**: ``configs/build_proxy.yaml`` (``IPSVDCallback`` + ``ProxyAlignModule``) from the warmed target
   on the product's probe / alignment splits, or ``layer_extraction`` -> ``OUT/proxies/<key>``; each proxy scores
   the same sample against the same validation set;
5. **summary**: ``OUT/summary.json`` (``meta`` + ``rows``, baselines included), then ``OUT/summary.md`` and the
   plot are generated from it.

Every stage is skipped when its output exists **and** its fingerprint (the stage's settings) matches the
recorded one in ``OUT/state.json``; a changed setting re-runs it. An interrupted run resumes (re-run the
same command).

Variants: ``le@ρ`` or ``METHOD[/OPTION...]@ρ[+align...][+SUFFIX...]``, the grammar of ``bench/variants.py``
(e.g. ``ipsvd/exact/rel1e-3/global@0.5+align:1e-3+val+valg1+score0.5``).

Per row: ``spearman`` (vs the warmed target's ``score``, the mean-aggregated TracIn ``select`` ranks by),
``spearman_length_partialled`` (response length partialled out), ``top5_overlap`` / ``top10_overlap`` (the
sets ``train.py select`` picks from each table), each with a percentile bootstrap CI over the scored examples;
``spearman_max`` (LESS max aggregation over the validation subsets); ``spearman_vs_unwarmed``; ``params``;
``scoring_time_ratio`` (CPU seconds of the row's scoring stage / the warmed target's); paired-bootstrap
differences against ``length_sort``, ``layer_extraction`` and ``svd`` rows. The ceiling: the target's
split-half reliability (Spearman between its LESS-max scores against the two validation halves).

Per task (``per_task`` of every row, reference rows included): the pooled ``score`` is one cosine to the mean
gradient of all validation examples (MMLU is 285 of the 375), but a user selects one subset per target task. A
suite's score is the mean of its two half-columns (``score/<suite>.half0|half1``); per suite the row holds Spearman,
length-partialled Spearman and the top-5% / top-10% overlap of the per-suite top-k sets, each with the same bootstrap
CI (:func:`iprox_lightning.analysis.retention.per_task_retention`, the library's one function), and ``worst_task``
(the minimum over suites of the Spearman and of the partialled one) -- the headline of the tables. ``meta``
holds the per-suite split-half reliability of the target (``target_split_half_per_task``: the same metrics between
its half0 and half1 scores), the per-task ceiling.

    python bench/fidelity_v2.py --out bench/results/fidelity_v2 --threads 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ledger import (ROOT, Stages, check_local_inputs, config_text, git_commit, host_info, hosts_text,  # bench/: the stage ledger
                    kept, logger_overlay, read_kept, recorded_hosts, splice_docs, write_kept)
from variants import build_key, dir_name, lever_base, parse_variant  # bench/: the variant grammar

from iprox_lightning.evaluation import percentile_interval

SHARED = ROOT.parent / "shared"
DEFAULT_MODEL = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_POOL = SHARED / "data" / "pool" / "instructions.jsonl"
DEFAULT_EVAL = SHARED / "data" / "eval"
HALVES = ("half0", "half1")
BASELINES = ("length_sort", "layer_extraction", "svd")
DEFAULT_VARIANTS = [
    "ipsvd/exact/rel1e-3/global@0.5", "le@0.5", "svd@0.5", "ipsvd/core/abs1e-1@0.5",
    "ipsvd/exact/rel1e-3/global@0.5+align", "ipsvd/exact/rel1e-3@0.5",
    "ipsvd/exact/rel1e-3/global@0.3", "le@0.3",
]


# ------------------------------------------------------------------------------------------------
# data (sample and validation files)
# ------------------------------------------------------------------------------------------------
# the sample: the library's stratified_sample (train.py sample_pool), the algorithm the recorded runs used (with every
# record in one stratum: the recorded 512-example samples are uniform draws, --stratify-by none)
from iprox_lightning.data import stratified_sample, write_records_jsonl  # noqa: E402


def split_halves(records: list[dict]) -> list[dict]:
    """Validation records with ``category`` = ``<task>.half0|half1``, alternating within each task."""
    seen: dict[str, int] = {}
    out = []
    for r in records:
        t = r["category"]
        out.append({**r, "category": f"{t}.{HALVES[seen.get(t, 0) % 2]}"})
        seen[t] = seen.get(t, 0) + 1
    return out


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
def score_arrays(path: Path) -> dict[str, Any]:
    """A score table (:func:`iprox_lightning.io.scores.read_table`) as ``{"id": [...], "score": array, "score_max":
    array, "tasks": {name: array}, "n_tokens": array}``."""
    from iprox_lightning.io import read_table as read_score_table, task_names_of

    _, t = read_score_table(path)
    col = lambda c: np.asarray(t.column(c).to_pylist(), dtype=float)  # noqa: E731
    return {"id": [str(i) for i in t.column("id").to_pylist()], "score": col("score"), "score_max": col("score_max"),
            "n_tokens": col("n_tokens"), "tasks": {name: col(f"score/{name}") for name in task_names_of(t)}}


def safetensors_param_count(model_dir: Path) -> int | None:
    """Parameters stored in a model directory's ``*.safetensors`` files (read from the headers only)."""
    from iprox_lightning.io import tensor_shapes

    files = sorted(Path(model_dir).glob("*.safetensors"))
    return sum(int(np.prod(shape)) for f in files for shape in tensor_shapes(f).values()) if files else None


def as_map(table: Mapping[str, Any], col: str = "score") -> dict[str, float]:
    return dict(zip(table["id"], map(float, table[col])))


def half_max(table: Mapping[str, Any], half: str) -> dict[str, float]:
    cols = [v for k, v in table["tasks"].items() if k.endswith("." + half)]
    if not cols:
        return {}
    return dict(zip(table["id"], map(float, np.max(np.stack(cols), axis=0))))


def suite_of(task: str) -> str:
    """``mmlu.half0`` -> ``mmlu``; a task name without a half suffix is its own suite."""
    base, _, half = task.rpartition(".")
    return base if base and half in HALVES else task


def suite_scores(table: Mapping[str, Any], half: str | None = None) -> dict[str, dict[str, float]]:
    """``id -> {suite: score}``: the mean of the suite's half-columns, or only the ``half`` one when given."""
    groups: dict[str, list[np.ndarray]] = {}
    for name, col in table["tasks"].items():
        if half is None or name.endswith("." + half):
            groups.setdefault(suite_of(name), []).append(col)
    means = {s: np.mean(np.stack(cols), axis=0) for s, cols in groups.items()}
    return {i: {s: float(v[j]) for s, v in means.items()} for j, i in enumerate(table["id"])}


def row_metrics(proxy: Mapping[str, float], target: Mapping[str, float], length: Mapping[str, float],
                picked: Mapping[float, set[str]] | None, target_picked: Mapping[float, set[str]],
                n_boot: int, seed: int) -> dict[str, Any]:
    """Retention of ``proxy`` against ``target`` on their shared ids (see the module docstring)."""
    from iprox_lightning.analysis import partial_spearman, spearman, topk_overlap

    ids = sorted(set(proxy) & set(target) & set(length))
    p, t, c = (np.array([d[i] for i in ids]) for d in (proxy, target, length))
    m: dict[str, Any] = {"n": len(ids), "spearman": float(spearman(p, t)),
                         "spearman_ci": percentile_interval(lambda ix: spearman(p[ix], t[ix]), len(ids), n_boot, seed),
                         "spearman_length_partialled": float(partial_spearman(p, t, c)),
                         "partialled_ci": percentile_interval(lambda ix: partial_spearman(p[ix], t[ix], c[ix]),
                                                              len(ids), n_boot, seed)}
    for frac, name in ((0.05, "top5_overlap"), (0.10, "top10_overlap")):
        if picked is not None:  # the sets `select` wrote
            a, b = picked[frac], target_picked[frac]
            m[name] = len(a & b) / max(len(b), 1)
        else:
            m[name] = float(topk_overlap(p, t, frac))
        m[name.replace("overlap", "ci")] = percentile_interval(lambda ix: float(topk_overlap(p[ix], t[ix], frac)),
                                                               len(ids), n_boot, seed)
    return m


def paired_difference(a: Mapping[str, float], b: Mapping[str, float], target: Mapping[str, float],
                      length: Mapping[str, float], n_boot: int, seed: int) -> dict[str, Any]:
    """``metric(a) − metric(b)`` for raw and length-partialled Spearman, paired bootstrap CI."""
    from iprox_lightning.analysis import partial_spearman, spearman

    ids = sorted(set(a) & set(b) & set(target) & set(length))
    pa, pb, t, c = (np.array([d[i] for i in ids]) for d in (a, b, target, length))
    out = {}
    for name, f in (("spearman", lambda x, ix: spearman(x[ix], t[ix])),
                    ("partialled", lambda x, ix: partial_spearman(x[ix], t[ix], c[ix]))):
        full = np.arange(len(ids))
        out[name] = float(f(pa, full) - f(pb, full))
        out[name + "_ci"] = percentile_interval(lambda ix: f(pa, ix) - f(pb, ix), len(ids), n_boot, seed)
    return out


def select_sets(scores: Path, pool: Path, work: Path) -> dict[float, set[str]]:
    """The ids ``train.py select`` picks at 5% and 10% from a score table (the product's function)."""
    from iprox_lightning.selection import select

    out = {}
    for frac in (0.05, 0.10):
        dst = work / f"select_{int(frac * 100)}.jsonl"
        select(str(scores), k=frac, pool=str(pool), output=str(dst), quiet=True)
        out[frac] = {json.loads(line)["id"] for line in open(dst) if line.strip()}
    return out


# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def fmt_ci(ci) -> str:
    return "" if ci is None or any(not math.isfinite(x) for x in ci) else f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"


SUITE_NAMES = {"mmlu": "MMLU", "bbh": "BBH", "tydiqa": "TyDiQA"}


def suite_name(suite: str) -> str:
    return SUITE_NAMES.get(suite, suite)


def _num(v, f: str = "{:+.3f}") -> str:
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f.format(v)


def worst_task_key(row) -> tuple[float, float]:
    """A row's worst-task Spearman, then its worst-task partialled one (undefined: −inf): larger is better."""
    w = row.get("worst_task") or {}
    return tuple(x if x is not None and math.isfinite(x) else -math.inf
                 for x in (w.get("spearman"), w.get("spearman_length_partialled")))


def headline_row(rows) -> dict | None:
    """The row the headline names: the best worst task (Spearman, then partialled) among the rows with a ρ
    (proxies and the Layer Extraction / SVD baselines); reference rows are its comparison, never the headline."""
    cand = [r for r in rows if r.get("rho") is not None and r.get("worst_task")]
    return max(cand, key=worst_task_key) if cand else None


def headline(summary: Mapping[str, Any]) -> list[str]:
    """The first lines of the tables: the best row by its worst task, with the references and the per-task ceiling."""
    meta, rows = summary["meta"], summary["rows"]
    suites = meta.get("suites") or []
    best = headline_row(rows)
    if best is None or not suites:
        return []

    def per(r, key="spearman"):
        return " / ".join(f"{suite_name(s)} {_num(r['per_task'][s][key], '{:+.2f}')}" for s in suites)

    def worst(r, ci: bool = False):
        w = r["worst_task"]
        if not w.get("spearman_task"):
            return "worst task —"
        interval = fmt_ci(r["per_task"][w["spearman_task"]].get("spearman_ci")) if ci else ""
        return (f"worst task {suite_name(w['spearman_task'])} {_num(w['spearman'], '{:+.2f}')}{interval}"
                + (f" (length-partialled: {suite_name(w['spearman_length_partialled_task'])} "
                   f"{_num(w['spearman_length_partialled'], '{:+.2f}')})" if w.get("spearman_length_partialled_task")
                   else ""))
    out = [f"**Headline (the worst task, not the pooled score): `{best['variant']}`** — {worst(best, ci=True)}; "
           f"per task Spearman {per(best)}; pooled {_num(best.get('spearman'), '{:+.2f}')}."]
    refs = {r["variant"]: r for r in rows if r["variant"] in ("target_unwarmed", "length_sort")}
    notes = []
    if "target_unwarmed" in refs:
        notes.append(f"off-the-shelf target (full size, not warmed up): {per(refs['target_unwarmed'])}, "
                     f"{worst(refs['target_unwarmed'], ci=True)}")
    if "length_sort" in refs:
        notes.append(f"length sort (model-free): {per(refs['length_sort'])}")
    if meta.get("target_split_half_per_task"):
        sh = meta["target_split_half_per_task"]
        notes.append("ceiling (the warmed target's split-half reliability per suite): "
                     + " / ".join(f"{suite_name(s)} {_num(sh[s]['spearman'], '{:.3f}')}" for s in suites if s in sh))
    if notes:
        out[0] += " References: " + "; ".join(notes) + "."
    return out


def per_task_table(summary: Mapping[str, Any]) -> list[str]:
    """Per-suite Spearman [CI] and worst task, length-partialled, among the 10% shortest responses (ties kept), top-5%
    / top-10% overlap of the per-suite top-k sets; reference rows first, then the rest by their worst task (best
    first); the headline row in bold."""
    suites = summary["meta"].get("suites") or []
    rows = [r for r in summary["rows"] if r.get("per_task")]
    if not suites or not rows:
        return []
    best = headline_row(summary["rows"])
    refs = [r for r in rows if r.get("rho") is None]
    rest = sorted((r for r in rows if r.get("rho") is not None), key=lambda r: [-x for x in worst_task_key(r)])
    head = (["variant", "ρ"] + [f"{suite_name(s)} Spearman" for s in suites] + ["worst task"]
            + [f"{suite_name(s)} partialled" for s in suites] + ["worst partialled"]
            + [f"{suite_name(s)} among the shortest" for s in suites] + ["worst among the shortest"]
            + [f"top-5% {' / '.join(map(suite_name, suites))}", f"top-10% {' / '.join(map(suite_name, suites))}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in refs + rest:
        pt, w = r["per_task"], r["worst_task"]
        b = (lambda x: f"**{x}**") if r is best else (lambda x: x)
        wt = lambda k: (f"{_num(w[k])} ({suite_name(w[k + '_task'])})" if w.get(k + "_task") else "—")  # noqa: E731
        cells = ([b(r["variant"]), _num(r.get("rho"), "{:g}")]
                 + [f"{_num(pt[s]['spearman'])}{fmt_ci(pt[s].get('spearman_ci'))}" for s in suites]
                 + [b(wt("spearman"))]
                 + [f"{_num(pt[s].get('spearman_length_partialled'))}{fmt_ci(pt[s].get('spearman_length_partialled_ci'))}"
                    for s in suites]
                 + [wt("spearman_length_partialled")]
                 + [f"{_num(pt[s].get('spearman_within_shortest'))}{fmt_ci(pt[s].get('spearman_within_shortest_ci'))}"
                    for s in suites]
                 + [wt("spearman_within_shortest")]
                 + [" / ".join(_num(pt[s].get(k), "{:.2f}") for s in suites) for k in ("top5%", "top10%")])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(summary: Mapping[str, Any]) -> str:
    meta = summary["meta"]
    lines = [f"# Proxy fidelity v2 — {meta.get('target_name')}", "", *[x for h in headline(summary) for x in (h, "")],
             f"Warmed-up target: {meta['target_warmed_up']}; {meta['n_scored']} scored pool examples ("
             f"{strata_text(meta.get('sample_strata', 'none'))}; ≤ {meta['max_length']} tokens); {meta['n_validation']} validation examples "
             f"({', '.join(f'{k} {v}' for k, v in meta.get('validation_counts', {}).items())}); "
             f"summary written at commit `{meta['commit']}`; {meta.get('machine', '')}.", "",
             *(["Commands (every invocation that ran stages into this directory, in order; each stage's own command in "
                 "`state.json`):", "", *[f"{i}. `{c['command']}` (started {c['started']}, commit `{c['commit']}`)"
                                         for i, c in enumerate(meta["commands"], 1)]]
               if meta.get("commands") else
               [f"Command: `{meta.get('command', '')}` (stage commands and per-stage commits in `state.json`)."]), "",
             *(["Per task (a suite's score = the mean of its two halves' scores; Spearman and length-partialled Spearman "
                 "with the warmed target's suite score [95% bootstrap CI], top-k overlap of the per-suite top-k sets; "
                 "the worst task is the minimum over suites). Ceiling per suite (the warmed target's half0 vs half1 "
                 "scores): " + ", ".join(
                     f"{suite_name(s)} {_num(m['spearman'], '{:+.3f}')} (partialled "
                     f"{_num(m.get('spearman_length_partialled'), '{:+.3f}')})"
                     for s, m in meta.get("target_split_half_per_task", {}).items()) + ".", "",
                 *per_task_table(summary), ""] if per_task_table(summary) else []),
             f"Pooled (one cosine to the mean gradient of all {meta['n_validation']} validation examples, so the largest "
             f"suite dominates it). Ceiling (the warmed target's split-half reliability, LESS-max scores against the two "
             f"validation halves): Spearman {meta['target_split_half']['spearman']:+.3f}, length-partialled "
             f"{meta['target_split_half']['partialled']:+.3f}.", "",
             "| variant | ρ | params | Spearman | partialled (length) | top-5% | top-10% | Spearman (LESS max) | vs unwarmed | scoring time ratio ¹ |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        g = lambda k, f="{:+.3f}": _num(r.get(k), f)  # noqa: E731
        lines.append(
            f"| {r['variant']} | {g('rho', '{:g}')} | {g('params', '{:,}')} | {g('spearman')}{fmt_ci(r.get('spearman_ci'))} | "
            f"{g('spearman_length_partialled')}{fmt_ci(r.get('partialled_ci'))} | {g('top5_overlap', '{:.2f}')} | "
            f"{g('top10_overlap', '{:.2f}')} | {g('spearman_max')} | {g('spearman_vs_unwarmed')} | "
            f"{g('scoring_time_ratio', '{:.2f}')} |")
    lines += ["", "¹ proxy / target scoring time: CPU seconds of the row's scoring stage / the target's (sensitive to the "
              "machine's load; `bench/speed.py --proxy-dirs` times built proxies interleaved). Partialled retention of "
              "`length_sort` is undefined (it is the control itself)."]
    if summary.get("paired"):
        lines += ["", "Paired bootstrap differences (same examples resampled for both rows):", "",
                  "| row | − baseline | Δ Spearman | Δ partialled |", "|---|---|---|---|"]
        for d in summary["paired"]:
            lines.append(f"| {d['a']} | {d['b']} | {d['spearman']:+.3f}{fmt_ci(d['spearman_ci'])} | "
                         f"{d['partialled']:+.3f}{fmt_ci(d['partialled_ci'])} |")
    suites = list(summary["meta"].get("suites") or [])
    for key, caption in (
            ("paired_per_task", "Per task, a `+tval` row (the proxy scored against the target's validation gradients) "
             "minus the row that scored the same proxy against its own (Δ Spearman with the target's suite score, "
             "paired bootstrap CI):"),
            ("paired_levers", "Per task, a Stage-2 lever row minus the row it changes (the same key without the "
             "suffixes after `+align...`; Δ Spearman with the target's suite score, paired bootstrap CI over the pool "
             "examples — two builds, so the CI leaves out build-to-build variation: a re-build of one setting moved "
             "MMLU by 0.07):")):
        if summary.get(key):
            lines += ["", caption, "", "| row | − row | " + " | ".join(f"Δ {suite_name(x)}" for x in suites) + " |",
                      "|---|---|" + "---|" * len(suites)]
            lines += [f"| {d['a']} | {d['b']} | " + " | ".join(f"{d[x]['spearman']:+.3f}{fmt_ci(d[x]['spearman_ci'])}"
                                                               for x in suites if x in d) + " |" for d in summary[key]]
    if summary.get("stages"):
        lines += ["", "Stages (wall-clock / CPU seconds; the command of each is in `state.json`):", "",
                  "| stage | wall s | CPU s | commit |", "|---|---|---|---|"]
        for k, s in summary["stages"].items():
            if "wall_s" in s:
                lines.append(f"| {k} | {s['wall_s']:.0f} | {s['cpu_s']:.0f} | {s.get('commit', '—')} |")
    return "\n".join(lines) + "\n"


def write_plot(out: Path, summary: Mapping[str, Any]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r.get("spearman") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))
    for k, (key, ci, label) in enumerate((("spearman", "spearman_ci", "raw"),
                                          ("spearman_length_partialled", "partialled_ci", "length partialled"))):
        vals = np.array([r[key] for r in rows])
        err = np.array([[r[key] - r[ci][0], r[ci][1] - r[key]] if r.get(ci) else [0, 0] for r in rows]).T
        ax.errorbar(vals, y + (k - 0.5) * 0.3, xerr=np.abs(err), fmt="o", label=label, capsize=2)
    ax.set_yticks(y, [r["variant"] for r in rows])
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("Spearman with the target's TracIn scores (95% bootstrap CI)")
    ax.legend(loc="lower left")
    ax.invert_yaxis()
    fig.tight_layout()
    path = out / "retention.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def docs_markers(out: Path) -> tuple[str, str]:
    """The markers of the run in ``out``'s section of a page (``--docs``): one per OUT directory."""
    return (f"<!-- fidelity:begin {out.name} (generated by bench/fidelity_v2.py --docs) -->",
            f"<!-- fidelity:end {out.name} -->")


def docs_markdown(summary: Mapping[str, Any]) -> str:
    """A page's section (``--docs``): the headline and the per-task table; the rest stays in ``OUT/summary.md``."""
    return "\n\n".join([*headline(summary), "\n".join(per_task_table(summary))]) + "\n"


def write_outputs(out: Path, summary: dict) -> None:
    write_kept(out / "summary.json", summary)
    (out / "summary.md").write_text(markdown(summary))


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="the target (hub id, dir, .gguf, builtin)")
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--eval-dir", default=str(DEFAULT_EVAL), help="suites for the validation set ('builtin': demo)")
    ap.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                    help="proxies to build and score beside the target (none: the target alone)")
    ap.add_argument("--sample", type=int, default=512)
    ap.add_argument("--stratify-by", default="source",
                    help="the pool field whose values share the sample in proportion (largest remainder; 'category' "
                         "on the built-in pool), or 'none' for a uniform draw (what the recorded 512 runs used)")
    ap.add_argument("--max-length", type=int, default=128, help="tokens of scored / validation / probe / align examples")
    ap.add_argument("--warmup-max-length", type=int, default=256)
    ap.add_argument("--no-warmup", action="store_true", help="build proxies from the target as shipped")
    ap.add_argument("--adopt-warmup", default=None, metavar="NOTE",
                    help="record an existing OUT/warmed (made by the equivalent warm-up command, described in NOTE) "
                         "as this run's warm-up instead of re-running it")
    ap.add_argument("--no-unwarmed", action="store_true", help="skip the second reference (target as shipped)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--align-epochs", type=int, default=2)
    ap.add_argument("--align-lr", type=float, default=1e-3)
    ap.add_argument("--align-batch-size", type=int, default=4)
    ap.add_argument("--align-val-per-task", type=int, default=6, help="held-out validation examples per task for keep_best")
    ap.add_argument("--align-val-every", type=float, default=0.5,
                    help="held-out check (keep_best) every this fraction of an alignment epoch")
    ap.add_argument("--kl-weight", type=float, default=0.1)
    ap.add_argument("--num-probe-tokens", type=int, default=1024)
    ap.add_argument("--builtin-size", type=int, default=2000)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--summary-only", action="store_true", help="only recompute summary/tables/plot from finished stages")
    ap.add_argument("--build-only", action="store_true",
                    help="build the variants' proxies and score none of them (for proxies used through a gradient store, "
                         "bench/effect.py store:<proxy>); no summary is written")
    ap.add_argument("--dry-run", action="store_true", help="print the stage commands, run nothing")
    ap.add_argument("--in-process", action="store_true",
                    help="run each stage's train.py command in this process, not as a subprocess (tests)")
    ap.add_argument("--docs", default=None, help="also write the tables into this Markdown page between its markers")
    args = ap.parse_args(argv)
    if not args.summary_only:
        check_local_inputs(ap, args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def strata_text(strata: str) -> str:
    return "a uniform draw" if strata == "none" else f"stratified by {strata}"


def draw_sample(candidates: list[dict], args, builtin: bool, st: Stages) -> list[dict]:
    """The scored sample: ``--sample`` of the candidates, stratified by ``--stratify-by`` (a field of the pool's rows,
    read beside the canonical records, which drop it; ``category`` on the built-in demo pool) or uniform (``none``).
    An OUT whose stages were made from another draw refuses the run (its results would be re-made one by one over
    the old ones); OUTs from before the option hold the uniform draw (the canonical records had no ``source``)."""
    by = None if args.stratify_by == "none" else "category" if builtin else args.stratify_by
    legacy = any(key != "warmup" for key in st.state["stages"])  # the sample does not steer the warm-up
    # before the option: the real pool's draw was uniform, the built-in pool's by category (what "source" gives it)
    recorded = st.state.get("sample_strata", ("source" if builtin else "none") if legacy else None)
    if recorded is not None and recorded != args.stratify_by:
        raise SystemExit(f"{st.out}: its stages were made from a sample drawn with --stratify-by {recorded}"
                         f"{' (a uniform draw)' if recorded == 'none' else ''}, not {args.stratify_by}; pass "
                         f"--stratify-by {recorded} to continue it, or another --out")
    if by is not None and not builtin:
        from iprox_lightning.data import read_records

        strata = {r["id"]: r[by] for r in read_records(args.pool, keep_fields=(by,))}
        candidates = [{**r, by: strata[r["id"]]} for r in candidates]
    sample = stratified_sample(candidates, args.sample, args.seed, by=by)
    if st.state.get("sample_strata") != args.stratify_by and not args.dry_run:
        st.state["sample_strata"] = args.stratify_by
        st.save()
    return sample


class FidelityRun:
    """One invocation's stages, in order: :meth:`warm_up`, :meth:`write_inputs`, :meth:`score` (the references),
    :meth:`build` (one per variant), then :func:`build_summary`. Each stage runs through the :class:`ledger.Stages`
    of ``OUT/state.json`` (reused by fingerprint)."""

    def __init__(self, args, log):
        self.args, self.log = args, log
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.st = Stages(self.out, args.threads, log, dry_run=args.dry_run, in_process=args.in_process)
        self.cfg = ROOT / "configs"
        self.builtin = args.pool == "builtin"
        self.data_common = {"seed": args.seed, "builtin_size": args.builtin_size}

    def demo(self, name: str) -> list[Path]:
        """The built-in demo's overlay of a stage config, when the run uses the built-in pool."""
        p = self.cfg / "builtin" / f"{name}.yaml"
        return [p] if self.builtin and p.exists() else []

    def stage_fp(self, key: str) -> str | None:
        rec = self.st.state["stages"].get(key)
        return rec["fingerprint"] if rec else None

    # 1. warm-up ---------------------------------------------------------------------------------
    def warm_up(self) -> str:
        """The target the proxies are built from: ``OUT/warmed`` (warmed up, or adopted), or ``--model`` itself."""
        args, st, out, cfg = self.args, self.st, self.out, self.cfg
        if args.no_warmup:
            return args.model
        warmed = out / "warmed"
        fp = {"model": args.model, "pool": args.pool, "max_length": args.warmup_max_length, "seed": args.seed,
              "config": config_text(cfg / "warmup.yaml"), "builtin_size": args.builtin_size}
        if args.adopt_warmup and (warmed / "config.json").exists() and "warmup" not in st.state["stages"]:
            st.state["stages"]["warmup"] = {"fingerprint": json.dumps(fp, sort_keys=True), "adopted": args.adopt_warmup,
                                            "finished": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(
                                                (warmed / "config.json").stat().st_mtime))}
            st.save()
            self.log(f"warm-up: adopted the existing {warmed} ({args.adopt_warmup})")
        if not args.summary_only:
            st.run("warmup", "fit", [cfg / "warmup.yaml", *self.demo("warmup")], {
                "seed_everything": args.seed,
                "trainer": {"default_root_dir": str(out / "lightning"), "limit_val_batches": 0,
                            "num_sanity_val_steps": 0, "logger": logger_overlay(out, "warmup")},
                "model": {"init_args": {"model": args.model, "save_dir": str(warmed)}},
                "data": {"init_args": {**self.data_common, "pool": args.pool, "validation": None,
                                       "tokenizer": args.model, "max_length": args.warmup_max_length,
                                       "train_split": "warmup"}},
            }, fp, warmed / "config.json", clean=warmed)
        return str(warmed)

    # 2. sample and validation files -------------------------------------------------------------
    def write_inputs(self) -> None:
        """``OUT/sample.jsonl`` (outside the warm-up and construction splits) and ``OUT/validation.jsonl`` (every
        few-shot example of the suites, each suite in two halves); sets ``sample_path``, ``val_path``,
        ``val_counts`` and ``data_fp``."""
        from iprox_lightning.data import SFTDataModule

        args = self.args
        dm = SFTDataModule(pool=args.pool, validation=None, tokenizer="builtin", seed=args.seed,
                           builtin_size=args.builtin_size)
        used = set(dm.splits.warmup) | set(dm.splits.probe) | set(dm.splits.align)
        candidates = [r for r in dm.pool_records if r["id"] not in used]
        sample = draw_sample(candidates, args, self.builtin, self.st)
        self.sample_path = self.out / "sample.jsonl"
        write_records_jsonl(sample, self.sample_path)
        if args.eval_dir == "builtin":
            from iprox_lightning.data import builtin_validation

            val = builtin_validation(6, seed=0)
        else:
            from iprox_lightning.data import eval_validation_records

            val = eval_validation_records(args.eval_dir, ("mmlu", "bbh", "tydiqa"))
        self.val_path = self.out / "validation.jsonl"
        write_records_jsonl(split_halves(val), self.val_path)
        self.val_counts: dict[str, int] = {}
        for r in val:
            self.val_counts[r["category"]] = self.val_counts.get(r["category"], 0) + 1
        self.data_fp = {"sample": [r["id"] for r in sample], "validation": [r["id"] for r in val],
                        "max_length": args.max_length, "batch_size": args.batch_size, "seed": args.seed}

    def record_command(self) -> None:
        """The invocation in ``state.json``: ``run_command`` (the latest) and ``run_commands`` (every one that ran)."""
        st = self.st
        cmd = "python bench/fidelity_v2.py " + " ".join(shlex.quote(a) for a in self.args.argv)
        st.state["run_command"] = cmd
        runs = st.state.setdefault("run_commands", [])
        if not runs or runs[-1]["command"] != cmd:
            runs.append({"command": cmd, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(dirty=True)})
        st.save()

    # 3. scores ----------------------------------------------------------------------------------
    def score(self, key: str, model: str, tokenizer: str, model_fp: Any, validation_model: str | None = None) -> dict:
        """``model`` scores the sample against the validation file (``configs/score.yaml``, TracIn, per task);
        ``validation_model``: against that model's validation gradients (``+tval``)."""
        args, out, cfg = self.args, self.out, self.cfg
        d = out / "scores" / dir_name(key)
        fp = {"model": model_fp, "data": self.data_fp, "config": config_text(cfg / "score.yaml")}
        init = {"model": model, "method": "tracin", "per_task": True}
        if validation_model is not None:  # only then: the other rows' fingerprints stay as they were
            fp["validation_model"] = self.stage_fp("warmup") or validation_model
            init["validation_model"] = validation_model
        return self.st.run(f"score:{key}", "predict", [cfg / "score.yaml", *self.demo("score")], {
            "seed_everything": args.seed,
            "trainer": {"default_root_dir": str(out / "lightning"), "logger": logger_overlay(out, f"score_{dir_name(key)}"),
                        "callbacks": [{"class_path": "iprox_lightning.scoring.InfluenceWriter",
                                       "init_args": {"output_dir": str(d)}}]},
            "model": {"init_args": init},
            "data": {"init_args": {**self.data_common, "pool": str(self.sample_path), "validation": str(self.val_path),
                                   "tokenizer": tokenizer, "max_length": args.max_length,
                                   "batch_size": args.batch_size}},
        }, fp, d / "scores.parquet", clean=d)

    # 4. proxies ---------------------------------------------------------------------------------
    def build(self, v: dict, target: str) -> Path:
        """Variant ``v``'s proxy from ``target`` -> ``OUT/proxies/<key>`` (Layer Extraction, or IPSVD + alignment)."""
        pdir = self.out / "proxies" / dir_name(build_key(v))
        if v["kind"] == "le":
            self.build_layer_extraction(v, target, pdir)
        else:
            self.build_ipsvd(v, target, pdir)
        return pdir

    def build_layer_extraction(self, v: dict, target: str, pdir: Path) -> None:
        args, cfg = self.args, self.cfg
        fp = {"target": self.stage_fp("warmup") or target, "rho": v["rho"], "max_length": args.max_length,
              "config": config_text(cfg / "baselines" / "layer_extraction.yaml")}
        self.st.run(f"build:{build_key(v)}", "layer_extraction", [cfg / "baselines" / "layer_extraction.yaml"], {
            "model": target, "output_dir": str(pdir), "pool": args.pool, "sparsity": v["rho"],
            "max_length": args.max_length, "seed": args.seed,
        }, fp, pdir / "config.json", clean=pdir)

    def build_ipsvd(self, v: dict, target: str, pdir: Path) -> None:
        args, out, cfg = self.args, self.out, self.cfg
        cb = {"class_path": "iprox_lightning.callbacks.IPSVDCallback",
              "init_args": {"num_probe_tokens": args.num_probe_tokens, "seed": args.seed, **v["ipsvd"]}}
        trainer: dict[str, Any] = {"default_root_dir": str(out / "lightning"), "callbacks": [cb],
                                   "logger": logger_overlay(out, f"build_{dir_name(build_key(v))}")}
        model = {"target": target, "save_dir": str(pdir), "align": v["align"], "lr": v["align_lr"] or args.align_lr,
                 "kl_weight": args.kl_weight, "keep_best": True}
        data = {**self.data_common, "pool": args.pool, "tokenizer": target, "max_length": args.max_length,
                "batch_size": args.align_batch_size}
        if v["align"]:
            trainer.update(max_epochs=v["align_epochs"] or args.align_epochs, num_sanity_val_steps=0,
                           val_check_interval=args.align_val_every)
            model.update(lr_schedule="linear", warmup_ratio=0.05)
            if v["fidelity"] and v.get("fidelity_task"):  # keep_best by the worst task's fidelity
                model.update(fidelity_examples=v["fidelity"], fidelity_per_task=True, monitor="val/fidelity_worst_loss")
            elif v["fidelity"]:  # keep_best by ranking fidelity on held-out pool examples
                model.update(fidelity_examples=v["fidelity"], monitor="val/fidelity_loss")
            data.update(validation=str(self.val_path), val_per_task=args.align_val_per_task)
            # task-aware alignment (+val, +valg, +score, ...): only keys a suffix set, so the other rows'
            # fingerprints do not change
            model.update(v["task_align"]["model"])
            data.update(v["task_align"]["data"])
        else:
            trainer.update(max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
            data.update(validation=None)
            if v["ipsvd"].get("rank_weighting") == "influence":  # the weights' per-task validation examples
                data.update(validation=str(self.val_path), val_per_task=args.align_val_per_task)
        fp = {"target": self.stage_fp("warmup") or target, "callback": cb, "model": model, "data": data,
              "trainer": {k: v2 for k, v2 in trainer.items() if k not in ("logger", "default_root_dir")},
              "config": config_text(cfg / "build_proxy.yaml")}
        self.st.run(f"build:{build_key(v)}", "fit", [cfg / "build_proxy.yaml"], {
            "seed_everything": args.seed, "trainer": trainer, "model": {"init_args": model}, "data": {"init_args": data},
        }, fp, pdir / "iprox_proxy.json", clean=pdir)

    def run_stages(self, variants: list[dict], target: str) -> None:
        """The references, then each variant's build and (unless ``--build-only``) its scoring; a variant that fails
        is recorded in ``state.json`` ``errors`` and the others go on."""
        args, st = self.args, self.st
        self.score("target", target, target, self.stage_fp("warmup") if not args.no_warmup else args.model)
        for v in variants:
            try:
                pdir = self.build(v, target)
                if not args.build_only:
                    self.score(v["key"], str(pdir), target, self.stage_fp(f"build:{build_key(v)}"),
                               validation_model=target if v.get("target_validation") else None)
                st.state.get("errors", {}).pop(v["key"], None)
            except RuntimeError as e:
                self.log(f"variant {v['key']} FAILED: {e}")
                st.state.setdefault("errors", {})[v["key"]] = str(e)[-2000:]
                st.save()
        # the target as shipped, last: the second reference column (the effect of the warm-up)
        if not args.no_warmup and not args.no_unwarmed and not args.build_only:
            self.score("target_unwarmed", args.model, target, args.model)


def main(argv=None) -> dict:
    args = parse_args(argv)
    variants = [parse_variant(v) for v in args.variants]
    t_start = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t_start:7.1f}s] {m}", flush=True)  # noqa: E731
    run = FidelityRun(args, log)
    out = run.out
    target = run.warm_up()
    run.write_inputs()
    if not args.summary_only and not args.dry_run:
        run.record_command()
    if not args.summary_only:
        run.run_stages(variants, target)
    if args.dry_run or args.build_only:
        return {"would_run": run.st.ran} if args.dry_run else {"built": [v["key"] for v in variants]}

    # 5. summary ---------------------------------------------------------------------------------
    summary = build_summary(args, out, run.st, variants, run.sample_path, run.val_counts, target)
    write_outputs(out, summary)
    summary["plot"] = write_plot(out, summary)
    write_outputs(out, summary)
    if args.docs:
        splice_docs(Path(args.docs), docs_markdown(summary), *docs_markers(out))
    print(markdown(summary))
    return summary


def all_variants(listed: list[dict], state: dict) -> list[dict]:
    """The listed variants, then every variant an earlier invocation scored (kept in ``state.json``), so one
    summary holds every row measured in ``OUT`` (each row says the commit it was built at)."""
    keys = {v["key"] for v in listed}
    more = [k.removeprefix("score:") for k in state["stages"] if k.startswith("score:")]
    return listed + [parse_variant(k) for k in more if k not in keys and k not in ("target", "target_unwarmed")]


PROXY_INFO = ("params", "alignment_best", "alignment_history", "alignment_fidelity", "allocation", "mode", "damping",
              "damping_mode", "method", "health", "block_drop")


def _fidelity_facts(fid: Mapping[str, Any] | None, out: Path) -> dict | None:
    """The ranking-fidelity check of an aligned proxy (``+fid<N>``): its history and how many of its held-out pool
    examples are also in the scored sample (the check picks factors, so the overlap is reported)."""
    if not fid:
        return None
    sample = {json.loads(line)["id"] for line in (out / "sample.jsonl").read_text().splitlines() if line.strip()}
    return {"examples": fid.get("examples"), "validation_examples": fid.get("validation_examples"),
            "history": fid.get("history"), "overlap_with_sample": len(sample & set(fid.get("ids") or []))}


def _block_drop_facts(bd: Mapping[str, Any] | None) -> dict | None:
    if not bd:
        return None
    return {k: bd.get(k) for k in ("dropped", "importance", "params_dropped", "layer_budget", "layer_sparsity") if k in bd}


def proxy_info(out: Path, v: dict, build: dict, previous: dict | None) -> dict:
    """Parameters and build facts of a row's proxy: from its manifest (or, for Layer Extraction, its tensors);
    when the proxy directory is gone (weights are never kept), from the previous ``summary.json`` row whose
    build stage had the same fingerprint -- never from a different setting."""
    pdir = out / "proxies" / dir_name(build_key(v))
    man = pdir / "iprox_proxy.json"
    if man.exists():
        mj = json.loads(man.read_text())
        al = mj.get("alignment") or {}
        return {"params": mj.get("params_after"), "alignment_best": al.get("best"),
                "alignment_history": al.get("validation_history"), "allocation": mj.get("allocation"), "mode": mj.get("mode"),
                "damping": mj.get("damping"), "damping_mode": mj.get("damping_mode"), "method": mj.get("method"),
                "health": mj.get("health"), "alignment_fidelity": _fidelity_facts(al.get("fidelity"), out),
                "block_drop": _block_drop_facts(mj.get("block_drop"))}
    if v["kind"] == "le" and (pdir / "config.json").exists():
        return {"params": safetensors_param_count(pdir), "method": "layer_extraction"}
    if previous:
        old_build = previous.get("stages", {}).get(f"build:{build_key(v)}", {})
        if build.get("fingerprint") and old_build.get("fingerprint") == build["fingerprint"]:
            for r in previous.get("rows", []):
                if r["variant"] in (v["key"], build_key(v)):
                    return {k: r[k] for k in PROXY_INFO if k in r}
    return {"params": None, "method": "layer_extraction" if v["kind"] == "le" else v["ipsvd"].get("method")}


def build_summary(args, out: Path, st: Stages, variants, sample_path: Path, val_counts: dict, target: str) -> dict:
    from iprox_lightning.analysis import per_task_retention, spearman, worst_task

    variants = all_variants(variants, st.state)
    prev_path = out / "summary.json"
    previous = read_kept(prev_path) if kept(prev_path).exists() else None

    ref_path = out / "scores" / "target" / "scores.parquet"
    if not ref_path.exists():
        raise SystemExit(f"{ref_path} missing: the target has not been scored yet")
    ref = score_arrays(ref_path)
    tmap = as_map(ref)
    length = dict(zip(ref["id"], map(float, ref["n_tokens"])))
    work = out / "selections"
    work.mkdir(exist_ok=True)
    (work / "target").mkdir(exist_ok=True)
    t_sets = select_sets(ref_path, sample_path, work / "target")
    ref_max = as_map(ref, "score_max")
    cpu_target = st.state["stages"].get("score:target", {}).get("cpu_s")
    rows: list[dict] = []
    unwarmed_path = out / "scores" / "target_unwarmed" / "scores.parquet"
    unwarmed = as_map(score_arrays(unwarmed_path)) if unwarmed_path.exists() else None
    # per task: each suite's score (mean of its halves), the validation file's suite order
    t_suites = suite_scores(ref)
    held = set.intersection(*map(set, t_suites.values())) if t_suites else set()
    suites = [s for s in val_counts if s in held] + sorted(held - set(val_counts))
    boot = lambda stat, n_items: percentile_interval(stat, n_items, args.bootstrap, args.seed)  # noqa: E731

    def per_task(by_suite: Mapping[str, Mapping[str, float]]) -> dict:
        pt = per_task_retention(by_suite, t_suites, length, tasks=suites, interval=boot)
        return {"per_task": pt, "worst_task": worst_task(pt)}

    def add_row(variant: str, rho, scores: Mapping[str, float], table=None, sets=None, extra=None):
        m = row_metrics(scores, tmap, length, sets, t_sets, args.bootstrap, args.seed)
        r = {"variant": variant, "rho": rho, **m}
        # a row without per-task columns (length sort, random) ranks every suite by its one score
        r.update(per_task(suite_scores(table) if table is not None else
                          {i: dict.fromkeys(suites, v) for i, v in scores.items()}))
        if table is not None:
            pm = as_map(table, "score_max")
            ids_m = sorted(set(pm) & set(ref_max))
            r["spearman_max"] = float(spearman(np.array([pm[i] for i in ids_m]), np.array([ref_max[i] for i in ids_m])))
        if unwarmed is not None:
            ids_u = sorted(set(scores) & set(unwarmed))
            r["spearman_vs_unwarmed"] = float(spearman(np.array([scores[i] for i in ids_u]),
                                                       np.array([unwarmed[i] for i in ids_u])))
        r.update(extra or {})
        rows.append(r)
        return r

    # baselines on the same sample
    add_row("length_sort", None, {i: -v for i, v in length.items()},
            extra={"params": 0, "scoring_time_ratio": 0.0, "note": "shortest response first (model-free)"})
    rng = np.random.default_rng(args.seed)
    add_row("random", None, dict(zip(ref["id"], rng.random(len(ref["id"])))), extra={"params": 0, "scoring_time_ratio": 0.0})
    if unwarmed is not None:
        rec = st.state["stages"].get("score:target_unwarmed", {})
        t_u = score_arrays(unwarmed_path)
        (work / "target_unwarmed").mkdir(exist_ok=True)
        add_row("target_unwarmed", None, unwarmed, t_u, select_sets(unwarmed_path, sample_path, work / "target_unwarmed"),
                extra={"kind": "reference",
                       "scoring_time_ratio": rec.get("cpu_s", float("nan")) / cpu_target if cpu_target else None,
                       "note": "off-the-shelf, full size: the target as shipped (no warm-up)"})
    maps = {"length_sort": {i: -v for i, v in length.items()}}  # score maps of the rows, for the paired differences
    suite_maps = {}  # per-suite score maps of the rows, for the per-task paired differences (+tval against its proxy)
    for v in variants:
        p = out / "scores" / dir_name(v["key"]) / "scores.parquet"
        if not p.exists():
            continue
        tab = score_arrays(p)
        maps[v["key"]] = as_map(tab)
        suite_maps[v["key"]] = suite_scores(tab)
        (work / dir_name(v["key"])).mkdir(exist_ok=True)
        sets = select_sets(p, sample_path, work / dir_name(v["key"]))
        add_row(v["key"], v["rho"], maps[v["key"]], tab, sets, extra=variant_facts(args, out, st, v, previous))
    meta = summary_meta(args, st, ref, val_counts, suites, length, boot)
    return {"meta": meta, "rows": rows, "paired": paired_rows(rows, maps, tmap, length, args),
            **per_task_pairs(variants, suite_maps, t_suites, suites, args), "stages": st.state["stages"]}


def per_task_pairs(variants, suite_maps: Mapping[str, Mapping[str, Mapping[str, float]]],
                   t_suites: Mapping[str, Mapping[str, float]], suites: list[str], args) -> dict[str, list[dict]]:
    """The per-task paired differences: each ``+tval`` row against its proxy's row (``paired_per_task``), and each
    Stage-2 lever row against the row it changes, the same key without its suffixes after ``+align...``
    (``paired_levers``)."""
    def pair(a: str, b: str) -> dict:
        return {"a": a, "b": b, **{suite: task_paired_difference(suite_maps[a], suite_maps[b], t_suites, suite, args)
                                   for suite in suites}}

    return {"paired_per_task": [pair(v["key"], build_key(v)) for v in variants if v.get("target_validation")
                                and {v["key"], build_key(v)} <= set(suite_maps)],
            "paired_levers": [pair(v["key"], lever_base(v["key"])) for v in variants
                              if lever_base(v["key"]) in suite_maps and v["key"] in suite_maps]}


def task_paired_difference(a: Mapping[str, Mapping[str, float]], b: Mapping[str, Mapping[str, float]],
                           target: Mapping[str, Mapping[str, float]], suite: str, args) -> dict[str, Any]:
    """Spearman with the target's ``suite`` score of row ``a`` minus row ``b`` (per-suite score maps), with a paired
    bootstrap CI (the same examples resampled for both rows)."""
    from iprox_lightning.analysis import spearman_columns

    ids = sorted(set(a) & set(b) & set(target))
    pa, pb, t = (np.array([d[i][suite] for i in ids]) for d in (a, b, target))
    f = lambda ix: spearman_columns(pa[ix], t[ix]) - spearman_columns(pb[ix], t[ix])  # noqa: E731
    return {"spearman": float(f(np.arange(len(ids)))),
            "spearman_ci": percentile_interval(f, len(ids), args.bootstrap, args.seed)}


def variant_facts(args, out: Path, st: Stages, v: dict, previous: dict | None) -> dict:
    """A variant row's facts beside its metrics: its kind (a proxy or a baseline), alignment settings, build and
    scoring cost (CPU-seconds and wall-clock ratios to the target's scoring), and :func:`proxy_info`."""
    stages = st.state["stages"]
    rec, build = stages.get(f"score:{v['key']}", {}), stages.get(f"build:{build_key(v)}", {})
    cpu_target = stages.get("score:target", {}).get("cpu_s")
    base = "layer_extraction" if v["kind"] == "le" else ("svd" if v["ipsvd"].get("method") == "svd" and not v["align"]
                                                         and "allocation" not in v["ipsvd"] else v["key"])
    return {
        "kind": base if base in BASELINES else "proxy",
        "align_epochs": (v["align_epochs"] or args.align_epochs) if v["align"] else 0,
        "align_lr": (v["align_lr"] or args.align_lr) if v["align"] else None,
        "align_monitor": ("val/fidelity_loss" if v.get("fidelity") else "val/loss") if v["align"] else None,
        "task_align": ({k: d for k, d in v["task_align"].items() if d} or None) if v["align"] else None,
        "validation_gradients": "target" if v.get("target_validation") else "proxy",
        "built_commit": build.get("commit"), "build_wall_s": build.get("wall_s"),
        "scoring_time_ratio": rec.get("cpu_s", float("nan")) / cpu_target if cpu_target else None,
        "scoring_wall_ratio": (rec.get("wall_s", float("nan")) / stages["score:target"]["wall_s"]
                               if "score:target" in stages else None), **proxy_info(out, v, build, previous)}


def paired_rows(rows: list[dict], maps: Mapping[str, Mapping[str, float]], tmap: Mapping[str, float],
                length: Mapping[str, float], args) -> list[dict]:
    """Paired differences of every proxy row against the baseline rows at the same ρ (and the length sort)."""
    paired = []
    for r in rows:
        if r.get("kind") != "proxy":
            continue
        for b_row in rows:
            bk = b_row.get("kind") if b_row["variant"] != "length_sort" else "length_sort"
            if bk not in BASELINES or (b_row.get("rho") not in (None, r["rho"])):
                continue
            if r["variant"] in maps and b_row["variant"] in maps:
                paired.append({"a": r["variant"], "b": b_row["variant"],
                               **paired_difference(maps[r["variant"]], maps[b_row["variant"]], tmap, length,
                                                   args.bootstrap, args.seed)})
    return paired


def summary_meta(args, st: Stages, ref: Mapping[str, Any], val_counts: dict, suites: list[str],
                 length: Mapping[str, float], boot) -> dict:
    """The summary's ``meta``: the run's settings, hosts and commands, and the target's split-half ceiling (pooled,
    LESS max over each half's suites; per suite)."""
    from iprox_lightning.analysis import partial_spearman, per_task_retention, spearman

    h0, h1 = half_max(ref, HALVES[0]), half_max(ref, HALVES[1])
    ids = sorted(set(h0) & set(h1))
    a, b, c = (np.array([d[i] for i in ids]) for d in (h0, h1, length))
    hosts = recorded_hosts(st.state)
    meta = {
        "target_warmed_up": not args.no_warmup, "target": args.model, "target_name": Path(args.model).name,
        "n_scored": len(ref["id"]), "n_validation": int(sum(val_counts.values())), "validation_counts": val_counts,
        "commit": git_commit(), "max_length": args.max_length, "sample_requested": args.sample,
        "sample_strata": args.stratify_by,
        "seed": args.seed, "align_epochs": args.align_epochs, "align_lr": args.align_lr,
        "kl_weight": args.kl_weight, "num_probe_tokens": args.num_probe_tokens,
        "machine": f"stages ran on: {hosts_text(hosts)}; torch threads {args.threads or 'default'}",
        "hosts": hosts, "summary_written_on": host_info(),
        "target_split_half": {"spearman": float(spearman(a, b)) if len(ids) > 3 else float("nan"),
                              "partialled": float(partial_spearman(a, b, c)) if len(ids) > 3 else float("nan"),
                              "note": "LESS max over each validation half's suites; halves alternate within each suite"},
        "suites": suites,
        "target_split_half_per_task": per_task_retention(suite_scores(ref, HALVES[0]), suite_scores(ref, HALVES[1]),
                                                         length, tasks=suites, interval=boot),
        "target_split_half_per_task_note": "per suite: the target's scores against the suite's half0 examples vs "
                                           "its half1 examples (the per-task ceiling)",
        "errors": st.state.get("errors", {}),
        "commands": st.state.get("run_commands", []),
        "command": st.state.get("run_command") or "python bench/fidelity_v2.py " + " ".join(
            shlex.quote(a) for a in (args.argv or [])),
    }
    return meta


if __name__ == "__main__":
    main()
