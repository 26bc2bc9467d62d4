"""Damping sweep for IPSVD on SmolLM2-135M: which (mode, damping, damping_mode) keeps influence best.

Influence retention = Spearman correlation, over a sample of training examples, between the
TracIn-like scores ``cos(g(z), ḡ_val)`` of the proxy and of the target (``g`` = per-example gradient
of the mean response-token loss over the tracked parameters: the targeted linear weights for the
target, the ``A``/``B`` factors for the proxy; computed brute force, batch size 1). No alignment
(stage 2) is applied: this measures IPSVD initialisation alone. Probes are collected once.

    python bench/ipsvd_sweep.py --sparsity 0.5 --train 32 --val 8 --max-length 128
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compress_real import DEFAULT_MODEL, DEFAULT_POOL, load_real_model, make_batches, read_pool  # noqa: E402

from iprox_lightning.batch import per_example_loss
from iprox_lightning.compress import compress_model
from iprox_lightning.lowrank import LowRankLinear
from iprox_lightning.models.targets import find_target_linears, linear_weight
from iprox_lightning.probes import collect_probes


def tracked_params(model) -> list[torch.Tensor]:
    ps = []
    for _, m in find_target_linears(model).items():
        ps += [m.A, m.B] if isinstance(m, LowRankLinear) else [m.weight]
    return ps


def iter_grads(model, batches):
    """Yield each example's flat gradient (batch size 1) over the tracked parameters, one at a time
    (a SmolLM2 gradient is ~425 MB: never hold them all)."""
    params = tracked_params(model)
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        for b in batches:
            for i in range(b["input_ids"].shape[0]):
                n = int(b["attention_mask"][i].sum())
                logits = model(input_ids=b["input_ids"][i : i + 1, :n]).logits
                loss, _ = per_example_loss(logits, b["labels"][i : i + 1, :n])
                gs = torch.autograd.grad(loss.sum(), params)
                yield torch.cat([g.reshape(-1) for g in gs])
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)


def tracin(model, train_batches, val_batches) -> torch.Tensor:
    """``cos(g(z), ḡ_val)`` for every training example, streaming the gradients."""
    g_val, n = None, 0
    for g in iter_grads(model, val_batches):
        g_val, n = (g if g_val is None else g_val + g), n + 1
    g_val = g_val / n
    return torch.stack([torch.nn.functional.cosine_similarity(g, g_val, dim=0) for g in iter_grads(model, train_batches)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--probe-examples", type=int, default=16)
    ap.add_argument("--probe-length", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--train", type=int, default=32)
    ap.add_argument("--val", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--dampings", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tok = load_real_model(args.model)
    probe_b = make_batches(tok, read_pool(args.pool, args.probe_examples, seed=0), args.probe_length, 4)
    train_b = make_batches(tok, read_pool(args.pool, args.train, seed=1), args.max_length, 8)
    val_b = make_batches(tok, read_pool(args.pool, args.val, seed=2), args.max_length, 8)
    t = time.perf_counter()
    probes = collect_probes(target, probe_b, find_target_linears(target), num_tokens=args.tokens, progress=False)
    print(f"probes {probes.num_tokens} tokens in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    ref = tracin(target, train_b, val_b)
    print(f"target scores in {time.perf_counter() - t:.1f}s", flush=True)

    configs = [("svd", None, None, None)] + [
        ("ipsvd", mode, d, dm) for dm in ("relative", "absolute") for mode in ("exact", "core") for d in args.dampings
    ]
    rows = []
    for method, mode, d, dm in configs:
        proxy = copy.deepcopy(target)
        kw = dict(mode=mode, damping=d, damping_mode=dm) if method == "ipsvd" else {}
        rep = compress_model(proxy, None, args.sparsity, method=method, probes=probes, progress=False, **kw)
        scores = tracin(proxy, train_b, val_b)
        rho = float(spearmanr(ref.numpy(), scores.numpy()).statistic)
        k = max(1, len(ref) // 4)
        top = len(set(ref.topk(k).indices.tolist()) & set(scores.topk(k).indices.tolist())) / k
        row = dict(method=method, mode=mode, damping=d, damping_mode=dm, spearman=rho, top25_overlap=top,
                   factor_time_s=rep.time_factors_s)
        rows.append(row)
        print(f"{method:5s} {mode or '-':5s} {dm or '-':8s} {d if d is not None else '-':>6} | spearman {rho:+.4f} | "
              f"top-25% overlap {top:.2f} | factors {rep.time_factors_s:.1f}s", flush=True)
        del proxy
    best = max((r for r in rows if r["method"] == "ipsvd"), key=lambda r: r["spearman"])
    print("best:", best)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows, best=best), indent=2))


if __name__ == "__main__":
    sys.exit(main())
