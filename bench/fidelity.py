"""Proxy fidelity benchmark: how well does each proxy keep the target's influence scores, at what cost.

One run, fixed seeds. The target (by default SmolLM2-135M-Instruct, **used as is**: no warm-up
fine-tuning, which would cost too much on a CPU) scores a fixed random sample of the pool with TracIn
(and K-FAC with ``--kfac``); every proxy scores the same sample against the same validation set and is
compared with the target.

Data (:class:`~iprox_lightning.data.SFTDataModule`: chat template, prompt masked, ``prompt_left``
truncation). From one seeded permutation of the pool, three disjoint subsets:

* **probe set** — ``--probe-examples`` examples × ≤ ``--probe-length`` tokens; IPSVD probes
  (``N = --tokens`` columns per layer, :func:`~iprox_lightning.probes.collect_probes`, collected ONCE
  on the target and reused by every IPSVD variant) and the Layer-Extraction block importances;
* **alignment set** — ``--align-examples`` examples × ≤ ``--align-length`` tokens (Stage 2);
* **scored sample** — ``--sample`` examples × ≤ ``--max-length`` tokens.

Validation: ``--val-per-task`` examples per task of ``--validation`` (default ``eval:<shared>/data/eval``:
BBH, MMLU, TyDiQA), ≤ ``--val-max-length`` tokens. Its examples are split into two halves (alternating
within each task) so that one scoring pass also yields the scores against each half: the Spearman between
the target's two half-scores is the *validation-set noise level* of the reference itself.

Variants (``--variants``; grammar ``METHOD[/MODE[/abs|relDAMPING]]@RHO[+align][+nokl]``):

* ``ipsvd@ρ`` — IPSVD (Stage 1) with the default mode/damping of
  :func:`~iprox_lightning.compress.compress_model` (``ipsvd/core@ρ``, ``ipsvd/exact@ρ`` pick the mode,
  ``ipsvd/core/rel1e-3@ρ`` also the damping: ``abs`` = absolute, ``rel`` = relative to the mean eigenvalue);
* ``svd@ρ`` — plain truncated-SVD initialisation; ``random@ρ`` — random factors;
* ``+align`` — then Stage 2 (:func:`~iprox_lightning.alignment.alignment_losses`: gradient alignment
  + ``--kl-weight`` · KL, τ = 2) for ``--align-steps`` AdamW steps on the ``A``/``B`` factors only;
  ``+nokl`` sets the KL weight to 0;
* ``le@ρ`` — Layer Extraction (:func:`~iprox_lightning.baselines.layer_extraction.layer_extraction_proxy`):
  drop the ``ρ`` share of decoder blocks least important on the probe set.

Per row (definitions):

* ``spearman``, ``kendall``, ``pearson``, ``top5%``, ``top10%`` — :func:`retention_metrics` of the
  proxy's TracIn scores (``cos(g(z), ḡ_val)``, :func:`~iprox_lightning.scoring.tracin_scores`; a
  proxy's tracked parameters are its ``A``/``B`` factors) against the target's;
  ``spearman_ci`` — percentile 95% bootstrap interval over the scored examples (``--bootstrap`` resamples);
* ``params`` — parameters of the proxy (all, embeddings included); ``tracked_params`` — dimension of its
  per-example gradient;
* ``flops`` — analytic FLOPs per stage (:mod:`iprox_lightning.analysis.flops`, mean real sequence lengths):
  ``probe`` (IPSVD: target fwd+bwd on the probe set + the factorisations; SVD: the SVDs; Layer Extraction:
  the target forward for the importances), ``alignment``, ``scoring`` (sample + validation);
* ``time_s`` — wall-clock per stage: ``probe`` (the shared probe collection, charged to every IPSVD
  variant), ``factors``, ``alignment``, ``scoring``; ``peak_mib`` — peak resident memory of the process in
  each stage (CPU: ``VmHWM``, reset per stage; it includes the target held in memory);
* ``scoring_ratio`` — proxy scoring wall-clock / target scoring wall-clock.

Outputs under ``--out DIR``: ``fidelity.json`` (rewritten after every row; ``--resume`` keeps finished
rows), ``fidelity.md`` (tables), ``scatter_<variant>.png`` and ``retention_vs_sparsity.png``.
The command of ``docs/BENCHMARKS.md``::

    python bench/fidelity.py --out bench/results/fidelity --threads 2 --sample 256 --max-length 128 --kfac

The built-in offline model and data (seconds)::

    python bench/fidelity.py --model builtin --pool builtin --validation builtin --tokenizer builtin \\
        --sample 24 --probe-examples 8 --align-examples 8 --tokens 64 --max-length 64 --probe-length 64 \\
        --align-length 64 --align-steps 2 --out /tmp/fidelity
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader

from iprox_lightning.analysis.flops import (
    ModelShape,
    alignment_flops,
    probe_flops,
    scoring_flops,
    svd_flops,
)
from iprox_lightning.analysis.retention import partial_spearman as retention_partial_spearman
from iprox_lightning.analysis.retention import retention_metrics, spearman
from iprox_lightning.batch import token_counts
from iprox_lightning.compress import DEFAULT_DAMPING, DEFAULT_DAMPING_MODE, DEFAULT_MODE, compress_model, count_parameters, lowrank_layers
from iprox_lightning.data import SFTDataModule
from iprox_lightning.target_layers import find_target_linears
from iprox_lightning.probes import collect_probes
from iprox_lightning.scoring import influence_scores

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ipsvd_sweep import DEFAULT_MODEL, DEFAULT_POOL, DEFAULT_VALIDATION, load_target  # noqa: E402
from stage_timer import StageTimer  # noqa: E402


# priority order: a run cut short still has the most important rows
DEFAULT_VARIANTS = [
    "ipsvd@0.5", "svd@0.5", "le@0.5",                       # (1) the headline comparison
    "ipsvd@0.5+align",                                      # (2) Stage 2 with KL
    "ipsvd@0.3", "ipsvd@0.7", "le@0.3", "le@0.7",           # (3) other sparsities
    f"ipsvd/{'core' if DEFAULT_MODE == 'exact' else 'exact'}@0.5",  # (4) the other IPSVD mode
    "ipsvd@0.5+align+nokl", "svd@0.5+align", "random@0.5", "random@0.5+align",  # (5) ablations
    "ipsvd@0.3+align", "ipsvd@0.7+align",                   # (6) Stage 2 at the other sparsities
    f"ipsvd/{'core' if DEFAULT_MODE == 'exact' else 'exact'}@0.5+align",
    "ipsvd/core/abs1e-3@0.5", "ipsvd/core/rel1e-3@0.5", "ipsvd/exact/rel1e-2@0.5",  # (7) damping settings of the sweep
]
METHODS = ("ipsvd", "svd", "random", "le")
SPEC_RE = re.compile(r"^(?P<method>[a-z]+)(?:/(?P<mode>[a-z]+))?(?:/(?P<dmode>abs|rel)(?P<damping>[0-9.]+(?:e-?[0-9]+)?))?"
                     r"@(?P<rho>[0-9.]+)(?P<flags>(?:\+[a-z]+)*)$")
DAMPING_MODES = {"abs": "absolute", "rel": "relative"}
HALVES = ("half0", "half1")


# ------------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One proxy to build: ``method`` (ipsvd|svd|random|le), IPSVD ``mode``, sparsity ``rho``,
    Stage-2 ``align`` and whether its loss keeps the KL term (``kl``)."""

    method: str
    rho: float
    mode: str | None = None
    align: bool = False
    kl: bool = True
    damping: float | None = None  # None: the run's --damping / --damping-mode
    damping_mode: str | None = None

    @property
    def key(self) -> str:
        k = self.method + (f"/{self.mode}" if self.mode else "")
        if self.damping is not None:
            k += f"/{self.damping_mode[:3]}{self.damping:g}"
        k += f"@{self.rho:g}"
        if self.align:
            k += "+align" + ("" if self.kl else "+nokl")
        return k


