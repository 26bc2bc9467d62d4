"""Scoring speed: the engine vs the LESS way vs a plain forward+backward, on the same batches.

Three ways, interleaved batch by batch (so load changes on a shared machine hit all of them):

  (a) engine   — ``InfluenceScorer.score_batch``: one forward, one backward w.r.t. the inputs only,
                 per-layer ghost / materialised features from hooks;
  (b) LESS way — per-example loop, batch size 1 (no padding), autograd gradient of the tracked
                 weights, flattened and concatenated, then dot products / norms with the flat
                 validation gradient(s);
  (c) floor    — a plain forward + ``loss.backward()`` of the same batch: (c1) with only the tracked
                 weights trainable (the paper's setting: embeddings / LM head frozen), (c2) with every
                 parameter trainable.

It also checks that (a) and (b) give the same scores. With ``--proxy-rhos`` it times (a) for low-rank
proxies of the same model at each sparsity ρ too (plain SVD factors: the shapes of an IPSVD proxy, realistic values),
in the same interleaved loop, and reports proxy/target ratios. ``--out FILE.json`` saves every number.
Examples:

  python bench/speed.py --model /work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --pool /work/shared/data/pool/instructions.jsonl --batches 4 --batch-size 8 --seq-len 256
  python bench/speed.py --random-init --shape llama-1b --device cuda --dtype bfloat16 --batches 8 \
      --proxy-rhos 0.3 0.5 0.7 --out bench/results/speed_llama-1b_gpu.json   # on a lent GPU
  python bench/speed.py --random-init --shape tiny --batches 2          # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from transformers.pytorch_utils import Conv1D

from iprox_lightning.engine import IGNORE_INDEX, LowRankLinear, per_example_loss, unfused_head
from iprox_lightning.scoring import InfluenceScorer, ScoringConfig, trim_batch

SHAPES = {
    # random-init Llama shapes (transformers LlamaConfig kwargs)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "smollm-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    # Llama-3.2-1B / -3B shapes
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # Llama-2-7B and Llama-3.1-8B (the paper's and LESS's scale): for --flops-only, too big to time on a CPU
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def peak_memory(device, peaks: dict | None, key: str):
    """The peak CUDA memory allocated while the block runs (``torch.cuda.max_memory_allocated``, reset on entry, so it
    counts what was already resident: the process's peak during this stage), stored as ``peaks[key]`` (the largest
    over repeated entries). Nothing on a CPU device or when ``peaks`` is None."""
    if device.type != "cuda" or peaks is None:
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        peaks[key] = max(peaks.get(key, 0), torch.cuda.max_memory_allocated(device))


def build_model(args):
    if args.random_init:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=4096)
        torch.manual_seed(0)
        # built on the device it runs on: initialising a 1B model on the CPU took 72 s on the H100 machine's 16 cores
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=args.attn, dtype=getattr(torch, args.dtype))
        return model.eval(), None
    from iprox_lightning.models import load_model

    return load_model(args.model, dtype=args.dtype, attn_implementation=args.attn)


def real_batches(tok, args, n_batches, offset):
    """Pool examples formatted with a plain template, long enough for ``seq_len`` tokens; the prompt
    (instruction + context) is masked, the response is scored; truncated to exactly ``seq_len``."""
    out, cur = [], []
    eos = tok.eos_token or ""
    with open(args.pool) as f:
        for line in f:
            r = json.loads(line)
            prompt = f"### Instruction:\n{r['instruction']}\n\n"
            if r.get("context"):
                prompt += f"### Input:\n{r['context']}\n\n"
            prompt += "### Response:\n"
            p = tok(prompt, add_special_tokens=False)["input_ids"]
            a = tok(r["response"] + eos, add_special_tokens=False)["input_ids"]
            if len(p) > args.seq_len // 2 or len(p) + len(a) < args.seq_len:
                continue
            if offset > 0:
                offset -= 1
                continue
            ids = (p + a)[: args.seq_len]
            labels = [IGNORE_INDEX] * len(p) + ids[len(p):]
            cur.append((r["id"], r.get("category") or "all", ids, labels))
            if len(cur) == args.batch_size:
                out.append(collate(cur))
                cur = []
                if len(out) == n_batches:
                    return out
    raise SystemExit(f"not enough pool examples with >= {args.seq_len} tokens in {args.pool}")


def random_batches(vocab, args, n_batches, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n_batches):
        rows = []
        for j in range(args.batch_size):
            ids = torch.randint(3, vocab, (args.seq_len,), generator=g).tolist()
            p = args.seq_len // 4
            rows.append((f"r{seed}-{b}-{j}", ["t0", "t1"][j % 2], ids, [IGNORE_INDEX] * p + ids[p:]))
        out.append(collate(rows))
    return out


def collate(rows):
    T = max(len(r[2]) for r in rows)
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for b, (_, _, x, y) in enumerate(rows):
        ids[b, : len(x)], mask[b, : len(x)], labels[b, : len(y)] = torch.tensor(x), 1, torch.tensor(y)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "id": [r[0] for r in rows],
            "task": [r[1] for r in rows]}


def tracked_tensors(scorer):
    """(tensor, transpose?) per VirtualLinear, in the scorer's order."""
    out = []
    for v in scorer.linears:
        m = scorer.modules[v.module_name]
        if isinstance(m, LowRankLinear):
            out.append((m.A if v.key.endswith(".A") else m.B, False))
        else:
            out.append((m.weight, isinstance(m, Conv1D)))
    return out


