"""``train.py plan --fit``: per stage, the largest per-device batch and the fewest memory levers that fit the device.

An explicit, ordered search over the settings :mod:`.memory` already counts, each candidate priced by the same stage
functions ``plan`` prints (:func:`stage_functions`: no second memory model). Every stage starts from the run with no
lever on (the configs' batch, no micro-batches, checkpointing, partitions or offloading) and tries, in order, tiers of
levers from the cheapest to the dearest; within a tier the batch (or micro-batch, or probe group) from the largest
down. The first candidate that fits is the stage's setting; a stage where none fits gets the candidate with the
lowest peak (the nearest setting) and the parts that keep it above the device; :func:`nearest_fitting` then names
the run settings outside the levers (a shorter T, bf16-true) at which it would fit, without applying them.

==========================  ===========================================================  ==================================
stage                       tiers, cheapest first                                        largest first within a tier
==========================  ===========================================================  ==================================
warm-up, fine-tune          none; activation checkpointing; + FSDP2 CPU offload (fsdp)   ``micro_batch_size``: divisors of
                                                                                         the batch (the batch is kept: the
                                                                                         micro-batches accumulate)
Stage 1 (IPSVD)             none                                                         ``probe_group_layers``: every layer
                                                                                         of the share, then fewer per group
Stage 2 (alignment)         none; activation checkpointing; the proxy gathered per       ``align_micro_batch_size``: divisors
                            block (``reshard_proxy``, fsdp over several devices)         of the build batch (accumulated)
scoring (each metric)       ordered by the dearest lever used: column groups >           ``batch_size`` of scoring: divisors
                            ``shard_layers`` (several devices) > host holding > K-FAC    of the batch (each example's score
                            offload > K-FAC partitions > bfloat16 validation gradients   is its own); with the proxy
                            > ``checkpoints_in_turn`` (several checkpoints)              per batch its validation batch,
                                                                                         ``validation_batch_size``, from
                                                                                         the batch down
store build                 none; ``gradient_checkpointing``                             ``batch_size``: divisors
==========================  ===========================================================  ==================================

:func:`overlays` writes a fit as what the stage configs take (the YAML overlay of ``configs/<stage>.yaml``, which
``pipeline --plan`` merges into its stages), ``build_store``'s flags and ``plan``'s flags (which price the same
settings: every applied stage fits).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import shlex
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from ..compression.schedule import assign_layers
from ..models.lora import LoraSettings
from ..scoring.config import VALIDATION_DEFAULTS, ScoringConfig
from . import memory as M

TRAINING = ("warm-up", "fine-tune")
STAGE1 = "build_proxy: Stage 1 (IPSVD)"
STAGE2 = "build_proxy: Stage 2 (alignment)"
STORE = "store build"

LEVERS_OFF = dict(micro_batch_size=None, gradient_checkpointing=False, fsdp_cpu_offload=False, probe_group_layers=None,
                  align_micro_batch_size=None, align_checkpointing=False, align_reshard_proxy=False, kfac_partitions=1,
                  kfac_offload=False, validation_gradients=None, shard_layers=False, store_gradient_checkpointing=False,
                  validation_batch_size=None, checkpoints_in_turn=False)
"""The run's memory levers, all off: where every stage's search starts."""


def stage_functions(sizes: M.ModelSizes, acts: M.Activations, acts32: M.Activations,
                    run: M.RunSettings) -> dict[str, Callable[[M.RunSettings], M.StagePlan]]:
    """``{stage: run -> StagePlan}``: the stage functions :func:`~.memory.plan_stages` calls, one stage at a time (the
    search prices hundreds of candidates; a test checks these equal ``plan_stages``' rows)."""
    n_warm = max(1, round(run.pool_size * run.warmup_fraction))
    out: dict[str, Callable[[M.RunSettings], M.StagePlan]] = {
        "warm-up": lambda r: M.training_plan(sizes, acts, r, stage="warm-up", n_examples=n_warm,
                                             epochs=r.warmup_epochs),
        STAGE1: lambda r: M.build_proxy_plan(sizes, acts, r, acts32)[0],
        STAGE2: lambda r: M.build_proxy_plan(sizes, acts, r, acts32)[1],
    }
    for m in M.planned_metrics():
        out[f"scoring ({m})"] = lambda r, m=m: M.scoring_plan(sizes, acts, r, m)
    if run.lora is not None:
        for m in M.lora_metrics():
            out[f"scoring ({m})"] = lambda r, m=m: M.less_scoring_plan(sizes, acts, r, m)
    out[STORE] = lambda r: M.store_plan(sizes, acts, r)
    out[M.PROXY_SCORING] = lambda r: M.proxy_scoring_plan(sizes, acts, r)
    out[M.PROXY_STORE] = lambda r: M.proxy_store_plan(sizes, acts, r)
    out[M.QUERY] = lambda r: M.query_plan(sizes, acts, r)
    out[M.PROXY_QUERY] = lambda r: M.query_plan(sizes, acts, r, proxy=True)
    out["fine-tune"] = lambda r: M.training_plan(sizes, acts, r, stage="fine-tune", n_examples=r.select_k,
                                                 epochs=r.finetune_epochs)
    return out


# --------------------------------------------------------------------------------------------
# the candidates, in order
# --------------------------------------------------------------------------------------------
def divisors_down(n: int) -> list[int]:
    """``n``'s divisors, largest first (equal micro-batches: none smaller than the others)."""
    return [d for d in range(int(n), 0, -1) if n % d == 0]


def fewer_per_group(n: int) -> list[int]:
    """Group sizes below ``n`` that change the number of groups (``ceil(n / g)`` for ``g`` = 2, 3, ...), largest
    first."""
    return sorted({math.ceil(n / g) for g in range(2, n + 1)}, reverse=True)


def _tiered(tiers: Iterable[Mapping[str, Any]], key: str, values: Iterable[Any]) -> Iterator[dict]:
    values = list(values)
    for tier in tiers:
        for v in values:
            yield {**tier, key: v}


def _probe_share(sizes: M.ModelSizes, run: M.RunSettings) -> int:
    """The most tracked layers any rank decomposes in Stage 1 (:func:`~..compression.schedule.assign_layers`)."""
    shapes = {l.name: (l.out_features, l.in_features) for l in sizes.shape.linears if l.tracked}
    return max(Counter(assign_layers(shapes, run.devices).values()).values(), default=1)


def holdings(columns: int) -> list[dict | None]:
    """The validation-gradient holdings, cheapest first: the default (float32 on the device), bfloat16, bfloat16 on
    the host, then column groups (each a pass over the pool: fewer columns per pass, the group sizes that differ)."""
    out: list[dict | None] = [None, {"dtype": "bfloat16"}, {"dtype": "bfloat16", "device": "cpu"}]
    seen = {columns}
    for g in range(2, columns + 1):
        if (kg := math.ceil(columns / g)) not in seen:
            seen.add(kg)
            out.append({"dtype": "bfloat16", "device": "cpu", "column_groups": g})
    return out


def _scoring_tiers(run: M.RunSettings, metric, n_tracked: int) -> list[dict]:
    """Scoring's lever tiers, sorted by the dearest lever used (column groups, the factors and validation gradients
    split across ranks, host holding, K-FAC offload, K-FAC partitions, bfloat16 holding: the most significant first)."""
    parts = [1]
    if metric.factor_passes:
        p = 2
        while p < n_tracked:
            parts.append(p)
            p *= 2
        parts.append(n_tracked)
    tiers = []
    for i, h in enumerate(holdings(run.tasks)):
        for offload in ((False, True) if metric.factor_passes else (False,)):
            for p in parts:
                for shard in ((False, True) if run.devices > 1 else (False,)):
                    for in_turn in ((False, True) if run.checkpoints > 1 else (False,)):
                        h = h or {}
                        key = (int(h.get("column_groups", 1)), shard, h.get("device") == "cpu", offload, p,
                               h.get("dtype") == "bfloat16", in_turn)
                        tier = {"validation_gradients": h or None, "kfac_partitions": p, "kfac_offload": offload,
                                "shard_layers": shard}
                        tiers.append((key, {**tier, "checkpoints_in_turn": True} if in_turn else tier))
    return [t for _, t in sorted(tiers, key=lambda kv: kv[0])]


def candidates(stage: str, sizes: M.ModelSizes, run: M.RunSettings) -> Iterator[dict]:
    """The settings tried for ``stage``, in order (the module's table); ``{}`` alone for a stage without levers."""
    if stage in TRAINING:
        tiers: list[dict] = [{}, {"gradient_checkpointing": True}]
        if run.strategy == "fsdp" and run.lora is None:
            tiers.append({"gradient_checkpointing": True, "fsdp_cpu_offload": True})
        yield from _tiered(tiers, "micro_batch_size", [None] + divisors_down(run.batch_size)[1:])
    elif stage == STAGE1:
        yield from _tiered([{}], "probe_group_layers", [None] + fewer_per_group(_probe_share(sizes, run)))
    elif stage == STAGE2:
        tiers = [{}, {"align_checkpointing": True}]
        if run.strategy == "fsdp" and run.devices > 1:  # 1.4-2x slower steps (regathered in both backwards): last
            tiers.append({"align_reshard_proxy": True})
        yield from _tiered(tiers, "align_micro_batch_size", [None] + divisors_down(run.align_batch_size)[1:])
    elif stage.startswith("scoring (") and stage[9:-1] in M.planned_metrics():
        metric = M.planned_metrics()[stage[9:-1]]
        n_tracked = sum(1 for l in sizes.shape.linears if l.tracked)
        yield from _tiered(_scoring_tiers(run, metric, n_tracked), "batch_size", divisors_down(run.batch_size))
    elif stage.startswith("scoring (") and stage[9:-1] in M.lora_metrics():  # LESS: the holdings, the batch
        tiers = [t for t in _scoring_tiers(run, M.planned_metrics()["tracin"], 0) if not t["shard_layers"]]
        yield from _tiered(tiers, "batch_size", divisors_down(run.batch_size))
    elif stage == M.PROXY_SCORING:  # TracIn's holdings (one process: no shard_layers); per pool batch the validation
        tiers = [t for t in _scoring_tiers(run, M.planned_metrics()["tracin"], 0) if not t["shard_layers"]]
        for c in _tiered(tiers, "batch_size", divisors_down(run.batch_size)):  # batch from the largest down (None:
            for vb in [None, *range(c["batch_size"] - 1, 0, -1)]:  # the pool's batch, as before the setting)
                yield {**c, "validation_batch_size": vb}
    elif stage in (STORE, M.PROXY_STORE):
        yield from _tiered([{}, {"store_gradient_checkpointing": True}], "batch_size", divisors_down(run.batch_size))
    elif stage in (M.QUERY, M.PROXY_QUERY):  # query --batch_size: validation examples per backward
        yield from _tiered([{}], "batch_size", divisors_down(run.batch_size))
    else:
        yield {}


# --------------------------------------------------------------------------------------------
# the search
# --------------------------------------------------------------------------------------------
@dataclass
class StageFit:
    """One stage's fit: ``settings`` (the run's fields changed from :data:`LEVERS_OFF` and the configs' batch),
    ``plan`` (the stage at them), ``fits`` (within the device), ``base`` (the stage at the configs' settings, no lever)."""

    stage: str
    fits: bool
    settings: dict[str, Any]
    plan: M.StagePlan
    base: M.StagePlan
    run: M.RunSettings = field(repr=False)
    tried: int = 0
    nearest_fitting: list[dict[str, Any]] | None = None  # (fits at no lever) the run settings it fits at

    @property
    def levers(self) -> list[str]:
        return lever_words(self.settings, self.run)

    def to_dict(self, device_memory: float) -> dict[str, Any]:
        parts = sorted(self.plan.parts.items(), key=lambda kv: -kv[1])
        out = {"stage": self.stage, "fits": self.fits, "peak": self.plan.peak, "base_peak": self.base.peak,
               "settings": self.settings, "levers": self.levers,
               "largest_parts": {k: v for k, v in parts[:3]}}
        if not self.fits:
            out["over_by"] = self.plan.peak - device_memory
            out["reason"] = reason(self, device_memory)
            out["plan_levers"] = list(self.plan.levers)
            out["nearest_fitting"] = self.nearest_fitting
        return out


def _changed(settings: Mapping[str, Any], run: M.RunSettings) -> dict[str, Any]:
    """The settings that differ from the run's (``run``: levers off, the configs' batch)."""
    return {k: v for k, v in settings.items() if getattr(run, k) != v}


def fit_stage(stage: str, evaluate: Callable[[M.RunSettings], M.StagePlan], sizes: M.ModelSizes,
              run: M.RunSettings, device_memory: float) -> StageFit:
    """The first of :func:`candidates` whose peak fits ``device_memory``, else the lowest one (see the module)."""
    start = dataclasses.replace(run, **LEVERS_OFF)
    base = evaluate(start)
    best = None
    n = 0
    for settings in candidates(stage, sizes, start):
        n += 1
        r = dataclasses.replace(start, **settings)
        p = evaluate(r)
        if p.peak <= device_memory:
            return StageFit(stage, True, _changed(settings, start), p, base, start, n)
        if best is None or p.peak < best[1].peak:
            best = (settings, p)
    return StageFit(stage, False, _changed(best[0], start), best[1], base, start, n)


def fit_stages(sizes: M.ModelSizes, acts: M.Activations, acts32: M.Activations, run: M.RunSettings,
               device_memory: float, stages: Iterable[str] | None = None) -> list[StageFit]:
    """:func:`fit_stage` for every stage ``plan`` prints (or the named ones), in run order."""
    fns = stage_functions(sizes, acts, acts32, run)
    names = list(fns) if stages is None else list(stages)
    unknown = [s for s in names if s not in fns]
    if unknown:
        raise ValueError(f"no such plan stage(s): {unknown}; the stages: {list(fns)}")
    return [fit_stage(s, fns[s], sizes, run, device_memory) for s in names]


NEAREST_SETTINGS = (("max_length", 448), ("max_length", 384), ("max_length", 256), ("precision", "bf16-true"))
"""Run settings outside the levers, tried for a stage that fits at no lever: the first that fits of each (the longest
T, then bf16-true) is named, never applied (each changes what is computed: a shorter T truncates examples, bf16-true
trains in bfloat16)."""


def nearest_fitting(model: str, run: M.RunSettings, stage: str, device_memory: float) -> list[dict[str, Any]]:
    """Per run setting of :data:`NEAREST_SETTINGS` (T, precision), the first value at which ``stage`` of ``model`` fits,
    with the levers the search then needs: ``[{"setting": {key: value}, "peak": bytes, "settings": {lever: value},
    "levers": [in words]}]`` (empty: none fits)."""
    found: dict[str, dict[str, Any]] = {}
    for key, value in NEAREST_SETTINGS:
        if key in found or getattr(run, key) == value or (key == "max_length" and value >= run.max_length):
            continue
        alt = dataclasses.replace(run, **{key: value})
        sizes, acts, acts32 = M.model_counts(model, alt)
        f = fit_stages(sizes, acts, acts32, alt, device_memory, [stage])[0]
        if f.fits:
            found[key] = {"setting": {key: value}, "peak": f.plan.peak, "settings": f.settings, "levers": f.levers}
    return list(found.values())


def with_nearest_fitting(fits: list[StageFit], model: str, run: M.RunSettings, device_memory: float) -> None:
    """Each stage that fits at no lever gets its :func:`nearest_fitting` settings (in place)."""
    for f in fits:
        if not f.fits:
            f.nearest_fitting = nearest_fitting(model, run, f.stage, device_memory)


def applies(stage: str, method: str) -> bool:
    """Whether a stage runs with scoring ``method`` (the other metrics' rows are information), as ``plan`` refuses;
    scoring with the proxy is TracIn's."""
    if stage == M.PROXY_SCORING:
        return method == "tracin"
    return not stage.startswith("scoring (") or stage == f"scoring ({method})"


# --------------------------------------------------------------------------------------------
# words
# --------------------------------------------------------------------------------------------
def lever_words(settings: Mapping[str, Any], run: M.RunSettings) -> list[str]:
    """The stage config settings ``settings`` stands for, in their own words."""
    out = []
    for k, v in settings.items():
        if k == "micro_batch_size":
            out.append(f"model.micro_batch_size {v} (the batch of {run.batch_size} in {run.batch_size // v} "
                       "accumulated micro-batches)")
        elif k == "gradient_checkpointing" and v:
            out.append("model.gradient_checkpointing true")
        elif k == "fsdp_cpu_offload" and v:
            out.append("model.fsdp_cpu_offload true")
        elif k == "probe_group_layers":
            out.append(f"IPSVDCallback probe_group_layers {v}")
        elif k == "align_micro_batch_size":
            out.append(f"ProxyAlignModule micro_batch_size {v} (the build batch of {run.align_batch_size} in "
                       f"{run.align_batch_size // v} accumulated micro-batches)")
        elif k == "align_checkpointing" and v:
            out.append("ProxyAlignModule activation_checkpointing true")
        elif k == "align_reshard_proxy" and v:
            out.append("ProxyAlignModule reshard_proxy true (the proxy gathered one decoder block at a time)")
        elif k == "batch_size":
            out.append(f"data.batch_size {v} (of {run.batch_size})")
        elif k == "validation_batch_size" and v:
            out.append(f"model.validation_batch_size {v} (the validation pass's batch; the pool's: "
                       f"{settings.get('batch_size', run.batch_size)})")
        elif k == "validation_gradients" and v:
            out.append(f"validation_gradients {json.dumps(dict(v))}")
        elif k == "kfac_partitions":
            out.append(f"kfac_partitions {v}")
        elif k == "kfac_offload" and v:
            out.append("kfac_offload true")
        elif k == "shard_layers" and v:
            out.append("shard_layers true (each rank holds its weights' factors and validation gradients)")
        elif k == "store_gradient_checkpointing" and v:
            out.append("gradient_checkpointing true")
        elif k == "checkpoints_in_turn" and v:
            out.append(f"model.checkpoints_in_turn true (one of the {run.checkpoints} checkpoints held at a time, a "
                       "pass over the pool each)")
    return out


def size(n: float) -> str:
    """Bytes as GiB (two decimals), or MiB below a tenth of a GiB (the demo's sizes)."""
    return M.gib(n) if abs(n) >= 0.1 * M.GIB else f"{n / 2**20:.2f} MiB"


def reason(f: StageFit, device_memory: float) -> str:
    """Why the nearest setting does not fit: its peak, the excess and its largest parts."""
    parts = sorted(f.plan.parts.items(), key=lambda kv: -kv[1])[:3]
    return (f"{size(f.plan.peak)} at the nearest setting, {size(f.plan.peak - device_memory)} over "
            f"{size(device_memory)}; largest: " + ", ".join(f"{k} {size(v)}" for k, v in parts))


# --------------------------------------------------------------------------------------------
# the overlay
# --------------------------------------------------------------------------------------------
IPSVD_CALLBACK = "iprox_lightning.callbacks.IPSVDCallback"


def _deep_set(d: dict, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _deep_del(d: dict, path: tuple) -> None:
    """Remove ``path`` from ``d`` and the mappings it leaves empty."""
    if len(path) > 1:
        _deep_del(d[path[0]], path[1:])
        if not d[path[0]]:
            del d[path[0]]
    else:
        del d[path[0]]


def overlays(fits: Iterable[StageFit], method: str) -> dict[str, Any]:
    """A fit as what the commands take: ``{"stages": {config stage: YAML overlay}, "build_store": [flags],
    "plan": [flags]}``. The stage overlays (``warmup``, ``build_proxy``, ``score``, ``finetune``) go after
    ``configs/<stage>.yaml`` (``--config``) and are what ``pipeline --plan`` takes; a stage that needs nothing has
    none. ``plan``'s flags price every applied stage at its setting (``--batch_size``: the smallest batch a stage
    needs; warm-up and fine-tune share the micro-batch and checkpointing flags: the smaller / either). The score
    stage's ``validation_batch_size`` is the proxy row's, written only below the stage's batch (the target's scoring
    may lower it to or below the validation batch: the default then)."""
    stages: dict[str, dict] = {}
    plan: dict[str, Any] = {}
    store: list[str] = []
    store_batch, store_ckpt, store_fsdp, query_batch, score_batch = None, False, False, None, None
    init = ("model", "init_args")
    for f in fits:
        s = f.settings
        if f.stage in TRAINING:
            name = "warmup" if f.stage == "warm-up" else "finetune"
            for k in ("micro_batch_size", "gradient_checkpointing", "fsdp_cpu_offload"):
                if k in s:
                    _deep_set(stages.setdefault(name, {}), init + (k,), s[k])
            if "micro_batch_size" in s:
                plan["micro_batch_size"] = min(plan.get("micro_batch_size", s["micro_batch_size"]), s["micro_batch_size"])
            for k in ("gradient_checkpointing", "fsdp_cpu_offload"):
                if s.get(k):
                    plan[k] = True
        elif f.stage == STAGE1 and "probe_group_layers" in s:
            stages.setdefault("build_proxy", {}).setdefault("trainer", {})["callbacks"] = [
                {"class_path": IPSVD_CALLBACK, "init_args": {"probe_group_layers": s["probe_group_layers"]}}]
            plan["probe_group_layers"] = s["probe_group_layers"]
        elif f.stage == STAGE2:
            for k, key in (("align_micro_batch_size", "micro_batch_size"), ("align_checkpointing", "activation_checkpointing"),
                           ("align_reshard_proxy", "reshard_proxy")):
                if k in s:
                    _deep_set(stages.setdefault("build_proxy", {}), init + (key,), s[k])
                    plan[k] = s[k]
        elif f.stage == f"scoring ({method})":
            for k in ("validation_gradients", "kfac_partitions", "kfac_offload", "shard_layers", "checkpoints_in_turn"):
                if k in s:
                    _deep_set(stages.setdefault("score", {}), init + (k,), s[k])
                    plan[k] = s[k]
            if "batch_size" in s:
                _deep_set(stages.setdefault("score", {}), ("data", "init_args", "batch_size"), s["batch_size"])
                plan["batch_size"] = min(plan.get("batch_size", s["batch_size"]), s["batch_size"])
        elif f.stage == STORE or f.stage == M.PROXY_STORE:  # one build_store setting for both stores: the smaller
            if f.run.strategy == "fsdp" and f.run.devices > 1:  # priced sharded per block: build it so
                store_fsdp = True
            if "batch_size" in s:  # batch, checkpointing where either needs it
                store_batch = min(store_batch or s["batch_size"], s["batch_size"])
                plan["batch_size"] = min(plan.get("batch_size", s["batch_size"]), s["batch_size"])
            if s.get("store_gradient_checkpointing"):
                store_ckpt = plan["store_gradient_checkpointing"] = True
        elif f.stage == M.PROXY_SCORING and method == "tracin":  # the pipeline's proxy scoring: configs/score.yaml
            score = stages.setdefault("score", {})
            if s.get("validation_gradients"):  # the dearer of the two scorings' holdings (fits both)
                have = _get(score, *init, "validation_gradients")
                pick = max((have, s["validation_gradients"]), key=_holding_rank) if have else s["validation_gradients"]
                _deep_set(score, init + ("validation_gradients",), pick)
                plan["validation_gradients"] = pick
            if "batch_size" in s:
                now = _get(score, "data", "init_args", "batch_size", default=s["batch_size"])
                _deep_set(score, ("data", "init_args", "batch_size"), min(now, s["batch_size"]))
                plan["batch_size"] = min(plan.get("batch_size", s["batch_size"]), s["batch_size"])
            if s.get("validation_batch_size"):  # the target's validation pass (kept below the scoring batch: after)
                _deep_set(score, init + ("validation_batch_size",), s["validation_batch_size"])
                plan["validation_batch_size"] = s["validation_batch_size"]
                score_batch = f.run.batch_size
            if not score:
                del stages["score"]
        elif f.stage in (M.QUERY, M.PROXY_QUERY) and "batch_size" in s:
            query_batch = min(query_batch or s["batch_size"], s["batch_size"])
            plan["batch_size"] = min(plan.get("batch_size", s["batch_size"]), s["batch_size"])
    if score_batch is not None:  # a validation batch not below the scoring batch is that batch (the default): none
        score = stages["score"]
        if _get(score, *init, "validation_batch_size") >= _get(score, "data", "init_args", "batch_size",
                                                                 default=score_batch):
            _deep_del(score, init + ("validation_batch_size",))
            if not score:
                del stages["score"]
        if plan["validation_batch_size"] >= plan.get("batch_size", score_batch):
            del plan["validation_batch_size"]
    if store_batch:
        store += ["--batch_size", str(store_batch)]
    if store_ckpt:
        store += ["--gradient_checkpointing", "true"]
    if store_fsdp:
        store += ["--strategy", "fsdp"]
    out = {"stages": stages, "build_store": store, "plan": plan_flags(plan)}
    if query_batch:
        out["query"] = ["--batch_size", str(query_batch)]
    return out


def _holding_rank(h: Mapping[str, Any] | None) -> int:
    """A validation-gradient holding's place in :func:`holdings` order (the dearer, the later; 0: the default)."""
    h = {**VALIDATION_DEFAULTS, **dict(h or {})}
    return (int(h["column_groups"]) * 4 + (2 if h["device"] == "cpu" else 0) + (1 if h["dtype"] == "bfloat16" else 0))


def plan_flags(settings: Mapping[str, Any]) -> list[str]:
    """``train.py plan`` flags of run settings (the options of the same names)."""
    out = []
    for k, v in settings.items():
        text = json.dumps(v) if isinstance(v, Mapping) else ("true" if v is True else "false" if v is False else str(v))
        out += [f"--{k}", text]
    return out


def merge_overlay(base: dict, extra: Mapping) -> dict:
    """``base`` with ``extra`` merged in: mappings key by key, a list of ``class_path`` entries entry by entry where
    the class paths match (as LightningCLI merges a later ``--config``'s callbacks), anything else replaced."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge_overlay(dict(out[k]), v)
        elif isinstance(v, list) and isinstance(out.get(k), list) and all(isinstance(e, Mapping) for e in v):
            items = [dict(e) for e in out[k]]
            for e in v:
                same = next((i for i, x in enumerate(items) if isinstance(x, Mapping)
                             and x.get("class_path") == e.get("class_path")), None)
                if same is None:
                    items.append(dict(e))
                else:
                    items[same] = merge_overlay(items[same], e)
            out[k] = items
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# exact TracIn or the store
# --------------------------------------------------------------------------------------------
def tracin_route(sizes: M.ModelSizes, run: M.RunSettings, device_memory: float, tracin: StageFit,
                 store: StageFit) -> dict[str, Any]:
    """Whether the fit sends exact TracIn to the gradient store (``build_store`` + ``query``: one pass over the pool,
    projected gradients, no dense validation gradient): when exact TracIn's validation gradients fit only in several
    column groups (passes over the pool, each about a store build's time) or not at all; by how much (passes, peaks,
    the dense validation gradients' bytes: :func:`~.memory.validation_gradient_bytes`, as ``plan`` counts them)."""
    holding = {**VALIDATION_DEFAULTS, **dict(tracin.settings.get("validation_gradients") or {})}
    passes = int(holding["column_groups"])
    tracked = [(l.in_features, l.out_features) for l in sizes.shape.linears if l.tracked]
    dense = {d: M.validation_gradient_bytes(tracked, run.tasks, {"dtype": d})["device"] for d in ("float32", "bfloat16")}
    to_store = (not tracin.fits) or passes > 1
    out = {"to_store": to_store, "exact_passes": passes if tracin.fits else None, "exact_peak": tracin.plan.peak,
           "store_peak": store.plan.peak, "store_fits": store.fits, "columns": run.tasks,
           "dense_validation_gradients": dense}
    if not tracin.fits:
        out["why"] = (f"exact TracIn does not fit even one column per pass ({reason(tracin, device_memory)}); the "
                      f"store's build needs {size(store.plan.peak)} per device in one pass")
    elif passes > 1:
        out["why"] = (f"exact TracIn fits only in {passes} column groups: {passes} passes over the pool (about "
                      f"{passes}x the store build's time); the store builds in one pass "
                      f"({size(store.plan.peak)} per device)")
    else:
        out["why"] = f"exact TracIn fits in one pass ({size(tracin.plan.peak)} per device): exact scores"
    if to_store and not store.fits:
        out["why"] += "; the store's build does not fit either"
    return out


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------
def table_lines(fits: Iterable[StageFit], device_memory: float, method: str) -> list[str]:
    """One line per stage: fits or not, its peak at the setting, the levers it needed (or the reason)."""
    rows = [("stage", "fits", "peak/device", "levers needed (or why not, and the nearest setting)")]
    for f in fits:
        info = "" if applies(f.stage, method) else " [information: scoring uses " + method + "]"
        if f.fits:
            what = "; ".join(f.levers) or "none (the configs' settings)"
        else:
            what = f"nearest: {'; '.join(f.levers) or 'the configs settings'} — {reason(f, device_memory)}"
            if f.nearest_fitting:
                what += "; fits at " + " or ".join(nearest_words(n) for n in f.nearest_fitting)
        rows.append((f.stage, "yes" if f.fits else "NO", size(f.plan.peak), what + info))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]


def nearest_words(n: Mapping[str, Any]) -> str:
    """A :func:`nearest_fitting` result in words: ``precision bf16-true (54.4 GiB: micro-batch 1)``."""
    (key, value), = n["setting"].items()
    return f"{key} {value} ({size(n['peak'])}" + (f": {'; '.join(n['levers'])})" if n["levers"] else ")")


def fit_report(sizes: M.ModelSizes, acts: M.Activations, acts32: M.Activations, run: M.RunSettings,
               device_memory: float, model: str | None = None) -> dict[str, Any]:
    """Every stage's fit, exact TracIn's route and the overlay: ``{"stages": [StageFit], "tracin": ..., "overlay":
    ...}`` (what ``plan --fit`` prints and writes); with ``model``, a stage that fits at no lever names its
    :func:`nearest_fitting` setting."""
    fits = fit_stages(sizes, acts, acts32, run, device_memory)
    if model is not None:
        with_nearest_fitting(fits, model, run, device_memory)
    by = {f.stage: f for f in fits}
    route = tracin_route(sizes, run, device_memory, by["scoring (tracin)"], by[STORE]) \
        if "scoring (tracin)" in by and STORE in by else None
    return {"stages": fits, "tracin": route, "overlay": overlays(fits, run.method)}


def fit_target(model: str, run: M.RunSettings, device_memory: str | float,
               stages: Iterable[str] | None = None) -> dict[str, Any]:
    """One target's fit as JSON (``bench/plan_targets.py``): ``model`` (as ``plan --model`` takes it) at ``run`` on
    devices of ``device_memory``: every stage's (or the named ones'), exact TracIn's route (where TracIn is fitted)
    and the overlay."""
    memory = M.parse_bytes(device_memory)
    sizes, acts, acts32 = M.model_counts(model, run)
    fits = fit_stages(sizes, acts, acts32, run, memory, stages)
    with_nearest_fitting(fits, model, run, memory)
    by = {f.stage: f for f in fits}
    route = None
    if "scoring (tracin)" in by:
        store = by.get(STORE) or fit_stages(sizes, acts, acts32, run, memory, [STORE])[0]
        route = tracin_route(sizes, run, memory, by["scoring (tracin)"], store)
    return {"model": model, "params": sizes.params, "devices": run.devices, "strategy": run.strategy,
            "device_memory": memory, "stages": [f.to_dict(memory) for f in fits], "tracin": route,
            "overlay": overlays(fits, run.method)}


def report_lines(report: Mapping[str, Any], device_memory: float, method: str, plan_args: list[str]) -> list[str]:
    """``plan --fit``'s text: the table, exact TracIn's route, the overlay as each command takes it."""
    lines = [f"fit: per stage the largest batch and the fewest levers (cheapest first: iprox_lightning/analysis/fit.py) "
             f"within {size(device_memory)} per device"]
    lines += table_lines(report["stages"], device_memory, method)
    if report["tracin"] is not None:
        r = report["tracin"]
        lines.append(("exact TracIn goes to the store (build_store + query): " if r["to_store"] else
                      "exact TracIn stays exact: ") + r["why"])
    ov = report["overlay"]
    stages = ov["stages"]
    if not stages and not ov["build_store"] and not ov.get("query"):
        lines.append("overlay: none: every stage fits at the configs' settings")
        return lines
    lines.append("overlay (the settings above, as each command takes them):")
    lines.append("  pipeline:    python train.py pipeline ... --plan " + _quote(json.dumps(stages)))
    for name, overlay in stages.items():
        lines.append(f"  {name + ':':12} python train.py {'predict' if name == 'score' else 'fit'} --config "
                     f"configs/{name}.yaml --config " + _quote(json.dumps(overlay)))
    if ov["build_store"]:
        lines.append("  build_store: python train.py build_store ... " + " ".join(ov["build_store"]))
    if ov.get("query"):
        lines.append("  query:       python train.py query ... " + " ".join(ov["query"]))
    lines.append("  plan:        python train.py plan " + " ".join(_quote(a) for a in plan_args + ov["plan"]))
    return lines


def _quote(text: str) -> str:
    return shlex.quote(text)


# --------------------------------------------------------------------------------------------
# pipeline --plan auto: the run's settings from its stage configs
# --------------------------------------------------------------------------------------------
def _get(d: Mapping, *path: str, default: Any = None) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return default
        d = d[k]
    return d


def _callback_arg(config: Mapping, class_path: str, name: str, default: Any) -> Any:
    for c in _get(config, "trainer", "callbacks", default=None) or []:
        if isinstance(c, Mapping) and c.get("class_path") == class_path:
            return _get(c, "init_args", name, default=default)
    return default


@functools.lru_cache(maxsize=8)
def _builtin_counts(max_length: int, precision: str, attn: str) -> tuple:
    """The built-in demo model's counts (the demo's tiny Llama: not a file ``model_counts`` caches)."""
    from ..models.builtin import builtin_model  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    config = builtin_model().config
    acts, acts32 = M.run_activations(config, M.RunSettings(max_length=max_length, precision=precision,
                                                           attn_implementation=attn))
    return M.ModelSizes.from_config(config, name="builtin"), acts, acts32


def pipeline_runs(configs: Mapping[str, Mapping], *, target: str, hardware: Mapping[str, Any], sparsity: float,
                  align_epochs: int | None, method: str, lora: Mapping | None, validation: Any,
                  proxy_validation: str = "target") -> tuple[list[tuple[list[str], M.RunSettings]], Callable]:
    """``([(plan stages, their run settings)], run -> (sizes, activations, float32 activations))`` of a pipeline
    whose stage configs, merged as it runs them (its data arguments included), are ``configs`` (``warmup``,
    ``build_proxy``, ``score``, ``finetune``): each stage's batch, sequence length, fractions and epochs from its
    config, the precision, devices and strategy from ``hardware`` (else the configs'), the score columns of the
    built-in validation data (else ``plan``'s default, 3). ``target`` ``builtin``: the demo's tiny Llama.
    ``proxy_validation``: the pipeline's ``--proxy_validation`` (whose validation gradients the proxy is scored
    against: its row holds the target only with ``target``)."""
    def data(stage: str, key: str, default: Any) -> Any:
        return _get(configs[stage], "data", "init_args", key, default=default)

    from ..data.synthetic import BUILTIN_VALIDATION_FAMILIES  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)
    from ..models.builtin import builtin_model  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    devices = int(hardware.get("devices") or 1) * int(hardware.get("num_nodes") or 1)
    strategy = str(hardware.get("strategy") or _get(configs["warmup"], "trainer", "strategy", default="ddp")).lower()
    precision = str(hardware.get("precision") or _get(configs["warmup"], "trainer", "precision", default="32-true"))
    builtin_pool = data("warmup", "pool", "builtin") == "builtin"
    tasks = 3
    if validation == "builtin":
        tasks = len(BUILTIN_VALIDATION_FAMILIES)
    config = None
    if target == "builtin":
        config = builtin_model().config
    if lora is not None:
        lora = (M.with_lora_targets(lora, target) if config is None else
                {**LoraSettings.of(lora).to_dict(),
                 "target_modules": LoraSettings.of(lora).resolved_targets(config.model_type)})
    base = M.RunSettings(
        pool_size=int(data("warmup", "builtin_size", 2000)) if builtin_pool else 16000,
        precision=precision, devices=devices, strategy="fsdp" if ("fsdp" in strategy or "modelparallel" in strategy)
        else "ddp", device_kind="cpu" if str(hardware.get("accelerator", "cpu")).lower() == "cpu" else "cuda",
        sparsity=min(max(float(sparsity), 1e-6), 1 - 1e-6), method=method, tasks=tasks, lora=lora,
        kfac_examples=int(_get(configs["score"], "model", "init_args", "kfac_examples",
                               default=ScoringConfig.kfac_examples)))
    bp = configs["build_proxy"]
    runs = [
        (["warm-up"], dataclasses.replace(base, batch_size=int(data("warmup", "batch_size", 8)),
                                          max_length=int(data("warmup", "max_length", 512)),
                                          warmup_fraction=float(data("warmup", "warmup_fraction", 0.05)),
                                          warmup_epochs=int(_get(configs["warmup"], "trainer", "max_epochs",
                                                                 default=1)))),
        ([STAGE1, STAGE2], dataclasses.replace(
            base, align_batch_size=int(data("build_proxy", "batch_size", 4)),
            max_length=int(data("build_proxy", "max_length", 512)),
            construction_fraction=float(data("build_proxy", "construction_fraction", 0.01)),
            probe_fraction=float(data("build_proxy", "probe_fraction", 0.1)),
            num_probe_tokens=int(_callback_arg(bp, IPSVD_CALLBACK, "num_probe_tokens", 1024)),
            align_epochs=int(align_epochs if align_epochs is not None else _get(bp, "trainer", "max_epochs", default=2)))),
        # the proxy is scored against the target's validation gradients (pipeline --proxy_validation target, the
        # default) or its own (proxy): its own row beside the target's, both under configs/score.yaml (TracIn's: plan
        # prices TracIn's)
        ([f"scoring ({method})"] + ([M.PROXY_SCORING] if method == "tracin" else []),
         dataclasses.replace(base, batch_size=int(data("score", "batch_size", 8)),
                             max_length=int(data("score", "max_length", 512)), proxy_validation=proxy_validation,
                             validation_batch_size=_get(configs["score"], "model", "init_args",
                                                        "validation_batch_size", default=None))),
        (["fine-tune"], dataclasses.replace(
            base, batch_size=int(data("finetune", "batch_size", 8)), max_length=int(data("finetune", "max_length", 512)),
            finetune_epochs=int(_get(configs["finetune"], "trainer", "max_epochs", default=1)))),
    ]
    counted: dict[tuple, tuple] = {}

    def sizes_of(run: M.RunSettings) -> tuple[M.ModelSizes, M.Activations, M.Activations]:
        key = (run.max_length, run.precision)
        if key not in counted:
            counted[key] = M.model_counts(target, run) if config is None else \
                _builtin_counts(run.max_length, run.precision, run.attn_implementation)
        return counted[key]

    return runs, sizes_of