def parse_variant(spec: str, default_mode: str = DEFAULT_MODE) -> Variant:
    """``METHOD[/MODE[/abs|relDAMPING]]@RHO[+align][+nokl]`` -> :class:`Variant` (IPSVD's mode defaults
    to ``default_mode``, its damping to the run's ``--damping``/``--damping-mode``), e.g.
    ``ipsvd/core/rel1e-3@0.5+align``."""
    m = SPEC_RE.match(spec.strip())
    if not m:
        raise ValueError(f"variant {spec!r}: expected METHOD[/MODE[/abs|relDAMPING]]@RHO[+align][+nokl], "
                         "e.g. 'ipsvd/core@0.5+align' or 'ipsvd/exact/rel1e-2@0.5'")
    method, mode, flags = m["method"], m["mode"], [f for f in m["flags"].split("+") if f]
    if method not in METHODS:
        raise ValueError(f"variant {spec!r}: method must be one of {METHODS}, got {method!r}")
    rho = float(m["rho"])
    if not 0 < rho < 1:
        raise ValueError(f"variant {spec!r}: sparsity must be in (0, 1), got {rho}")
    bad = [f for f in flags if f not in ("align", "nokl")]
    if bad:
        raise ValueError(f"variant {spec!r}: unknown flag(s) {bad}; allowed: +align, +nokl")
    if "nokl" in flags and "align" not in flags:
        raise ValueError(f"variant {spec!r}: +nokl only makes sense with +align")
    if method == "ipsvd":
        mode = mode or default_mode
        if mode not in ("core", "exact"):
            raise ValueError(f"variant {spec!r}: IPSVD mode must be core or exact, got {mode!r}")
    elif mode or m["dmode"]:
        raise ValueError(f"variant {spec!r}: only ipsvd takes a /MODE or a damping")
    if method == "le" and "align" in flags:
        raise ValueError(f"variant {spec!r}: Layer Extraction has no low-rank factors to align")
    damping = float(m["damping"]) if m["dmode"] else None
    return Variant(method=method, rho=rho, mode=mode, align="align" in flags, kl="nokl" not in flags,
                   damping=damping, damping_mode=DAMPING_MODES[m["dmode"]] if m["dmode"] else None)


def damping_of(v: Variant, args) -> float:
    return args.damping if v.damping is None else v.damping


def damping_mode_of(v: Variant, args) -> str:
    return args.damping_mode if v.damping_mode is None else v.damping_mode


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
class HalvesLoader:
    """The validation batches with ``task`` replaced by ``half0``/``half1``, alternating within each
    original task (deterministic: the loader is not shuffled). Scoring with ``per_task=True`` then gives,
    in one pass, the score against all validation examples and against each half."""

    def __init__(self, loader: Iterable[Mapping]):
        self.loader = loader

    def __iter__(self) -> Iterator[dict]:
        seen: dict[str, int] = {}
        for b in self.loader:
            tasks = b.get("task") or ["all"] * len(b["id"])
            halves = []
            for t in tasks:
                halves.append(HALVES[seen.get(t, 0) % 2])
                seen[t] = seen.get(t, 0) + 1
            yield {**b, "task": halves}

    def __len__(self) -> int:
        return len(self.loader)


def mean_length(loader: Iterable[Mapping]) -> tuple[int, float]:
    """(examples, mean real tokens per example) of a loader."""
    n, tok = 0, 0
    for b in loader:
        n += b["input_ids"].shape[0]
        tok += int(b["attention_mask"].sum())
    return n, tok / max(n, 1)


def build_data(args, tokenizer) -> dict[str, Any]:
    dm = SFTDataModule(pool=args.pool, validation=args.validation, tokenizer=tokenizer,
                       max_length=args.val_max_length, val_per_task=args.val_per_task,
                       eval_batch_size=args.batch_size, seed=args.seed, builtin_size=args.builtin_size)
    pool = dm.pool_records
    p, a, s = args.probe_examples, args.align_examples, args.sample
    if p + a + s > len(pool):
        raise ValueError(f"pool {args.pool} has {len(pool)} examples; the benchmark needs {p + a + s} "
                         f"(probe {p} + align {a} + sample {s})")
    perm = np.random.default_rng(args.seed).permutation(len(pool))
    take = lambda i, j: [pool[int(k)] for k in perm[i:j]]  # noqa: E731
    val = dm.validation_dataloader()
    data = dict(
        probe=dm.records_dataloader(take(0, p), args.probe_length, args.probe_batch_size),
        align=dm.records_dataloader(take(p, p + a), args.align_length, args.align_batch_size) if a else None,
        sample=dm.records_dataloader(take(p + a, p + a + s), args.max_length, args.batch_size),
        validation=HalvesLoader(val),
        validation_tasks=list(dm.validation_tasks),
    )
    data["sizes"] = {k: mean_length(data[k]) for k in ("probe", "align", "sample", "validation") if data[k] is not None}
    return data


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
def partial_spearman(proxy: Mapping[str, float], target: Mapping[str, float], control: Mapping[str, float]) -> float:
    """:func:`iprox_lightning.analysis.retention.partial_spearman` over the ids the three maps share
    (``control`` = response length: retention that length alone does not explain)."""
    ids = sorted(set(proxy) & set(target) & set(control))
    if len(ids) < 4:
        return float("nan")
    return retention_partial_spearman(*(np.array([d[i] for i in ids]) for d in (proxy, target, control)))


