"""IPSVD damping sweep: which ``(mode, damping, damping_mode)`` keeps the target's influence best.

One run compresses fresh copies of the target at one sparsity ``ρ`` with plain SVD and with IPSVD
for every ``mode × damping × damping_mode`` of the grid — all from the SAME probes, collected once —
scores a fixed sample of pool examples with each proxy and compares with the target's scores.
No alignment (stage 2) is applied: this measures the IPSVD initialisation alone.

Data (:class:`~iprox_lightning.data.SFTDataModule`: chat template, prompt masked, ``prompt_left``
truncation). From one seeded permutation of the pool, three disjoint subsets:

* **probe set** — ``--probe-examples`` examples × ≤ ``--probe-length`` tokens; ``N = --tokens``
  probe columns per layer (:func:`~iprox_lightning.probes.collect_probes`);
* **scored sample** — ``--sample`` examples × ≤ ``--max-length`` tokens;
* **held-out set** — ``--heldout`` examples × ≤ ``--probe-length`` tokens: the held-out loss of each
  proxy, and a second, held-out probe collection for the held-out weighted error.

Validation set: ``--val-per-task`` examples per task of ``--validation`` (default
``eval:<shared>/data/eval``: MMLU, BBH, TyDiQA), ≤ ``--val-max-length`` tokens.

Per row (definitions):

* ``spearman``, ``kendall``, ``pearson``, ``top5%``, ``top10%`` —
  :func:`~iprox_lightning.analysis.retention.retention_metrics` of the proxy's TracIn scores
  (:func:`~iprox_lightning.scoring.tracin_scores`, ``cos(g(z), ḡ_val)``; the proxy's tracked
  parameters are its ``A``/``B`` factors) against the target's;
* ``J/J0 probe`` / ``J/J0 held-out`` — mean over the factorised layers of
  ``J(AB)/J(0)`` with the *undamped* K-FAC objective of the paper's Eq. 3,
  ``J(Ŵ) = ‖C_δ^{1/2} (W − Ŵ) C_h^{1/2}‖_F² = ‖Δᵀ (W − Ŵ) H‖_F² / N²``
  (:func:`undamped_objective`),
  on the probe set (in-sample) and on the held-out probes. Undamped so that every row is measured
  with the same yardstick; ``J/J0 own`` (JSON only) is the report's value in each setting's own
  damped metric;
* ``heldout_loss`` — mean per-example SFT loss on the held-out set (the target's is in the header);
* ``factor_s`` — wall-clock of the factor computation of all layers (probes excluded).

``--kfac`` adds K-FAC retention (:func:`influence_scores` with ``metric="kfac"``, factors from the
scored sample) for plain SVD and the best IPSVD setting (by Spearman, tie-break top-10%).

Results: ``--out PREFIX`` writes ``PREFIX.json`` (rewritten after every row; ``--resume`` skips the
rows already there) and ``PREFIX.md``. One command reproduces ``docs/IPSVD_SWEEP.md``::

    python bench/ipsvd_sweep.py --out bench/results/ipsvd_sweep_smollm2 --kfac

The built-in offline model and data (seconds)::

    python bench/ipsvd_sweep.py --model builtin --pool builtin --validation builtin --tokenizer builtin \\
        --probe-examples 8 --sample 16 --heldout 8 --tokens 64 --max-length 64 --probe-length 64 --out /tmp/sweep
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from iprox_lightning.analysis.retention import align_scores, retention_metrics, spearman
from iprox_lightning.batch import per_example_loss
from iprox_lightning.compress import compress_model, count_parameters, lowrank_layers
from iprox_lightning.data import SFTDataModule
from iprox_lightning.target_layers import find_target_linears, linear_weight
from iprox_lightning.probes import Probes, collect_probes
from iprox_lightning.scoring import influence_scores, tracin_scores

from bootstrap import percentile_interval  # bench/: the one bootstrap

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("IPROX_SHARED", ROOT.parent / "shared"))
if not SHARED.exists():
    SHARED = Path("/work/shared")
DEFAULT_MODEL = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_POOL = SHARED / "data" / "pool" / "instructions.jsonl"
DEFAULT_VALIDATION = f"eval:{SHARED / 'data' / 'eval'}"

# TracIn against the mean validation gradient (per-task scores are not needed: per_task=False)
TRACIN = dict(per_task=False, progress=False)

# metrics shown in the Markdown table, in order: (JSON key, column title, format)
TABLE_COLUMNS = [
    ("spearman", "Spearman", "{:+.4f}"), ("kendall", "Kendall", "{:+.4f}"), ("top10%", "top-10%", "{:.3f}"),
    ("top5%", "top-5%", "{:.3f}"), ("pearson", "Pearson", "{:+.4f}"), ("rel_objective_probe", "J/J0 probe", "{:.4f}"),
    ("rel_objective_heldout", "J/J0 held-out", "{:.4f}"), ("heldout_loss", "held-out loss", "{:.4f}"),
    ("factor_time_s", "factor s", "{:.1f}"),
]


# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------
def sweep_configs(modes: Iterable[str], dampings: Iterable[float], damping_modes: Iterable[str]) -> list[dict]:
    """Plain SVD first, then IPSVD over ``damping_mode × mode × damping``."""
    configs = [dict(method="svd", mode=None, damping=None, damping_mode=None)]
    for dm in damping_modes:
        for mode in modes:
            for d in dampings:
                configs.append(dict(method="ipsvd", mode=mode, damping=float(d), damping_mode=dm))
    return configs


def config_key(c: Mapping) -> str:
    if c["method"] != "ipsvd":
        return c["method"]
    return f"ipsvd/{c['mode']}/{c['damping_mode']}/{c['damping']:g}"


def best_row(rows: list[dict], method: str = "ipsvd") -> dict | None:
    """The row of ``method`` with the highest Spearman (tie-break: top-10% overlap)."""
    cand = [r for r in rows if r["method"] == method and math.isfinite(r["spearman"])]
    return max(cand, key=lambda r: (round(r["spearman"], 6), r["top10%"])) if cand else None


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def build_data(args, tokenizer) -> dict[str, Any]:
    """Disjoint probe / scored / held-out subsets of the pool (one seeded permutation) + validation."""
    dm = SFTDataModule(pool=args.pool, validation=args.validation, tokenizer=tokenizer,
                       max_length=args.val_max_length, val_per_task=args.val_per_task,
                       eval_batch_size=args.batch_size, seed=args.seed, builtin_size=args.builtin_size)
    pool = dm.pool_records
    need = args.probe_examples + args.sample + args.heldout
    if need > len(pool):
        raise ValueError(f"pool {args.pool} has {len(pool)} examples, the sweep needs {need} "
                         f"(probe {args.probe_examples} + sample {args.sample} + held-out {args.heldout})")
    perm = np.random.default_rng(args.seed).permutation(len(pool))
    take = lambda a, b: [pool[int(i)] for i in perm[a:b]]  # noqa: E731
    p, s = args.probe_examples, args.probe_examples + args.sample
    return dict(
        probe=dm.records_dataloader(take(0, p), args.probe_length, args.probe_batch_size),
        sample=dm.records_dataloader(take(p, s), args.max_length, args.batch_size),
        heldout=dm.records_dataloader(take(s, need), args.probe_length, args.probe_batch_size),
        validation=dm.validation_dataloader(),
        validation_tasks=dm.validation_tasks,
        n_validation=len(dm.validation_records),
    )


def load_target(name: str, tokenizer: str | None = None):
    """``(model, tokenizer)``: the target in float32, eval mode, frozen; ``tokenizer`` overrides the model's."""
    from iprox_lightning.models.loading import load_model, load_tokenizer

    model, tok = load_model(name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, (tok if tokenizer is None else load_tokenizer(tokenizer))


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
def undamped_objective(E: torch.Tensor, H: torch.Tensor, Delta: torch.Tensor) -> float:
    """``‖C_δ^{1/2} E C_h^{1/2}‖_F² = tr(C_δ E C_h Eᵀ) = ‖Δᵀ E H‖_F² / N²`` (float64), with
    ``C_h = H Hᵀ/N``, ``C_δ = Δ Δᵀ/N``: the paper's Eq. 3 without damping. Brute-force reference of
    :class:`ObjectiveMeter`."""
    N = H.shape[1]
    return float((Delta.double().T @ (E.double() @ H.double())).pow(2).sum()) / N**2


class ObjectiveMeter:
    """``J(AB)/J(0)`` (undamped, see :func:`undamped_objective`) of many factorisations of the same
    weights on the same probes. Precomputes ``G = Δᵀ W H`` (``N×N`` per layer) once; each
    factorisation then costs ``O(r·N·(in + out + N))`` per layer via
    ``Δᵀ (W − AB) H = G − (Δᵀ A)(B H)``, instead of ``O(in·out·N)``."""

    def __init__(self, weights: Mapping[str, torch.Tensor], probes: Probes, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.H = {n: probes.H[n].to(dtype) for n in weights}
        self.Dt = {n: probes.Delta[n].to(dtype).T.contiguous() for n in weights}
        self.G = {n: self.Dt[n] @ (weights[n].to(dtype) @ self.H[n]) for n in weights}
        self.J0 = {n: float(G.double().pow(2).sum()) for n, G in self.G.items()}

    def relative(self, name: str, A: torch.Tensor, B: torch.Tensor) -> float:
        if self.J0[name] <= 0:
            return float("nan")
        R = self.G[name] - (self.Dt[name] @ A.detach().to(self.dtype)) @ (B.detach().to(self.dtype) @ self.H[name])
        return float(R.double().pow(2).sum()) / self.J0[name]

    def mean_relative(self, proxy: torch.nn.Module) -> float:
        """Mean over the factorised (``LowRankLinear``) layers of ``proxy``."""
        vals = [self.relative(n, m.A, m.B) for n, m in lowrank_layers(proxy).items()]
        return float(np.mean(vals)) if vals else float("nan")


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: Iterable[Mapping]) -> float:
    """Mean per-example SFT loss (mean CE over each example's response tokens)."""
    tot, n = 0.0, 0
    for b in batches:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        losses, _ = per_example_loss(logits, b["labels"])
        tot, n = tot + float(losses.sum()), n + losses.numel()
    return tot / max(n, 1)


def scores_dict(table) -> dict[str, float]:
    return {str(k): float(v) for k, v in table.items()}


def retention(proxy: Mapping[str, float], target: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in retention_metrics(proxy, target).items()}


def spearman_interval(proxy: Mapping[str, float], target: Mapping[str, float], *, level: float = 0.9,
                      n_boot: int = 2000, seed: int = 0) -> list[float]:
    """Percentile bootstrap interval (:func:`bootstrap.percentile_interval` over the scored examples) of the
    Spearman correlation — how much of a difference between rows is sampling noise."""
    _, p, t = align_scores(proxy, target)
    a = (1 - level) / 2
    return percentile_interval(lambda i: spearman(p[i], t[i]), len(p), n_boot, seed, (100 * a, 100 * (1 - a)))


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------
def _fmt(v, f: str) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f.format(v)


def markdown(result: Mapping, n_boot: int = 2000) -> str:
    """The sweep's Markdown tables (TracIn retention for every row, then K-FAC if run); ``n_boot``: bootstrap
    resamples of each row's Spearman interval."""
    rows, best = result["rows"], result.get("best")
    ci = "target_scores" in result and all("proxy_scores" in r for r in rows)
    head = ["method", "mode", "damping mode", "damping"] + [c[1] for c in TABLE_COLUMNS[:1]]
    head += ["Spearman 90% CI"] * ci + [c[1] for c in TABLE_COLUMNS[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mark = " **(best)**" if best and config_key(r) == config_key(best) else ""
        cells = [r["method"] + mark, r["mode"] or "–", r["damping_mode"] or "–",
                 "–" if r["damping"] is None else f"{r['damping']:g}"]
        cells += [_fmt(r.get(k), f) for k, _, f in TABLE_COLUMNS[:1]]
        if ci:
            lo, hi = spearman_interval(r["proxy_scores"], result["target_scores"], n_boot=n_boot)
            cells.append(f"[{lo:+.2f}, {hi:+.2f}]")
        cells += [_fmt(r.get(k), f) for k, _, f in TABLE_COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n"
    if result.get("kfac"):
        out += "\nK-FAC retention (proxy K-FAC scores vs target K-FAC scores):\n\n"
        out += "| setting | Spearman | Kendall | top-10% | top-5% | Pearson |\n|---|---|---|---|---|---|\n"
        for key, m in result["kfac"].items():
            out += (f"| {key} | {m['spearman']:+.4f} | {m['kendall']:+.4f} | {m['top10%']:.3f} | "
                    f"{m['top5%']:.3f} | {m['pearson']:+.4f} |\n")
    return out


def write_outputs(prefix: Path | None, result: dict, n_boot: int = 2000) -> None:
    if prefix is None:
        return
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(prefix.with_suffix(".json"))
    prefix.with_suffix(".md").write_text(markdown(result, n_boot))


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
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--probe-examples", type=int, default=16)
    ap.add_argument("--probe-length", type=int, default=256)
    ap.add_argument("--probe-batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="probe columns N per layer")
    ap.add_argument("--sample", type=int, default=64, help="pool examples scored")
    ap.add_argument("--max-length", type=int, default=128, help="tokens per scored example")
    ap.add_argument("--heldout", type=int, default=16, help="held-out pool examples (loss, held-out J)")
    ap.add_argument("--val-per-task", type=int, default=4)
    ap.add_argument("--val-max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["core", "exact"])
    ap.add_argument("--dampings", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0])
    ap.add_argument("--damping-modes", nargs="+", default=["relative", "absolute"])
    ap.add_argument("--no-svd", action="store_true", help="skip the plain-SVD row")
    ap.add_argument("--kfac", action="store_true", help="K-FAC retention of plain SVD and the best IPSVD row")
    ap.add_argument("--kfac-damping", type=float, default=1e-3, help="K-FAC scoring damping (relative)")
    ap.add_argument("--ci-resamples", type=int, default=2000,
                    help="bootstrap resamples of the Markdown table's Spearman 90%% CI (recomputed at every write)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="output prefix: PREFIX.json and PREFIX.md")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in PREFIX.json")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    prefix = Path(args.out) if args.out else None
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731

    target, tok = load_target(args.model, args.tokenizer)
    log(f"target {args.model}: {count_parameters(target):,} parameters; torch threads {torch.get_num_threads()}")
    data = build_data(args, tok)
    modules = find_target_linears(target)

    result: dict[str, Any] = {}
    if args.resume and prefix is not None and prefix.with_suffix(".json").exists():
        result = json.loads(prefix.with_suffix(".json").read_text())
        log(f"resuming: {len(result.get('rows', []))} row(s) already done")
    configs = sweep_configs(args.modes, args.dampings, args.damping_modes)
    if args.no_svd:
        configs = configs[1:]
    done = {config_key(r) for r in result.get("rows", [])}
    pending = [c for c in configs if config_key(c) not in done]

    t = time.perf_counter()
    probes = collect_probes(target, data["probe"], modules, num_tokens=args.tokens, seed=args.seed, progress=False)
    t_probes = time.perf_counter() - t
    msg = f"probes: N={probes.num_tokens} of {probes.num_valid_tokens} valid tokens, {probes.num_examples} examples " \
          f"({t_probes:.1f}s)"
    if pending:  # the objective meters are only needed for rows still to compute
        target_weights = {n: linear_weight(m).detach().clone() for n, m in modules.items()}
        heldout_probes = collect_probes(target, data["heldout"], modules, num_tokens=args.tokens, seed=args.seed + 1,
                                        progress=False)
        msg += f"; held-out probes N={heldout_probes.num_tokens} of {heldout_probes.num_valid_tokens} valid tokens"
        meter_probe = ObjectiveMeter(target_weights, probes)
        meter_heldout = ObjectiveMeter(target_weights, heldout_probes)
        del heldout_probes, target_weights
    log(msg)

    if "target_scores" not in result:
        t = time.perf_counter()
        ref = scores_dict(tracin_scores(target, data["sample"], data["validation"], **TRACIN))
        result.update(
            args=vars(args),
            machine=dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                         cpus=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads()),
            target=dict(params=count_parameters(target), heldout_loss=mean_loss(target, data["heldout"]),
                        scoring_time_s=time.perf_counter() - t, probe_time_s=t_probes,
                        probe_tokens=probes.num_tokens, probe_valid_tokens=probes.num_valid_tokens,
                        probe_examples=probes.num_examples, sample=len(ref), validation=data["n_validation"],
                        validation_tasks=data["validation_tasks"]),
            target_scores=ref, rows=[], kfac={},
        )
        log(f"target TracIn on {len(ref)} examples vs {data['n_validation']} validation examples in "
            f"{result['target']['scoring_time_s']:.1f}s; held-out loss {result['target']['heldout_loss']:.4f}")
    ref = result["target_scores"]

    def make_proxy(c: Mapping):
        proxy = copy.deepcopy(target)
        kw = {}
        if c["method"] == "ipsvd":
            kw = dict(mode=c["mode"], damping=c["damping"], damping_mode=c["damping_mode"])
        rep = compress_model(proxy, None, args.sparsity, method=c["method"], probes=probes, progress=False,
                             seed=args.seed, allocation="uniform", **kw)
        return proxy, rep

    for c in pending:
        key = config_key(c)
        t0 = time.perf_counter()
        proxy, rep = make_proxy(c)
        t_score = time.perf_counter()
        table = scores_dict(tracin_scores(proxy, data["sample"], data["validation"], **TRACIN))
        t_score = time.perf_counter() - t_score
        own = [lr.relative_objective for lr in rep.layers if lr.relative_objective is not None]
        row = dict(
            **c, key=key, **retention(table, ref),
            rel_objective_probe=meter_probe.mean_relative(proxy),
            rel_objective_heldout=meter_heldout.mean_relative(proxy),
            rel_objective_own=float(np.mean(own)) if own and c["method"] == "ipsvd" else None,
            heldout_loss=mean_loss(proxy, data["heldout"]),
            factor_time_s=rep.time_factors_s, scoring_time_s=t_score,
            params_after=rep.params_after, params_before=rep.params_before,
            core_fallbacks=sum(lr.mode == "exact" for lr in rep.layers) if c["mode"] == "core" else 0,
            proxy_scores=table,
        )
        result["rows"].append(row)
        result["best"] = {k: v for k, v in (best_row(result["rows"]) or {}).items() if k != "proxy_scores"} or None
        write_outputs(prefix, result, args.ci_resamples)
        log(f"{key:28s} spearman {row['spearman']:+.4f} kendall {row['kendall']:+.4f} top10% {row['top10%']:.3f} "
            f"| J/J0 probe {row['rel_objective_probe']:.4f} held-out {row['rel_objective_heldout']:.4f} "
            f"| loss {row['heldout_loss']:.4f} | factors {rep.time_factors_s:.1f}s, scoring {t_score:.1f}s, "
            f"total {time.perf_counter() - t0:.1f}s")
        del proxy

    best = best_row(result["rows"])
    if best is not None:
        log(f"best IPSVD setting: {best['key']} (spearman {best['spearman']:+.4f}, top10% {best['top10%']:.3f})")
    if args.kfac:
        kf = dict(metric="kfac", damping=args.kfac_damping, damping_mode="relative", kfac_examples=args.sample,
                  per_task=False, progress=False)
        if "kfac_target_scores" not in result:
            t = time.perf_counter()
            result["kfac_target_scores"] = scores_dict(influence_scores(target, data["sample"], data["validation"], **kf))
            result["kfac_target"] = dict(
                time_s=time.perf_counter() - t, damping=args.kfac_damping,
                tracin_vs_kfac=retention(result["target_scores"], result["kfac_target_scores"]))
            write_outputs(prefix, result, args.ci_resamples)
            log(f"target K-FAC scores in {time.perf_counter() - t:.1f}s")
        chosen = [c for c in configs if c["method"] == "svd"] + ([best] if best is not None else [])
        for c in chosen:
            key = config_key(c)
            if key in result["kfac"]:
                continue
            proxy, _ = make_proxy(c)
            table = scores_dict(influence_scores(proxy, data["sample"], data["validation"], **kf))
            result["kfac"][key] = retention(table, result["kfac_target_scores"])
            write_outputs(prefix, result, args.ci_resamples)
            m = result["kfac"][key]
            log(f"K-FAC {key:28s} spearman {m['spearman']:+.4f} kendall {m['kendall']:+.4f} top10% {m['top10%']:.3f}")
            del proxy
    result["total_time_s"] = result.get("total_time_s", 0.0) + (time.perf_counter() - t_start)
    write_outputs(prefix, result, args.ci_resamples)
    print(markdown(result, args.ci_resamples))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