def less_way(model, scorer, flat_val, batch, device):
    """Per-example loop, batch size 1, materialised flat gradients (LESS)."""
    params = [p for p, _ in tracked_tensors(scorer)]
    sizes = [p.numel() for p in params]
    req = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    scores = []
    try:
        for b in range(batch["input_ids"].shape[0]):
            L = int(batch["attention_mask"][b].sum())
            ids = batch["input_ids"][b: b + 1, :L].to(device)
            labels = batch["labels"][b: b + 1, :L].to(device)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            loss, _ = per_example_loss(logits, labels)
            grads = torch.autograd.grad(loss.sum(), params)
            g = torch.cat([(gr.t() if tr else gr).reshape(-1) for gr, (_, tr) in zip(grads, tracked_tensors(scorer))])
            # float32 reductions over ~1e8 elements are off by ~1% on CPU (checked: x.norm() of 106M
            # float32 values errs by 1%), so reduce per layer segment and accumulate in float64
            dot = sq = vsq = 0.0
            for seg_g, seg_v in zip(g.split(sizes), flat_val.split(sizes)):
                seg_g = seg_g.float()  # bf16 / fp16 models: reduce in float32 per segment
                dot += float(seg_g @ seg_v)
                sq += float(seg_g @ seg_g)
                vsq += float(seg_v @ seg_v)
            scores.append(dot / max((sq * vsq) ** 0.5, 1e-30))
    finally:
        for p, r in zip(params, req):
            p.requires_grad_(r)
    return scores


