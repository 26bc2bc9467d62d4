"""Stage-1 health sweep: how much of the target's function does each compression setting keep?

Cheap (no scoring): probes are collected once on the target from the product's probe split
(``SFTDataModule.probe_dataloader()``, the same split ``IPSVDCallback`` uses), every variant compresses
a copy of the target with :func:`~iprox_lightning.compress.compress_model`, and
:func:`~iprox_lightning.analysis.health.proxy_health` measures held-out loss, KL and top-1 agreement on
``--heldout`` pool examples outside the warm-up and construction splits. Results go to
``OUT/health.json`` after every variant (``--resume`` keeps finished ones).

Variants: Stage-1 settings in the grammar of ``bench/variants.py`` (``METHOD[/OPTION...]@RHO``, no ``le``, no
``+align``), e.g. ``ipsvd/exact/rel1e-3/global@0.5``.

    python bench/proxy_health.py --model bench/results/fidelity_v2/warmed --out bench/results/health_v2 --threads 2
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from iprox_lightning.analysis.health import proxy_health
from iprox_lightning.compress import compress_model
from iprox_lightning.data import SFTDataModule
from iprox_lightning.target_layers import find_target_linears
from iprox_lightning.probes import collect_probes

from fidelity_v2 import DEFAULT_MODEL, DEFAULT_POOL  # bench/: the fidelity run's inputs
from variants import parse_variant  # bench/: the variant grammar

DEFAULT_VARIANTS = [
    "ipsvd/exact/rel1e-3/global@0.5", "ipsvd/exact/rel1e-3@0.5", "ipsvd/core/abs1e-1@0.5", "svd@0.5",
    "svd/global@0.5", "ipsvd/exact/rel1e-2/global@0.5", "ipsvd/exact/rel1e-3/global/spare0@0.5",
    "ipsvd/exact/rel1e-3/global@0.3",
]


def load_target(name: str, tokenizer: str | None = None):
    """``(model, tokenizer)``: the target in float32, eval mode, frozen; ``tokenizer`` overrides the model's."""
    from iprox_lightning.models.loading import load_model, load_tokenizer

    model, tok = load_model(name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, (tok if tokenizer is None else load_tokenizer(tokenizer))


def compress_kwargs(spec: str) -> dict:
    """A Stage-1 variant -> ``compress_model`` keyword arguments (every layer at the same ρ unless ``/global``)."""
    v = parse_variant(spec)
    if v["kind"] != "proxy" or v["align"]:
        raise ValueError(f"variant {spec!r}: a Stage-1 setting METHOD[/OPTION...]@RHO (no le, no +align)")
    return {"allocation": "uniform", **v["ipsvd"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--tokens", type=int, default=1024, help="probe tokens N per layer")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--builtin-size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "health.json"
    result = json.loads(path.read_text()) if args.resume and path.exists() else {}
    t0 = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}", flush=True)  # noqa: E731

    target, tok = load_target(args.model)
    dm = SFTDataModule(pool=args.pool, validation=None, tokenizer=args.tokenizer or tok,
                       max_length=args.max_length, batch_size=8, seed=args.seed, builtin_size=args.builtin_size)
    used = set(dm.splits.warmup) | set(dm.splits.probe) | set(dm.splits.align)
    rest = [r for r in dm.pool_records if r["id"] not in used]
    pick = np.random.default_rng(args.seed + 1).permutation(len(rest))[: args.heldout]
    heldout = list(dm.records_dataloader([rest[int(i)] for i in pick], args.max_length, 8))
    result.setdefault("meta", {}).update(model=args.model, tokens=args.tokens, heldout=args.heldout,
                                         max_length=args.max_length, seed=args.seed)
    rows = result.setdefault("rows", {})
    todo = [v for v in args.variants if v not in rows]
    if not todo:
        log("nothing to do")
        return result
    tp = time.perf_counter()
    probes = collect_probes(target, dm.probe_dataloader(), find_target_linears(target), num_tokens=args.tokens,
                            seed=args.seed, progress=False)
    result["meta"]["probes"] = {"tokens": probes.num_tokens, "examples": probes.num_examples,
                                "time_s": time.perf_counter() - tp}
    log(f"probes: N={probes.num_tokens} from {probes.num_examples} examples")
    for spec in todo:
        kw = compress_kwargs(spec)
        proxy = copy.deepcopy(target)
        ts = time.perf_counter()
        rep = compress_model(proxy, None, probes=probes, progress=False, seed=args.seed, **kw)
        t_c = time.perf_counter() - ts
        h = proxy_health(target, proxy, heldout)
        ranks = {lr.name: lr.rank for lr in rep.layers}
        by_type: dict[str, list] = {}
        for name, r in ranks.items():
            by_type.setdefault(name.rsplit(".", 1)[-1], []).append(r)
        rows[spec] = {**h, "params": rep.params_after, "target_params_after": rep.target_params_after,
                      "achieved_sparsity": rep.achieved_sparsity, "time_s": t_c,
                      "dense_layers": sum(r is None for r in ranks.values()),
                      "mean_rank_by_type": {k: (float(np.mean([x for x in v if x is not None]))
                                                if any(x is not None for x in v) else None) for k, v in by_type.items()},
                      "dense_by_type": {k: sum(x is None for x in v) for k, v in by_type.items()},
                      "ranks": ranks}
        path.write_text(json.dumps(result, indent=1))
        log(f"{spec}: proxy loss {h['proxy_loss']:.3f} (target {h['target_loss']:.3f}), KL {h['kl']:.3f}, "
            f"top-1 {h['top1_agreement']:.3f}, params {rep.params_after:,}, dense {rows[spec]['dense_layers']}, "
            f"{t_c:.0f}s")
        del proxy
    return result


if __name__ == "__main__":
    main()
