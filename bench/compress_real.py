"""Time IPSVD compression of SmolLM2-135M-Instruct at several sparsities, both factor modes.

For each ρ it reports the proxy size (whole model, embeddings and LM head included), the probe
and factor times, and the mean relative weighted objective ``J(A B) / J(0)`` of exact vs core vs
plain SVD on the same probes. Probes are collected once (the probe pass does not depend on ρ).

    python bench/compress_real.py --examples 16 --max-length 256 --tokens 512 --sparsity 0.3 0.5 0.7

Model: ``--model`` (default ``../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf``), data: the first
``--examples`` rows of ``../shared/data/pool/instructions.jsonl`` (after a seeded shuffle),
formatted with the tokenizer's chat template; labels on response tokens only.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from iprox_lightning.compress import compress_model, count_parameters
from iprox_lightning.models.targets import find_target_linears
from iprox_lightning.probes import collect_probes

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("IPROX_SHARED", ROOT.parent / "shared"))
if not SHARED.exists():
    SHARED = Path("/work/shared")
DEFAULT_MODEL = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_POOL = SHARED / "data" / "pool" / "instructions.jsonl"


def load_real_model(path: str | Path):
    from iprox_lightning.models.loading import load_model

    return load_model(str(path), dtype=torch.float32, attn_implementation="eager")


def read_pool(path: str | Path, n: int, seed: int = 0, skip: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]
    random.Random(seed).shuffle(rows)
    return rows[skip : skip + n]


def encode(tok, row: dict, max_length: int) -> tuple[list[int], list[int]]:
    """Chat-template prompt + response; labels −100 on the prompt (response kept under truncation)."""
    user = row["instruction"] + (f"\n\n{row['context']}" if row.get("context") else "")
    prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    r_ids = tok(row["response"] + (tok.eos_token or ""), add_special_tokens=False)["input_ids"]
    p_ids = p_ids[: max(max_length // 2, max_length - len(r_ids))]
    ids = (p_ids + r_ids)[:max_length]
    labels = [-100] * len(p_ids) + r_ids
    return ids, labels[: len(ids)]


def make_batches(tok, rows: list[dict], max_length: int, batch_size: int) -> list[dict]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batches = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        enc = [encode(tok, r, max_length) for r in chunk]
        T = max(len(e[0]) for e in enc)
        ids = torch.full((len(enc), T), pad, dtype=torch.long)
        mask = torch.zeros(len(enc), T, dtype=torch.long)
        labels = torch.full((len(enc), T), -100, dtype=torch.long)
        for j, (x, y) in enumerate(enc):
            ids[j, : len(x)] = torch.tensor(x)
            mask[j, : len(x)] = 1
            labels[j, : len(y)] = torch.tensor(y)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                        "id": [str(r.get("id", i + j)) for j, r in enumerate(chunk)]})
    return batches


def mean_rel(report) -> float:
    vals = [lr.relative_objective for lr in report.layers if lr.relative_objective is not None]
    return sum(vals) / len(vals)


@torch.no_grad()
def eval_loss(model, batches) -> float:
    from iprox_lightning.batch import per_example_loss

    tot, n = 0.0, 0
    for b in batches:
        losses, _ = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
        tot, n = tot + float(losses.sum()), n + losses.numel()
    return tot / n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--examples", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="probe columns N per layer")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--modes", nargs="+", default=["exact", "core"])
    ap.add_argument("--damping", type=float, default=None)
    ap.add_argument("--damping-mode", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from iprox_lightning.compress import DEFAULT_DAMPING, DEFAULT_DAMPING_MODE

    damping = args.damping if args.damping is not None else DEFAULT_DAMPING
    damping_mode = args.damping_mode or DEFAULT_DAMPING_MODE

    t = time.perf_counter()
    target, tok = load_real_model(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t:.1f}s; {count_parameters(target):,} parameters", flush=True)
    batches = make_batches(tok, read_pool(args.pool, args.examples), args.max_length, args.batch_size)
    eval_batches = make_batches(tok, read_pool(args.pool, 8, skip=args.examples), args.max_length, args.batch_size)
    t = time.perf_counter()
    probes = collect_probes(target, batches, find_target_linears(target), num_tokens=args.tokens, progress=False)
    t_probes = time.perf_counter() - t
    print(f"probes: {probes.num_tokens} tokens of {probes.num_valid_tokens} valid, {probes.num_examples} examples, "
          f"{t_probes:.1f}s (one forward/backward)", flush=True)
    base_loss = eval_loss(target, eval_batches)
    print(f"target held-out loss {base_loss:.4f}  (damping {damping} {damping_mode})", flush=True)
    results = []
    for rho in args.sparsity:
        for method, mode in [("ipsvd", m) for m in args.modes] + [("svd", None)]:
            model = copy.deepcopy(target)
            kw = dict(mode=mode) if mode else {}
            rep = compress_model(model, None, rho, method=method, damping=damping, damping_mode=damping_mode,
                                 probes=probes, progress=False, **kw)
            loss = eval_loss(model, eval_batches)
            row = dict(sparsity=rho, method=method, mode=mode, params_after=rep.params_after,
                       params_requested=rep.params_requested, params_before=rep.params_before,
                       size_mb_fp32=rep.params_after * 4 / 2**20, factor_time_s=rep.time_factors_s,
                       probe_time_s=t_probes, mean_rel_objective=mean_rel(rep), heldout_loss=loss,
                       fallbacks=sum(lr.mode == "exact" for lr in rep.layers if mode == "core"))
            results.append(row)
            print(f"rho={rho} {method:5s} {mode or '-':5s} params {rep.params_after:,} "
                  f"({rep.params_after / rep.params_before:.3f} of target, requested {rep.params_requested:,}) "
                  f"fp32 {row['size_mb_fp32']:.1f} MiB | factors {rep.time_factors_s:.1f}s | "
                  f"mean J/J0 {row['mean_rel_objective']:.4g} | held-out loss {loss:.3f}"
                  + (f" | core->exact fallbacks {row['fallbacks']}" if row["fallbacks"] else ""), flush=True)
            del model
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), damping=damping, damping_mode=damping_mode,
                                                   target_loss=base_loss, results=results), indent=2))


if __name__ == "__main__":
    sys.exit(main())