def floor(model, batch, device, trainable):
    """Plain forward + backward with ``trainable`` parameters requiring grad."""
    req = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(p in trainable)
    try:
        b = trim_batch({k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()})
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
        loss, _ = per_example_loss(logits, b["labels"])
        loss.sum().backward()
    finally:
        for p in model.parameters():
            p.grad = None
            p.requires_grad_(req[p])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--pool", default="/work/shared/data/pool/instructions.jsonl")
    ap.add_argument("--random-init", action="store_true", help="random weights of --shape, random tokens")
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--val-batches", type=int, default=1)
    ap.add_argument("--method", default="tracin", choices=["tracin", "kfac"])
    ap.add_argument("--per-task", action="store_true", help="score against each validation task too (K vectors)")
    ap.add_argument("--feature-mode", default="auto", choices=["auto", "ghost", "materialize"])
    ap.add_argument("--skip-less", action="store_true", help="skip (b)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="print the scores of (a) and (b)")
    ap.add_argument("--proxy-rhos", type=float, nargs="*", default=[],
                    help="also time (a) for low-rank proxies (SVD factors) at these sparsities")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--proxy-factors", default="svd", choices=["svd", "random"],
                    help="the --proxy-rhos proxies' factors: plain SVD of each weight (realistic values; on a CPU, random "
                         "factors on real weights gave denormals and slower scoring) or LowRankLinear's random init "
                         "(no SVD: the same shapes in a fraction of the build time, for timing large shapes on a GPU)")
    ap.add_argument("--proxy-dirs", nargs="*", default=[],
                    help="also time saved proxies (directories `save_proxy` / a build wrote), as the --proxy-rhos ones")
    ap.add_argument("--store-k", type=int, default=0,
                    help="also time the gradient store's per-batch work (GradientProjector.project_batch, k rows per "
                         "side) of the target (way s) and of each proxy (s<rho>), in the same rotation")
    ap.add_argument("--compare-unfused", action="store_true",
                    help="also time the engine (a), each proxy and each store way with the LM head NOT fused with the "
                         "cross-entropy (batch.scored_logits: [N, V] logits, as before the fusion), ways '<key>~'")
    ap.add_argument("--profile", action="store_true",
                    help="after the timing, profile one engine step of the target and of each proxy: the split of its "
                         "time between block linears, LM head + cross-entropy, attention and the rest ('profile')")
    ap.add_argument("--head-share", type=float, default=None,
                    help="share of the tokens the LM head runs on (the response tokens, batch.scored_logits) in the "
                         "analytic FLOP ratios; default: the timed batches' share, 1 with --flops-only")
    ap.add_argument("--flops-only", action="store_true",
                    help="time nothing: the analytic scoring-FLOP ratio proxy/target of every --shape at each "
                         "--proxy-rhos (uniform ranks at the sparsity; iprox_lightning.analysis.flops)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.flops_only:
        share = 1.0 if args.head_share is None else args.head_share
        return write_result(args, {"seq_len": args.seq_len, "head_share": share, "flop_ratios": {
            name: {f"{rho:g}": shape_flop_ratio(name, rho, args.seq_len, share) for rho in args.proxy_rhos}
            for name in SHAPES}})
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peaks: dict[str, int] = {}  # peak CUDA bytes per stage (CUDA only)
    model, scorer, batches, val = setup(args, device, peaks)
    share = scored_share(batches) if args.head_share is None else args.head_share
    proxies = {}
    for rho in args.proxy_rhos:
        with peak_memory(device, peaks, f"build_proxy:p{rho:g}"):
            proxies[f"p{rho:g}"] = build_proxy_scorer(model, rho, val, args, share)
        print(f"proxy rho={rho:g}: {proxies[f'p{rho:g}'][1]['params'] / 1e6:.1f}M params")
    for d in args.proxy_dirs:
        proxies[f"p:{Path(d).name}"] = saved_proxy_scorer(model, d, val, args, share, device)
    times, diffs = time_ways(args, device, model, scorer, proxies, batches, peaks)
    n_tok = sum(int(b["attention_mask"].sum()) for b in batches)
    tot, ratios = print_totals(args, times, diffs, proxies, n_tok)
    result = dict(
        args=vars(args), device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__, threads=torch.get_num_threads(), tokens=n_tok, head_share=share,
        params=sum(p.numel() for p in model.parameters()), tracked_params=scorer.settings()["tracked_parameters"],
        times_s=times, totals_s=tot, tokens_per_s={k: n_tok / v for k, v in tot.items()}, ratios=ratios,
        max_abs_diff_engine_vs_loop=max(diffs) if diffs else None,
        proxies={k: info for k, (_, info) in proxies.items()},
        peak_cuda_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        # per stage: build_model, fit_validation (validation gradients, K-FAC factors), build_proxy:<p>, and each timed
        # way by its key (a, c1, c2, p<rho>, s, s<rho>): the process's peak while that stage ran
        peak_cuda_bytes_per_stage=peaks if device.type == "cuda" else None,
    )
    if args.profile:
        result["profile"] = {k: time_split(fn, batches[-1], model.config.vocab_size) for k, fn in
                             {"a": scorer.score_batch, **{k: p.score_batch for k, (p, _) in proxies.items()}}.items()}
    return write_result(args, result)


def time_split(score_batch, batch, vocab: int) -> dict[str, float]:
    """Where one engine step's time goes (``torch.profiler``, self time in seconds, one batch): the 2-D matmuls
    (``mm`` / ``addmm``: the block linears — what a proxy compresses — and the trackers' own products), the LM head and
    its cross-entropy (any op on a tensor with a vocabulary dimension), attention kernels, and everything else (norms,
    activations, rotary, batched feature products, copies)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        score_batch(batch)
    split = {"block_linears": 0.0, "lm_head_and_ce": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("autograd::") or e.key == "ProfilerStep":
            continue
        if any(vocab in shape for shape in e.input_shapes if isinstance(shape, list)):
            part = "lm_head_and_ce"
        elif "attention" in e.key:
            part = "attention"
        elif e.key in ("aten::mm", "aten::addmm"):
            part = "block_linears"
        else:
            part = "other"
        split[part] += e.self_cpu_time_total / 1e6
    return split


def setup(args, device, peaks: dict | None = None):
    """The target on ``device``, its fitted scorer, the timed batches and the validation batches (with ``peaks``: the
    peak CUDA memory of the model's build and of the scorer's fit, :func:`peak_memory`)."""
    t0 = time.perf_counter()
    with peak_memory(device, peaks, "build_model"):
        model, tok = build_model(args)
        model.to(device)
    print(f"model loaded in {time.perf_counter() - t0:.1f}s: "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, device={device}, "
          f"threads={torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    if args.random_init:
        vocab = model.config.vocab_size
        batches = random_batches(vocab, args, args.batches, seed=1)
        val = random_batches(vocab, args, args.val_batches, seed=2)
    else:
        val = real_batches(tok, args, args.val_batches, offset=0)
        batches = real_batches(tok, args, args.batches, offset=args.val_batches * args.batch_size)
    n_tok = sum(int(b["attention_mask"].sum()) for b in batches)
    print(f"{args.batches} batches x {args.batch_size} x <= {args.seq_len} tokens ({n_tok} real tokens)")

    t0 = time.perf_counter()
    with peak_memory(device, peaks, "fit_validation"):
        scorer = fitted_scorer(model, val, args)
    sync(device)
    print(f"validation gradients{' + K-FAC factors' if args.method == 'kfac' else ''}: "
          f"{time.perf_counter() - t0:.1f}s, {scorer.settings()['tracked_parameters'] / 1e6:.1f}M tracked params, "
          f"K={len(scorer.task_names)} validation direction(s)")
    from iprox_lightning.scoring import choose_mode

    modes: dict[str, int] = {}
    for v in scorer.linears:
        m = choose_mode(args.seq_len, v.in_features, v.out_features, len(scorer.task_names), args.feature_mode)
        modes[m] = modes.get(m, 0) + 1
    print(f"per-layer feature paths at T={args.seq_len}: {modes}")
    return model, scorer, batches, val


def time_ways(args, device, model, scorer, proxies, batches, peaks: dict | None = None
              ) -> tuple[dict[str, list[float]], list[float]]:
    """Every way timed on every batch, the order rotating batch by batch (after one untimed warm-up batch); and
    per batch the largest |score (a) - score (b)| (with ``peaks``: each way's peak CUDA memory, by its key)."""
    tracked = {p for p, _ in tracked_tensors(scorer)}
    everything = set(model.parameters())
    flat_val = None
    if not args.skip_less and args.method == "tracin":
        n = float(scorer.val_counts.sum())
        flat_val = torch.cat([scorer.V[v.key].sum(0).reshape(-1) for v in scorer.linears]).float() / n

    def timed(fn, key):
        with peak_memory(device, peaks, key):
            sync(device)
            t = time.perf_counter()
            r = fn()
            sync(device)
            return time.perf_counter() - t, r

    # warm-up (allocator, kernels) on the first batch, not timed
    small = {k: (v[:2] if torch.is_tensor(v) else v[:2]) for k, v in batches[0].items()}
    scorer.score_batch(small)
    floor(model, small, device, tracked)
    for pscorer, _ in proxies.values():
        pscorer.score_batch(small)
    stores = {}
    if args.store_k:
        from iprox_lightning.scoring import GradientProjector

        stores = {"s": GradientProjector(model, k=args.store_k)}
        stores.update({f"s{k[1:]}": GradientProjector(pscorer.model, k=args.store_k)
                       for k, (pscorer, _) in proxies.items()})
        for projector in stores.values():
            projector.project_batch(small)

    keys = ["c1", "a", "b", "c2", *proxies, *stores]
    if args.compare_unfused:
        keys += [f"{k}~" for k in ("a", *proxies, *stores)]
    # the engine ways by key (the target's scoring, each proxy's, each store's) and the model each one runs
    engine = {"a": scorer.score_batch, **{k: p.score_batch for k, (p, _) in proxies.items()},
              **{k: s.project_batch for k, s in stores.items()}}
    models = {"a": model, **{k: p.model for k, (p, _) in proxies.items()}, **{k: s.model for k, s in stores.items()}}
    times: dict[str, list[float]] = {k: [] for k in keys}
    diffs = []
    for j, batch in enumerate(batches):
        order = keys[j % len(keys):] + keys[: j % len(keys)]  # rotate the order
        for key in order:
            if key.endswith("~"):  # the same way with the LM head unfused (full [N, V] logits)
                with unfused_head(models[key[:-1]]):
                    dt, _ = timed(lambda: engine[key[:-1]](batch), key)
            elif key in proxies or key in stores:
                dt, _ = timed(lambda: engine[key](batch), key)
            elif key == "a":
                dt, res = timed(lambda: scorer.score_batch(batch), key)
                a_scores = res["score"]
            elif key == "b":
                if flat_val is None:
                    continue
                dt, b_scores = timed(lambda: less_way(model, scorer, flat_val, batch, device), key)
            elif key == "c1":
                dt, _ = timed(lambda: floor(model, batch, device, tracked), key)
            else:
                dt, _ = timed(lambda: floor(model, batch, device, everything), key)
            times[key].append(dt)
        if flat_val is not None:
            diffs.append(max(abs(x - y) for x, y in zip(a_scores, b_scores)))
            if args.verbose:
                print("  (a)", [round(float(x), 6) for x in a_scores], "\n  (b)", [round(x, 6) for x in b_scores])
        print(f"batch {j}: " + ", ".join(f"{k}={v[-1]:.2f}s" for k, v in times.items() if v), flush=True)
    return times, diffs


def print_totals(args, times, diffs, proxies, n_tok) -> tuple[dict[str, float], dict[str, float]]:
    """Totals per way and the ratios (engine / floors, loop / engine, proxy / target), printed."""
    tot = {k: sum(v) for k, v in times.items() if v}
    print("\n=== totals over", args.batches, "batches ===")
    labels = [("a", "(a) engine"), ("b", "(b) LESS per-example loop"), ("c1", "(c1) fwd+bwd, tracked weights"),
              ("c2", "(c2) fwd+bwd, all params")] + [(k, f"(a) engine, proxy rho={k[1:]}") for k in proxies]
    for k, label in labels:
        if k in tot:
            print(f"{label:34s} {tot[k]:8.2f}s  (median batch {statistics.median(times[k]):.2f}s, "
                  f"{n_tok / tot[k]:,.0f} tokens/s)")
    ratios = {"engine/fwd_bwd_tracked": tot["a"] / tot["c1"], "engine/fwd_bwd_all": tot["a"] / tot["c2"]}
    print(f"(a)/(c1) = {ratios['engine/fwd_bwd_tracked']:.3f}   (a)/(c2) = {ratios['engine/fwd_bwd_all']:.3f}")
    if "b" in tot:
        ratios["loop/engine"] = tot["b"] / tot["a"]
        print(f"(b)/(a)  = {ratios['loop/engine']:.3f}   max |score_a - score_b| = {max(diffs):.2e}")
    if "s" in tot:
        timed_stores = [f"s{k[1:]}" for k in proxies if f"s{k[1:]}" in tot]
        print(f"(s) store, target {tot['s']:8.2f}s" + "".join(
            f"; proxy {k[1:]} {tot[k]:.2f}s (/ target {tot[k] / tot['s']:.3f})" for k in timed_stores))
        ratios.update({f"store_proxy{k[1:]}/store_target": tot[k] / tot["s"] for k in timed_stores})
        ratios["store/engine"] = tot["s"] / tot["a"]
    for k in [k for k in tot if k.endswith("~")]:  # --compare-unfused: fused over unfused, per way
        ratios[f"{k[:-1]}:fused/unfused"] = tot[k[:-1]] / tot[k]
        print(f"{k[:-1]}: fused head / unfused = {ratios[f'{k[:-1]}:fused/unfused']:.3f}")
    for k in proxies:
        ratios[f"proxy{k[1:]}/target"] = tot[k] / tot["a"]
        ratios[f"proxy{k[1:]}/target_flops"] = proxies[k][1]["flop_ratio"]
        print(f"proxy rho={k[1:]} / target (engine) = {ratios[f'proxy{k[1:]}/target']:.3f} "
              f"(analytic FLOPs {proxies[k][1]['flop_ratio']:.3f})")
    return tot, ratios


WAY_LABELS = {"a": "(a) scoring engine, target", "b": "(b) LESS per-example loop",
              "c1": "(c1) plain fwd + bwd, tracked weights trainable", "c2": "(c2) plain fwd + bwd, all parameters",
              "s": "(s) gradient store's per-batch work, target"}


def way_label(way: str) -> str:
    """The table label of a timed way (``p0.5``: the engine on the ρ = 0.5 proxy; ``s0.5``: its store; a trailing
    ``~``: the same way with the LM head unfused, ``--compare-unfused``)."""
    base, unfused = way.removesuffix("~"), way.endswith("~")
    if base in WAY_LABELS:
        label = WAY_LABELS[base]
    else:
        label = (WAY_LABELS["a"] if base[0] == "p" else WAY_LABELS["s"]).replace("target", f"proxy ρ = {base[1:]}")
    return label + (", head unfused" if unfused else "")


def markdown(result: dict) -> str:
    """The table of one ``--out`` result: every way's total seconds over the run's batches, the proxies' time over
    the target's same way (engine or store, fused or not) and their analytic FLOP ratio."""
    tot, proxies, a = result["totals_s"], result.get("proxies", {}), result["args"]
    shape = "random weights of " + a["shape"] if a.get("random_init") else Path(a["model"]).name
    lines = [f"| way ({shape}; {a['batches']} batches × {a['batch_size']} × {a['seq_len']} tokens, "
             f"{result['threads']} threads, {result['device_name']}) | total s | / target's way | analytic FLOPs |",
             "|---|---|---|---|"]
    for way in sorted(tot, key=lambda w: (w.endswith("~"), w[0] == "s", w.removesuffix("~") not in WAY_LABELS, w)):
        base = way.removesuffix("~")
        ref = None if base in WAY_LABELS else ("a" if base[0] == "p" else "s") + way[len(base):]
        flops = proxies.get(f"p{base[1:]}", {}).get("flop_ratio") if ref else None
        lines.append(f"| {way_label(way)} | {tot[way]:.1f} | {f'{tot[way] / tot[ref]:.2f}' if ref else ''} | "
                     f"{f'{flops:.2f}' if flops is not None else ''} |")
    return "\n".join(lines) + "\n"


def write_result(args, result: dict) -> dict:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def scored_share(batches) -> float:
    """The share of the real tokens of ``batches`` whose next token is scored: where the LM head runs."""
    from iprox_lightning.engine import shifted_token_mask

    scored = sum(int(shifted_token_mask(b["labels"]).sum()) for b in batches)
    return scored / sum(int(b["attention_mask"].sum()) for b in batches)


def scoring_flop_ratio(target, proxy, seq_len: int, head_share: float = 1.0) -> float:
    """Analytic FLOPs of scoring one example with ``proxy`` over the same with ``target`` (forward, backward with the
    tracked layers' weight gradients, inner products, the LM head on ``head_share`` of the tokens;
    :func:`iprox_lightning.analysis.flops.scoring_flops`)."""
    from iprox_lightning.analysis import ModelShape, scoring_flops

    flops = [scoring_flops(s if isinstance(s, ModelShape) else ModelShape.from_model(s), n_train=1, n_val=0,
                           seq_len=seq_len, head_share=head_share)["total"] for s in (target, proxy)]
    return flops[1] / flops[0]


def shape_flop_ratio(name: str, rho: float, seq_len: int, head_share: float = 1.0) -> float:
    """:func:`scoring_flop_ratio` of the ``SHAPES[name]`` Llama (on the meta device) and its proxy at sparsity ``rho``
    with every block linear at the rank :func:`~iprox_lightning.compression.ranks.rank_for_sparsity` gives (left dense where that
    rank would not save parameters)."""
    from iprox_lightning.analysis import ModelShape
    from iprox_lightning.compression import rank_for_sparsity

    target = ModelShape.from_config({"model_type": "llama", **SHAPES[name]}, name=name)
    ranks = {l.name: r for l in target.linears if (r := rank_for_sparsity(l.in_features, l.out_features, rho))}
    return scoring_flop_ratio(target, target.with_ranks(ranks), seq_len, head_share)


def fitted_scorer(model, val, args):
    """``model``'s :class:`InfluenceScorer` (``--method``), fitted on the validation batches."""
    scorer = InfluenceScorer(model, ScoringConfig(method=args.method, kfac_examples=args.batch_size * args.val_batches,
                                                per_task=args.per_task, feature_mode=args.feature_mode))
    scorer.fit(val, val if args.method == "kfac" else None)
    return scorer


def saved_proxy_scorer(model, path, val, args, head_share: float, device):
    """A saved proxy (loaded as any model, with ``--attn`` and ``--dtype``) and its fitted scorer."""
    from iprox_lightning.models import load_model

    proxy, _ = load_model(str(path), dtype=args.dtype, attn_implementation=args.attn, tokenizer=False)
    proxy = proxy.to(device).eval().requires_grad_(False)
    scorer = fitted_scorer(proxy, val, args)
    params = sum(p.numel() for p in proxy.parameters())
    return scorer, dict(path=str(path), params=params, achieved_sparsity=None,
                        tracked_params=scorer.settings()["tracked_parameters"],
                        flop_ratio=scoring_flop_ratio(model, proxy, args.seq_len, head_share))


def build_proxy_scorer(model, rho, val, args, head_share: float):
    """A low-rank copy of ``model`` at sparsity ``rho`` (``--proxy-factors``: SVD or random factors) and its fitted
    scorer."""
    import copy

    from iprox_lightning.compression import compress_model

    proxy = copy.deepcopy(model)
    # plain SVD factors: an IPSVD proxy's shapes and realistic values (random factors on real weights gave activations
    # full of denormals and scored 2-3x slower than the real proxies built from the same ranks)
    rep = compress_model(proxy, None, rho, method=args.proxy_factors, progress=False, seed=0)
    for p in proxy.parameters():
        p.requires_grad_(False)
    scorer = fitted_scorer(proxy, val, args)
    return scorer, dict(rho=rho, params=rep.params_after, achieved_sparsity=rep.achieved_sparsity,
                        tracked_params=scorer.settings()["tracked_parameters"],
                        flop_ratio=scoring_flop_ratio(model, proxy, args.seq_len, head_share))


if __name__ == "__main__":
    main()
