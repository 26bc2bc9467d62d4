"""Compression cost and weighted error of IPSVD on a real model, at several sparsities.

For each ``ρ`` of ``--sparsity`` and each method of ``--methods`` (``exact`` / ``core`` = IPSVD
in that factor mode with the library's default damping unless ``--damping``/``--damping-mode``
are given; ``svd`` = plain truncated SVD) it compresses a fresh copy of the target with the SAME
probes (collected once: the probe pass does not depend on ``ρ``) and reports:

* proxy size — parameters of the whole model (embeddings and LM head included), requested vs
  achieved, and the float32 size in MiB;
* ``factor_s`` — wall-clock of the factor computation (the one probe pass is reported separately);
* ``J/J0 probe`` / ``J/J0 held-out`` — mean over the factorised layers of the undamped K-FAC
  weighted error ``‖Δᵀ (W − AB) H‖² / ‖Δᵀ W H‖²`` on the probes and on held-out probes
  (:class:`ipsvd_sweep.ObjectiveMeter`); ``J/J0 own`` — in the damped metric of the setting;
* ``heldout_loss`` — mean per-example SFT loss on the held-out examples (target's in the header).

Data as in ``bench/ipsvd_sweep.py`` (SFTDataModule formatting; probe and held-out sets are
disjoint slices of one seeded permutation of the pool)::

    python bench/compress_real.py --sparsity 0.3 0.5 0.7 --out bench/results/compress_smollm2

Built-in offline model (seconds)::

    python bench/compress_real.py --model builtin --pool builtin --tokenizer builtin --probe-examples 8 \\
        --heldout 8 --tokens 64 --probe-length 64 --out /tmp/compress
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ipsvd_sweep import (  # bench/
    DEFAULT_MODEL,
    DEFAULT_POOL,
    ObjectiveMeter,
    load_target,
    mean_loss,
)

from iprox_lightning.compress import (
    DEFAULT_DAMPING,
    DEFAULT_DAMPING_MODE,
    compress_model,
    count_parameters,
)
from iprox_lightning.data import SFTDataModule
from iprox_lightning.target_layers import find_target_linears, linear_weight
from iprox_lightning.probes import collect_probes

COLUMNS = [("params_after", "proxy params", "{:,}"), ("params_ratio", "of target", "{:.3f}"),
           ("size_mib_fp32", "fp32 MiB", "{:.1f}"), ("factor_time_s", "factor s", "{:.1f}"),
           ("rel_objective_probe", "J/J0 probe", "{:.4f}"), ("rel_objective_heldout", "J/J0 held-out", "{:.4f}"),
           ("heldout_loss", "held-out loss", "{:.3f}")]


def markdown(result: dict) -> str:
    head = ["ρ", "method"] + [c[1] for c in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        name = "svd" if r["method"] == "svd" else f"ipsvd/{r['mode']}"
        lines.append("| " + " | ".join([f"{r['sparsity']:g}", name] + [f.format(r[k]) for k, _, f in COLUMNS]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--builtin-size", type=int, default=400)
    ap.add_argument("--probe-examples", type=int, default=16)
    ap.add_argument("--heldout", type=int, default=8)
    ap.add_argument("--probe-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="probe columns N per layer")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--methods", nargs="+", default=["exact", "core", "svd"], choices=["exact", "core", "svd"])
    ap.add_argument("--damping", type=float, default=DEFAULT_DAMPING)
    ap.add_argument("--damping-mode", default=DEFAULT_DAMPING_MODE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="output prefix: PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731

    target, tok = load_target(args.model, args.tokenizer)
    n_params = count_parameters(target)
    log(f"target {args.model}: {n_params:,} parameters; torch threads {torch.get_num_threads()}")
    dm = SFTDataModule(pool=args.pool, validation=None, tokenizer=tok, max_length=args.probe_length,
                       seed=args.seed, builtin_size=args.builtin_size)
    pool = dm.pool_records
    perm = np.random.default_rng(args.seed).permutation(len(pool))
    n_p, n_h = args.probe_examples, args.heldout
    if n_p + n_h > len(pool):
        raise ValueError(f"pool {args.pool} has {len(pool)} examples, need {n_p + n_h}")
    probe_loader = dm.records_dataloader([pool[int(i)] for i in perm[:n_p]], args.probe_length, args.batch_size)
    heldout_loader = dm.records_dataloader([pool[int(i)] for i in perm[n_p:n_p + n_h]], args.probe_length,
                                   args.batch_size)
    modules = find_target_linears(target)
    weights = {n: linear_weight(m).detach().clone() for n, m in modules.items()}
    t = time.perf_counter()
    probes = collect_probes(target, probe_loader, modules, num_tokens=args.tokens, seed=args.seed, progress=False)
    t_probes = time.perf_counter() - t
    heldout_probes = collect_probes(target, heldout_loader, modules, num_tokens=args.tokens, seed=args.seed + 1,
                                    progress=False)
    meters = SimpleNamespace(probe=ObjectiveMeter(weights, probes), heldout=ObjectiveMeter(weights, heldout_probes))
    del heldout_probes
    target_loss = mean_loss(target, heldout_loader)
    log(f"probes: N={probes.num_tokens} of {probes.num_valid_tokens} valid tokens, {probes.num_examples} examples, "
        f"{t_probes:.1f}s (one forward/backward); target held-out loss {target_loss:.4f}")

    result = dict(args=vars(args), machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                                                torch=torch.__version__, threads=torch.get_num_threads()),
                  target=dict(params=n_params, heldout_loss=target_loss, probe_time_s=t_probes,
                              probe_tokens=probes.num_tokens, probe_valid_tokens=probes.num_valid_tokens),
                  rows=[])
    prefix = Path(args.out) if args.out else None
    for rho in args.sparsity:
        for meth in args.methods:
            model = copy.deepcopy(target)
            kw = dict(method="svd") if meth == "svd" else dict(method="ipsvd", mode=meth)
            rep = compress_model(model, None, rho, damping=args.damping, damping_mode=args.damping_mode, allocation="uniform",
                                 probes=probes, progress=False, seed=args.seed, **kw)
            own = [lr.relative_objective for lr in rep.layers if lr.relative_objective is not None]
            row = dict(sparsity=rho, method=kw["method"], mode=kw.get("mode"), params_after=rep.params_after,
                       params_requested=rep.params_requested, params_before=rep.params_before,
                       params_ratio=rep.params_after / rep.params_before, achieved_sparsity=rep.achieved_sparsity,
                       size_mib_fp32=rep.params_after * 4 / 2**20, factor_time_s=rep.time_factors_s,
                       rel_objective_probe=meters.probe.mean_relative(model),
                       rel_objective_heldout=meters.heldout.mean_relative(model),
                       rel_objective_own=float(np.mean(own)) if own else None,
                       heldout_loss=mean_loss(model, heldout_loader),
                       core_fallbacks=sum(lr.mode == "exact" for lr in rep.layers) if meth == "core" else 0,
                       ranks=sorted({lr.rank for lr in rep.layers if lr.rank is not None}))
            result["rows"].append(row)
            log(f"rho={rho} {meth:5s} params {rep.params_after:,} ({row['params_ratio']:.3f} of target, requested "
                f"{rep.params_requested:,}) fp32 {row['size_mib_fp32']:.1f} MiB | factors {rep.time_factors_s:.1f}s | "
                f"J/J0 probe {row['rel_objective_probe']:.4f} held-out {row['rel_objective_heldout']:.4f} | "
                f"held-out loss {row['heldout_loss']:.3f}"
                + (f" | core->exact fallbacks {row['core_fallbacks']}" if row["core_fallbacks"] else ""))
            del model
            if prefix is not None:
                prefix.parent.mkdir(parents=True, exist_ok=True)
                prefix.with_suffix(".json").write_text(json.dumps(result, indent=2))
                prefix.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