def bootstrap_partial_spearman(proxy: Mapping[str, float], target: Mapping[str, float], control: Mapping[str, float],
                               n: int = 1000, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% bootstrap interval of :func:`partial_spearman` (resampling the scored examples)."""
    ids = sorted(set(proxy) & set(target) & set(control))
    if len(ids) < 4:
        return float("nan"), float("nan")
    p, t, c = (np.array([d[i] for i in ids]) for d in (proxy, target, control))
    return percentile_interval(lambda idx: retention_partial_spearman(p[idx], t[idx], c[idx]), len(ids), n, seed)


def trivial_baselines(loader: Iterable[Mapping], target: Mapping[str, float], n_boot: int, seed: int) -> dict:
    """Retention of model-free rankings (by length) against the target: the floor a proxy must beat.
    Both signs are reported (long-first and short-first)."""
    out = {}
    feats = token_counts(loader)
    out["_features"] = feats
    for name, feat in feats.items():
        for sign, label in ((1.0, "longest first"), (-1.0, "shortest first")):
            f = {k: sign * v for k, v in feat.items()}
            m = retention(f, target)
            m["spearman_ci"] = bootstrap_spearman(f, target, n_boot, seed)
            out[f"{name}, {label}"] = m
    return out


def score(model, data, args, method: str = "tracin") -> dict[str, Any]:
    """Scores of the sample (``id -> score``) and against each validation half."""
    kw = dict(metric=method, per_task=True, progress=args.progress)
    if method == "kfac":
        kw.update(damping=args.kfac_damping, damping_mode="relative", kfac_examples=len(data["sample"].dataset))
    table = influence_scores(model, data["sample"], data["validation"], **kw)
    ids = [str(i) for i in table]
    names = list(table.task_names)
    halves = {}
    for h in HALVES:
        if h in names:
            col = np.asarray(table.task_scores)[:, names.index(h)]
            halves[h] = {i: float(v) for i, v in zip(ids, col)}
    return dict(scores={i: float(table[i]) for i in ids}, halves=halves)


def split_half_spearman(halves: Mapping[str, Mapping[str, float]]) -> float:
    """Spearman between the scores against the two disjoint validation halves (``nan`` if one is missing)."""
    if not all(h in halves for h in HALVES):
        return float("nan")
    ids = sorted(halves[HALVES[0]])
    return spearman(np.array([halves[HALVES[0]][i] for i in ids]), np.array([halves[HALVES[1]][i] for i in ids]))


def percentile_interval(statistic, n_items: int, n: int, seed: int) -> tuple[float, float]:
    """Percentile 95% bootstrap interval of ``statistic(idx)`` over ``n`` resamples ``idx`` of
    ``range(n_items)`` with replacement (non-finite values are dropped; NaNs if none is left)."""
    if n <= 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    vals = [v for v in (statistic(rng.integers(0, n_items, n_items)) for _ in range(n)) if math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_spearman(proxy: Mapping[str, float], target: Mapping[str, float], n: int = 1000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile 95% bootstrap interval of Spearman (resampling the scored examples with replacement)."""
    ids = sorted(set(proxy) & set(target))
    if len(ids) < 3:
        return float("nan"), float("nan")
    p, t = (np.array([d[i] for i in ids]) for d in (proxy, target))
    return percentile_interval(lambda idx: spearman(p[idx], t[idx]), len(ids), n, seed)


def paired_bootstrap_difference(a: Mapping[str, float], b: Mapping[str, float], target: Mapping[str, float],
                                n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``Spearman(a, target) − Spearman(b, target)`` and its percentile 95% interval, resampling the
    *same* examples for both proxies (paired), so the shared sample noise cancels."""
    ids = sorted(set(a) & set(b) & set(target))
    pa, pb, t = (np.array([d[i] for i in ids]) for d in (a, b, target))
    diff = spearman(pa, t) - spearman(pb, t)
    if len(ids) < 3:
        return float(diff), float("nan"), float("nan")
    lo, hi = percentile_interval(lambda idx: spearman(pa[idx], t[idx]) - spearman(pb[idx], t[idx]), len(ids), n, seed)
    return float(diff), lo, hi


# (a, b, question): rows of the paired-difference table, where both variants ran
COMPARISONS = [
    ("ipsvd/{m}@0.5", "svd@0.5", "IPSVD vs SVD init (ρ = 0.5)"),
    ("ipsvd/{m}@0.5", "le@0.5", "IPSVD vs Layer Extraction (ρ = 0.5)"),
    ("ipsvd/{m}@0.5+align", "le@0.5", "IProX (aligned) vs Layer Extraction (ρ = 0.5)"),
    ("ipsvd/{m}@0.5+align", "ipsvd/{m}@0.5", "alignment gain, IPSVD init (ρ = 0.5)"),
    ("ipsvd/{m}@0.5+align", "ipsvd/{m}@0.5+align+nokl", "KL term in the alignment (ρ = 0.5)"),
    ("ipsvd/{m}@0.5+align+nokl", "ipsvd/{m}@0.5", "alignment without KL vs none (ρ = 0.5)"),
    ("ipsvd/{m}@0.5+align", "svd@0.5+align", "IPSVD vs SVD init, both aligned (ρ = 0.5)"),
    ("svd@0.5+align", "svd@0.5", "alignment gain, SVD init (ρ = 0.5)"),
    ("random@0.5+align", "random@0.5", "alignment gain, random init (ρ = 0.5)"),
    ("ipsvd/core@0.5", "ipsvd/exact@0.5", "IPSVD core vs exact (ρ = 0.5)"),
    ("ipsvd/core@0.5+align", "ipsvd/exact@0.5+align", "IPSVD core vs exact, aligned (ρ = 0.5)"),
    ("ipsvd/{m}@0.3", "le@0.3", "IPSVD vs Layer Extraction (ρ = 0.3)"),
    ("ipsvd/{m}@0.3+align", "le@0.3", "IProX (aligned) vs Layer Extraction (ρ = 0.3)"),
    ("ipsvd/{m}@0.7", "le@0.7", "IPSVD vs Layer Extraction (ρ = 0.7)"),
    ("ipsvd/{m}@0.7+align", "le@0.7", "IProX (aligned) vs Layer Extraction (ρ = 0.7)"),
]


def paired_differences(result: Mapping, n: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """The :data:`COMPARISONS` whose two rows exist, with paired-bootstrap intervals."""
    mode = result.get("defaults", {}).get("ipsvd_mode", DEFAULT_MODE)
    rows = {r["key"]: r for r in result["rows"]}
    out = []
    for a, b, question in COMPARISONS:
        a, b = a.format(m=mode), b.format(m=mode)
        if a in rows and b in rows:
            d, lo, hi = paired_bootstrap_difference(rows[a]["proxy_scores"], rows[b]["proxy_scores"],
                                                    result["target_scores"], n, seed)
            out.append(dict(a=a, b=b, question=question, diff=d, lo=lo, hi=hi))
    return out


def align_proxy(teacher, proxy, loader, args, kl_weight: float, log) -> dict[str, Any]:
    """Stage 2: ``--align-steps`` AdamW steps (lr ``--lr``, wd 0.01) on the proxy's A/B factors only."""
    from iprox_lightning.alignment import alignment_losses

    params = [p for m in lowrank_layers(proxy).values() for p in (m.A, m.B)]
    for p in proxy.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    teacher.eval()
    proxy.eval()
    hist = []
    step = 0
    while step < args.align_steps:
        for batch in loader:
            if step >= args.align_steps:
                break
            out = alignment_losses(teacher, proxy, batch, kl_weight=kl_weight, temperature=2.0)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            ca, cb = out.mean_cosines()
            hist.append(dict(step=step, loss=float(out.loss.detach()), l_ga=float(out.l_ga), l_kl=float(out.l_kl),
                             cos_a=float(ca), cos_b=float(cb), proxy_sft=float(out.proxy_sft)))
            if step % max(1, args.align_steps // 5) == 0 or step == args.align_steps - 1:
                log(f"    align step {step:3d}: L={hist[-1]['loss']:.4f} L_GA={hist[-1]['l_ga']:.4f} "
                    f"L_KL={hist[-1]['l_kl']:.4f} cos_A={hist[-1]['cos_a']:.3f} cos_B={hist[-1]['cos_b']:.3f}")
            step += 1
    for p in params:
        p.requires_grad_(True)
    first, last = hist[0], hist[-1]
    return dict(steps=len(hist), first=first, last=last,
                mean_first5={k: float(np.mean([h[k] for h in hist[:5]])) for k in ("l_ga", "l_kl", "cos_a", "cos_b")},
                mean_last5={k: float(np.mean([h[k] for h in hist[-5:]])) for k in ("l_ga", "l_kl", "cos_a", "cos_b")})


def factor_svd_flops(proxy) -> float:
    return float(sum(svd_flops(m.out_features, m.in_features) for m in lowrank_layers(proxy).values()))


def stage_flops(v: Variant, target_shape: ModelShape, proxy, data, n_probe_vectors: int, align_examples: int) -> dict:
    """Analytic FLOPs per stage (see the module docstring), at the mean real sequence length of each set."""
    shape = ModelShape.from_model(proxy)
    n_probe, l_probe = data["sizes"]["probe"]
    n_s, l_s = data["sizes"]["sample"]
    n_v, l_v = data["sizes"]["validation"]
    seq = lambda x: max(1, int(round(x)))  # noqa: E731
    if v.method == "ipsvd":
        probe = probe_flops(target_shape, shape, n_examples=n_probe, seq_len=seq(l_probe), n_vectors=n_probe_vectors)["total"]
    elif v.method == "svd":
        probe = factor_svd_flops(proxy)
    elif v.method == "le":
        probe = target_shape.forward_flops(n_probe, seq(l_probe))["total"]
    else:
        probe = 0.0
    align = 0.0
    if v.align:
        _, l_a = data["sizes"]["align"]
        align = alignment_flops(target_shape, shape, n_examples=align_examples, seq_len=seq(l_a))["total"]
    scoring = (scoring_flops(shape, n_train=n_s, n_val=0, seq_len=seq(l_s))["total"]
               + scoring_flops(shape, n_train=0, n_val=n_v, seq_len=seq(l_v))["total"])
    return dict(probe=probe, alignment=align, scoring=scoring, total=probe + align + scoring)


def target_scoring_flops(target_shape: ModelShape, data) -> float:
    n_s, l_s = data["sizes"]["sample"]
    n_v, l_v = data["sizes"]["validation"]
    return (scoring_flops(target_shape, n_train=n_s, n_val=0, seq_len=max(1, round(l_s)))["total"]
            + scoring_flops(target_shape, n_train=0, n_val=n_v, seq_len=max(1, round(l_v)))["total"])


def retention(proxy: Mapping[str, float], target: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in retention_metrics(proxy, target).items()}


def interleaved_timing(target, proxies: Mapping[str, torch.nn.Module], batch: Mapping, val_batch: Mapping,
                       repeats: int = 3) -> dict[str, dict[str, float]]:
    """Scoring cost per training batch, proxy vs target, robust to a shared machine's changing load.

    Each model's :class:`~iprox_lightning.scoring.InfluenceScorer` is fitted on ``val_batch``; then
    ``score_batch(batch)`` is timed ``repeats`` times per model, the models taking turns within each
    repeat (target, proxy 1, proxy 2, …), after one untimed warm-up call each. Returns, per proxy,
    the median wall-clock and process CPU seconds of the target and the proxy and their ratios.
    """
    from iprox_lightning.scoring import InfluenceScorer, ScoringConfig

    models = {"target": target, **proxies}
    scorers = {}
    for name, m in models.items():
        sc = InfluenceScorer(m, ScoringConfig(per_task=False))
        sc.fit([val_batch])
        sc.score_batch(batch)  # warm-up
        scorers[name] = sc
    wall: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(repeats):
        for name, sc in scorers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            sc.score_batch(batch)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    out = {}
    for name in proxies:
        out[name] = dict(target_wall_s=med(wall["target"]), proxy_wall_s=med(wall[name]),
                         wall_ratio=med(wall[name]) / med(wall["target"]),
                         target_cpu_s=med(cpu["target"]), proxy_cpu_s=med(cpu[name]),
                         cpu_ratio=med(cpu[name]) / med(cpu["target"]), repeats=repeats,
                         batch_examples=int(batch["input_ids"].shape[0]),
                         batch_tokens=int(batch["attention_mask"].sum()))
    return out


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------
def _f(v, fmt: str) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _mib(b) -> str:
    return "–" if b is None else f"{b / 2**20:.0f}"


def markdown(result: Mapping) -> str:
    """Retention table, cost table and (if run) the K-FAC table."""
    t = result["target"]
    rows = result["rows"]
    out = [f"Target: {t['name']} ({t['params']:,} parameters), used as is. Scored sample: {t['sample']} pool examples "
           f"(≤ {result['args']['max_length']} tokens); validation: {t['validation']} examples "
           f"({', '.join(t['validation_tasks'])}). Target TracIn scoring: {t['scoring_s']:.1f} s. "
           f"Reference noise: Spearman between the target's scores against two disjoint validation halves = "
           f"{_f(t['split_half_spearman'], '{:+.3f}')}.\n",
           "**Retention** (proxy TracIn vs target TracIn; 95% bootstrap CI of Spearman over the scored examples)\n",
           "| variant | ρ | Spearman | 95% CI | Kendall | top-5% | top-10% | Pearson | split-half ρ_s | "
           "Spearman, length partialled out [95% CI] |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    lengths = result.get("trivial", {}).get("_features", {}).get("response_tokens")
    n_boot, seed = result["args"].get("bootstrap", 1000), result["args"].get("seed", 0)

    def partial(scores, ref):
        if not lengths:
            return "–"
        v = partial_spearman(scores, ref, lengths)
        lo, hi = bootstrap_partial_spearman(scores, ref, lengths, n_boot, seed)
        return f"{_f(v, '{:+.3f}')} [{_f(lo, '{:+.2f}')}, {_f(hi, '{:+.2f}')}]"

    for r in rows:
        lo, hi = r["spearman_ci"]
        part = partial(r["proxy_scores"], result["target_scores"])
        out.append(f"| {r['key']} | {r['rho']:g} | {_f(r['spearman'], '{:+.3f}')} | [{_f(lo, '{:+.2f}')}, {_f(hi, '{:+.2f}')}] | "
                   f"{_f(r['kendall'], '{:+.3f}')} | {_f(r['top5%'], '{:.2f}')} | {_f(r['top10%'], '{:.2f}')} | "
                   f"{_f(r['pearson'], '{:+.3f}')} | {_f(r['split_half_spearman'], '{:+.3f}')} | {part} |")
    out += ["", "**Cost** (wall-clock s per stage; analytic TFLOPs; peak RSS MiB of the process; scoring ratio = "
            "proxy / target scoring wall-clock)\n",
            "| variant | params | % of target | probe s | factors s | align s | scoring s | scoring ratio | "
            "TFLOP probe | TFLOP align | TFLOP scoring | FLOP ratio scoring | peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out.append(f"| target | {t['params']:,} | 100% | – | – | – | {t['scoring_s']:.1f} | 1.00 | – | – | "
               f"{t['flops_scoring'] / 1e12:.2f} | 1.00 | {_mib(t['peak_bytes'])} |")
    for r in rows:
        ts, fl = r["time_s"], r["flops"]
        peak = max((b for b in r["peak_bytes"].values() if b is not None), default=None)
        out.append(f"| {r['key']} | {r['params']:,} | {100 * r['params'] / t['params']:.0f}% | {ts['probe']:.1f} | "
                   f"{ts['factors']:.1f} | {ts['alignment']:.1f} | {ts['scoring']:.1f} | {r['scoring_ratio']:.2f} | "
                   f"{fl['probe'] / 1e12:.2f} | {fl['alignment'] / 1e12:.2f} | {fl['scoring'] / 1e12:.2f} | "
                   f"{fl['scoring'] / t['flops_scoring']:.2f} | {_mib(peak)} |")
    if result.get("trivial"):
        out += ["", "**Model-free floor** (rank the sample by length alone; retention against the target's TracIn)\n",
                "| ranking | Spearman | 95% CI | Kendall | top-5% | top-10% |", "|---|---|---|---|---|---|"]
        for name, m in result["trivial"].items():
            if name.startswith("_"):
                continue
            lo, hi = m["spearman_ci"]
            out.append(f"| {name} | {_f(m['spearman'], '{:+.3f}')} | [{_f(lo, '{:+.2f}')}, {_f(hi, '{:+.2f}')}] | "
                       f"{_f(m['kendall'], '{:+.3f}')} | {_f(m['top5%'], '{:.2f}')} | {_f(m['top10%'], '{:.2f}')} |")
    pairs = paired_differences(result, n=2 * result["args"].get("bootstrap", 1000), seed=result["args"].get("seed", 0))
    if pairs:
        out += ["", "**Paired differences** (Spearman(a) − Spearman(b) against the target, paired bootstrap over the "
                "same examples, 95% interval; * = interval excludes 0)\n",
                "| question | a | b | Δ Spearman | 95% CI |", "|---|---|---|---|---|"]
        for q in pairs:
            sig = " *" if math.isfinite(q["lo"]) and (q["lo"] > 0 or q["hi"] < 0) else ""
            out.append(f"| {q['question']} | {q['a']} | {q['b']} | {q['diff']:+.3f}{sig} | "
                       f"[{_f(q['lo'], '{:+.2f}')}, {_f(q['hi'], '{:+.2f}')}] |")
    aligned = [r for r in rows if r.get("alignment")]
    if aligned:
        out += ["", "**Alignment** (mean of the first / last 5 steps)\n",
                "| variant | steps | L_GA first → last | L_KL first → last | cos_A first → last | cos_B first → last |",
                "|---|---|---|---|---|---|"]
        for r in aligned:
            a, b = r["alignment"]["mean_first5"], r["alignment"]["mean_last5"]
            out.append(f"| {r['key']} | {r['alignment']['steps']} | {a['l_ga']:.4f} → {b['l_ga']:.4f} | "
                       f"{a['l_kl']:.4f} → {b['l_kl']:.4f} | {a['cos_a']:.3f} → {b['cos_a']:.3f} | "
                       f"{a['cos_b']:.3f} → {b['cos_b']:.3f} |")
    if result.get("timing"):
        tm = result["timing"]
        out += ["", f"**Scoring-time ratio proxy / target, interleaved** ({tm['note']})\n",
                "| proxy shape | params | wall s target | wall s proxy | wall ratio | CPU s target | CPU s proxy | CPU ratio |",
                "|---|---|---|---|---|---|---|---|"]
        for key, m in tm["rows"].items():
            out.append(f"| {key} | {m['params']:,} | {m['target_wall_s']:.2f} | {m['proxy_wall_s']:.2f} | "
                       f"{m['wall_ratio']:.2f} | {m['target_cpu_s']:.2f} | {m['proxy_cpu_s']:.2f} | {m['cpu_ratio']:.2f} |")
    if result.get("kfac"):
        kt = result["kfac_target"]
        out += ["", f"**K-FAC** (proxy K-FAC vs target K-FAC; target K-FAC vs target TracIn: Spearman "
                f"{kt['vs_tracin']['spearman']:+.3f}; target K-FAC scoring {kt['scoring_s']:.1f} s)\n",
                "| variant | Spearman | 95% CI | Kendall | top-5% | top-10% | scoring s | Spearman, length partialled out [95% CI] |",
                "|---|---|---|---|---|---|---|---|"]
        for key, m in result["kfac"].items():
            lo, hi = m["spearman_ci"]
            ks = m.get("proxy_scores")
            out.append(f"| {key} | {m['spearman']:+.3f} | [{_f(lo, '{:+.2f}')}, {_f(hi, '{:+.2f}')}] | "
                       f"{m['kendall']:+.3f} | {m['top5%']:.2f} | {m['top10%']:.2f} | {m['scoring_s']:.1f} | "
                       f"{partial(ks, result['kfac_target_scores']) if ks else '–'} |")
    return "\n".join(out) + "\n"


def write_outputs(out_dir: Path | None, result: dict) -> None:
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "fidelity.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out_dir / "fidelity.json")
    (out_dir / "fidelity.md").write_text(markdown(result))


def write_plots(out_dir: Path | None, result: dict, dpi: int = 80) -> list[str]:
    """One scatter per row and retention-vs-sparsity for every variant family with ≥ 2 sparsities."""
    if out_dir is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from iprox_lightning.analysis.plots import plot_retention_vs_sparsity, plot_score_scatter, save_figure

    files = []
    ref = result["target_scores"]
    for r in result["rows"]:
        name = "scatter_" + re.sub(r"[^A-Za-z0-9._-]+", "_", r["key"]) + ".png"
        fig = plot_score_scatter(r["proxy_scores"], ref, frac=0.05, proxy_name=r["key"], target_name="target")
        save_figure(fig, out_dir / name, dpi=dpi)
        plt.close(fig)
        files.append(name)
    series: dict[str, dict[float, dict]] = {}
    for r in result["rows"]:  # one series per variant family: "ipsvd/core", "ipsvd/core+align", "le", ...
        series.setdefault(re.sub(r"@[0-9.]+", "", r["key"]), {})[r["rho"]] = r
    series = {k: v for k, v in series.items() if len(v) >= 2}
    if series:
        fig = plot_retention_vs_sparsity(series, metrics=("spearman", "top5%"))
        save_figure(fig, out_dir / "retention_vs_sparsity.png", dpi=dpi)
        plt.close(fig)
        files.append("retention_vs_sparsity.png")
    return files


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="target: .gguf, hub id, directory or 'builtin'")
    ap.add_argument("--tokenizer", default=None, help="default: the model's tokenizer")
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--validation", default=DEFAULT_VALIDATION)
    ap.add_argument("--builtin-size", type=int, default=400, help="pool size when --pool builtin")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    help="METHOD[/MODE]@RHO[+align][+nokl], run in this order (default: priority order)")
    ap.add_argument("--sample", type=int, default=128, help="pool examples scored")
    ap.add_argument("--max-length", type=int, default=128, help="tokens per scored example")
    ap.add_argument("--val-per-task", type=int, default=4)
    ap.add_argument("--val-max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="scoring batch size")
    ap.add_argument("--probe-examples", type=int, default=8)
    ap.add_argument("--probe-length", type=int, default=256)
    ap.add_argument("--probe-batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="probe columns N per layer")
    ap.add_argument("--damping", type=float, default=DEFAULT_DAMPING, help="IPSVD damping")
    ap.add_argument("--damping-mode", default=DEFAULT_DAMPING_MODE)
    ap.add_argument("--align-examples", type=int, default=64)
    ap.add_argument("--align-length", type=int, default=128)
    ap.add_argument("--align-batch-size", type=int, default=2)
    ap.add_argument("--align-steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--kl-weight", type=float, default=0.1)
    ap.add_argument("--kfac", action="store_true", help="also K-FAC scores of the target and of --kfac-variants")
    ap.add_argument("--kfac-variants", nargs="+", default=["ipsvd@0.5", "svd@0.5", "le@0.5", "ipsvd@0.5+align"])
    ap.add_argument("--kfac-damping", type=float, default=1e-3, help="K-FAC scoring damping (relative)")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the Spearman CI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--progress", action="store_true", help="tqdm bars while scoring")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", default=None, help="output directory (fidelity.json, fidelity.md, PNGs)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in OUT/fidelity.json")
    ap.add_argument("--timing-only", action="store_true",
                    help="only the interleaved proxy/target scoring-time measurement of --timing-variants, merged "
                         "into OUT/fidelity.json (proxy shapes only matter: SVD/IPSVD factors are replaced by random ones)")
    ap.add_argument("--timing-variants", nargs="+", default=["random@0.3", "random@0.5", "random@0.7", "le@0.5"])
    ap.add_argument("--timing-repeats", type=int, default=3)
    ap.add_argument("--timing-examples", type=int, default=4, help="examples in the timed training batch")
    ap.add_argument("--plots-only", action="store_true", help="only (re)write the Markdown and plots of OUT/fidelity.json")
    ap.add_argument("--fail-fast", action="store_true", help="raise on the first failing variant (default: record and go on)")
    args = ap.parse_args(argv)
    args.parsed_variants = [parse_variant(s) for s in args.variants]
    args.parsed_kfac = [parse_variant(s) for s in args.kfac_variants] if args.kfac else []
    if any(v.align for v in args.parsed_variants) and args.align_examples < 1:
        ap.error("aligned variants need --align-examples >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out) if args.out else None
    if args.plots_only:
        if out_dir is None or not (out_dir / "fidelity.json").exists():
            raise SystemExit("--plots-only needs --out DIR holding fidelity.json")
        result = json.loads((out_dir / "fidelity.json").read_text())
        result["plots"] = write_plots(out_dir, result)
        write_outputs(out_dir, result)
        print(markdown(result))
        return result
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731

    target, tok = load_target(args.model)
    if args.tokenizer is not None:
        from iprox_lightning.models.loading import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    target_shape = ModelShape.from_model(target)
    log(f"target {args.model}: {count_parameters(target):,} parameters; torch threads {torch.get_num_threads()}")
    data = build_data(args, tok)
    log("data (examples, mean tokens): " + ", ".join(f"{k} {n} × {l:.0f}" for k, (n, l) in data["sizes"].items()))

    if args.timing_only:
        result = json.loads((out_dir / "fidelity.json").read_text()) if out_dir and (out_dir / "fidelity.json").exists() else {}
        batch = next(iter(DataLoader(data["sample"].dataset, batch_size=args.timing_examples,
                                     collate_fn=data["sample"].collate_fn)))
        val_batch = next(iter(data["validation"].loader))
        proxies = {}
        for spec in args.timing_variants:
            v = parse_variant(spec)
            if v.method == "le":
                from iprox_lightning.baselines.layer_extraction import layer_extraction_proxy

                proxies[v.key], _ = layer_extraction_proxy(target, data["probe"], sparsity=v.rho, progress=False)
            elif v.method in ("random", "svd"):
                proxies[v.key] = copy.deepcopy(target)
                compress_model(proxies[v.key], None, v.rho, method=v.method, progress=False, seed=args.seed)
            else:
                raise SystemExit(f"--timing-variants: use random@ρ / svd@ρ / le@ρ (only the shape matters), got {spec!r}")
            for p in proxies[v.key].parameters():
                p.requires_grad_(False)
        log(f"timing {list(proxies)} on a batch of {args.timing_examples} examples, {args.timing_repeats} repeats")
        rows = interleaved_timing(target, proxies, batch, val_batch, args.timing_repeats)
        for k, m in rows.items():
            m["params"] = count_parameters(proxies[k])
            log(f"  {k}: wall ratio {m['wall_ratio']:.2f}, CPU ratio {m['cpu_ratio']:.2f}")
        result["timing"] = dict(rows=rows, note=f"median of {args.timing_repeats} interleaved score_batch calls on "
                                f"{args.timing_examples} pool examples; load average "
                                f"{os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
        if "target" in result:
            write_outputs(out_dir, result)
        else:
            print(json.dumps(result["timing"], indent=1))
        return result

    result: dict[str, Any] = {}
    if args.resume and out_dir is not None and (out_dir / "fidelity.json").exists():
        result = json.loads((out_dir / "fidelity.json").read_text())
        log(f"resuming: {len(result.get('rows', []))} row(s) already done")
    timer = StageTimer()
    if "target_scores" not in result:
        with timer.stage("target_scoring") as rec:
            ref = score(target, data, args)
        result.update(
            args={k: v for k, v in vars(args).items() if not k.startswith("parsed")},
            machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                         cpus=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads(),
                         load_average_at_start=os.getloadavg() if hasattr(os, "getloadavg") else None),
            defaults=dict(ipsvd_mode=DEFAULT_MODE, damping=args.damping, damping_mode=args.damping_mode),
            data={k: dict(examples=n, mean_tokens=l) for k, (n, l) in data["sizes"].items()},
            target=dict(name=Path(args.model).name, params=count_parameters(target),
                        tracked_params=target_shape.tracked_params, sample=len(ref["scores"]),
                        validation=data["sizes"]["validation"][0], validation_tasks=data["validation_tasks"],
                        scoring_s=rec.wall_s, peak_bytes=rec.peak_memory_bytes,
                        flops_scoring=target_scoring_flops(target_shape, data),
                        split_half_spearman=split_half_spearman(ref["halves"])),
            target_scores=ref["scores"], target_halves=ref["halves"], rows=[], kfac={},
        )
        write_outputs(out_dir, result)
        log(f"target TracIn: {len(ref['scores'])} examples in {rec.wall_s:.1f}s; split-half Spearman "
            f"{result['target']['split_half_spearman']:+.3f}")
    ref_scores = result["target_scores"]
    t_target = result["target"]["scoring_s"]
    if "trivial" not in result:
        result["trivial"] = trivial_baselines(data["sample"], ref_scores, args.bootstrap, args.seed)
        write_outputs(out_dir, result)
    done = {r["key"] for r in result["rows"]}

    probes = None
    probe_time = 0.0
    need_probes = any(v.method == "ipsvd" and v.key not in done for v in args.parsed_variants) or any(
        v.method == "ipsvd" and v.key not in result.get("kfac", {}) for v in args.parsed_kfac)
    if need_probes:
        t0 = time.perf_counter()
        probes = collect_probes(target, data["probe"], find_target_linears(target), num_tokens=args.tokens,
                                seed=args.seed, progress=False)
        probe_time = time.perf_counter() - t0
        result["probes"] = dict(tokens=probes.num_tokens, valid_tokens=probes.num_valid_tokens,
                                examples=probes.num_examples, time_s=probe_time)
        log(f"probes: N={probes.num_tokens} of {probes.num_valid_tokens} valid tokens, {probes.num_examples} "
            f"examples ({probe_time:.1f}s)")
    n_vectors = probes.num_tokens if probes is not None else result.get("probes", {}).get("tokens", args.tokens)
    probe_time = probe_time or result.get("probes", {}).get("time_s", 0.0)

    def build(v: Variant, vt: StageTimer):
        """The proxy of ``v`` (Stage 1 / Layer Extraction, then Stage 2 if asked) and its info."""
        info: dict[str, Any] = {}
        if v.method == "le":
            from iprox_lightning.baselines.layer_extraction import layer_extraction_proxy

            with vt.stage("probe"):
                proxy, le = layer_extraction_proxy(target, data["probe"], sparsity=v.rho, progress=False)
            info["layer_extraction"] = {k: le[k] for k in ("kept_blocks", "removed_blocks", "num_layers_after")}
            info["stage_time"] = {"probe": vt.records["probe"].wall_s, "factors": 0.0}
        else:
            proxy = copy.deepcopy(target)
            kw = dict(mode=v.mode, damping=damping_of(v, args), damping_mode=damping_mode_of(v, args)) \
                if v.method == "ipsvd" else {}
            with vt.stage("factors"):
                rep = compress_model(proxy, None, v.rho, method=v.method, probes=probes if v.method == "ipsvd" else None,
                                     allocation="uniform",  # v1 (superseded) compared uniform ranks only
                                     progress=False, seed=args.seed, **kw)
            info["compression"] = dict(params_after=rep.params_after, achieved_sparsity=rep.achieved_sparsity,
                                       core_fallbacks=sum(lr.mode == "exact" for lr in rep.layers) if v.mode == "core" else 0)
            info["stage_time"] = {"probe": probe_time if v.method == "ipsvd" else 0.0, "factors": rep.time_factors_s}
        if v.align:
            with vt.stage("alignment"):
                info["alignment"] = align_proxy(target, proxy, data["align"], args,
                                                args.kl_weight if v.kl else 0.0, log)
        for p in proxy.parameters():
            p.requires_grad_(False)
        return proxy, info

    kfac_keys = {v.key for v in args.parsed_kfac}
    kept: dict[str, torch.nn.Module] = {}
    for v in args.parsed_variants:
        if v.key in done:
            continue
        log(f"variant {v.key}")
        vt = StageTimer()
        try:
            proxy, info = build(v, vt)
            stage_time = info.pop("stage_time")
            with vt.stage("scoring"):
                sc = score(proxy, data, args)
        except Exception as e:  # one broken variant must not cost the others' numbers
            if args.fail_fast:
                raise
            result.setdefault("errors", {})[v.key] = f"{type(e).__name__}: {e}"
            write_outputs(out_dir, result)
            log(f"  {v.key} FAILED: {type(e).__name__}: {e}")
            continue
        t_score = vt.records["scoring"].wall_s
        row = dict(
            key=v.key, method=v.method, mode=v.mode, rho=v.rho, align=v.align, kl=v.kl if v.align else None,
            damping=damping_of(v, args) if v.method == "ipsvd" else None,
            damping_mode=damping_mode_of(v, args) if v.method == "ipsvd" else None,
            **retention(sc["scores"], ref_scores),
            spearman_ci=bootstrap_spearman(sc["scores"], ref_scores, args.bootstrap, args.seed),
            split_half_spearman=split_half_spearman(sc["halves"]),
            params=count_parameters(proxy), tracked_params=ModelShape.from_model(proxy).tracked_params,
            time_s=dict(probe=stage_time["probe"], factors=stage_time["factors"],
                        alignment=vt.records["alignment"].wall_s if "alignment" in vt.records else 0.0,
                        scoring=t_score),
            scoring_ratio=t_score / t_target,
            flops=stage_flops(v, target_shape, proxy, data, n_vectors, args.align_steps * args.align_batch_size),
            peak_bytes={k: r.peak_memory_bytes for k, r in vt.records.items()},
            load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            **info, proxy_scores=sc["scores"],
        )
        result["rows"].append(row)
        write_outputs(out_dir, result)
        log(f"  {v.key}: spearman {row['spearman']:+.4f} [{row['spearman_ci'][0]:+.2f}, {row['spearman_ci'][1]:+.2f}] "
            f"kendall {row['kendall']:+.4f} top5% {row['top5%']:.2f} | params {row['params']:,} | scoring "
            f"{t_score:.1f}s (ratio {row['scoring_ratio']:.2f})")
        if v.key in kfac_keys and v.key not in result["kfac"]:
            kept[v.key] = proxy
        del proxy

    if args.parsed_kfac:
        if "kfac_target_scores" not in result:
            t0 = time.perf_counter()
            kt = score(target, data, args, method="kfac")
            result["kfac_target_scores"] = kt["scores"]
            result["kfac_target"] = dict(scoring_s=time.perf_counter() - t0,
                                         vs_tracin=retention(kt["scores"], result["target_scores"]),
                                         split_half_spearman=split_half_spearman(kt["halves"]))
            write_outputs(out_dir, result)
            log(f"target K-FAC scores in {result['kfac_target']['scoring_s']:.1f}s")
        for v in args.parsed_kfac:
            if v.key in result["kfac"]:
                continue
            proxy = kept.pop(v.key, None)
            if proxy is None:
                proxy, _ = build(v, StageTimer())
            t0 = time.perf_counter()
            ks = score(proxy, data, args, method="kfac")["scores"]
            m = retention(ks, result["kfac_target_scores"])
            m.update(spearman_ci=bootstrap_spearman(ks, result["kfac_target_scores"], args.bootstrap, args.seed),
                     scoring_s=time.perf_counter() - t0, proxy_scores=ks)
            result["kfac"][v.key] = m
            write_outputs(out_dir, result)
            log(f"  K-FAC {v.key}: spearman {m['spearman']:+.4f} kendall {m['kendall']:+.4f} top5% {m['top5%']:.2f}")
            del proxy

    result["total_time_s"] = result.get("total_time_s", 0.0) + (time.perf_counter() - t_start)
    if not args.no_plots:
        result["plots"] = write_plots(out_dir, result)
    write_outputs(out_dir, result)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
