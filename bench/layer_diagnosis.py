"""Where do BBH and TyDiQA lose the ranking? Per-layer diagnosis of the target's per-task TracIn score and of what a
proxy keeps of it (issue 22.2), from gradient stores built by the product (``train.py build_store``).

Inputs come from the effect benchmark (``bench/effect.py``: the pool stores of the warmed target and of each proxy,
``OUT/stores/<name>``) and the fidelity run (``bench/fidelity_v2.py``: the warmed target, the validation file with
every few-shot example of MMLU / BBH / TyDiQA, the proxies). Stages (each the product's command, recorded and
skipped when its fingerprint matches, like the other benchmarks):

1. **validation stores**: ``train.py build_store`` of the validation file with each model, with the pool store's
   settings (projection size and seed, so the same projections), so a task's summed validation gradient is a sum
   of stored vectors;
2. **per-layer attribution** (:mod:`iprox_lightning.analysis.layer_attribution`): per suite, each layer's share of
   the target's score variance over the 512 pool examples and how well it ranks alone; per proxy, how well it keeps
   each layer's part of the ranking (Spearman of the layer's contributions, proxy vs target), grouped per layer type
   and per block;
3. **Stage-1 health per task** (:func:`iprox_lightning.compression.health.proxy_health` on each suite's validation
   examples): held-out loss, KL(target ‖ proxy) and top-1 agreement of the aligned proxy and, with ``--stage1``, of
   the Stage-1-only proxy of the same settings (compressed here from the product's probe split).

``OUT/diagnosis.json`` first, ``OUT/diagnosis.md`` generated from it.

    python bench/layer_diagnosis.py --out bench/results/layer_diagnosis --threads 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from ledger import Stages, git_commit  # bench/: the stage ledger
from variants import dir_name  # bench/: the variant grammar

ORDER = ("mmlu", "bbh", "tydiqa")  # table order; other suites (the demo's families) after them


def suite_order(names) -> list[str]:
    return sorted(set(names), key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s))


def read_store(path: Path) -> tuple[list[str], list[str], np.ndarray, dict]:
    """``(ids, tasks, vectors float64 [n, D], store.json)`` of a gradient store, rows sorted by id."""
    from iprox_lightning.io import iter_shards, read_info

    info = read_info(path)
    ids, tasks, vecs = [], [], []
    for s in iter_shards(path):
        ids += list(s["ids"])
        tasks += [str(t) for t in s["tasks"]]
        vecs.append(s["vectors"].double().numpy())
    order = np.argsort(ids, kind="stable")
    X = np.concatenate(vecs)[order]
    return [ids[i] for i in order], [tasks[i] for i in order], X, info


def suite_sums(tasks: list[str], X: np.ndarray) -> dict[str, np.ndarray]:
    """Summed validation vectors per suite (a task ``mmlu.half0`` belongs to ``mmlu``)."""
    out: dict[str, np.ndarray] = {}
    for t, x in zip(tasks, X):
        s = t.split(".")[0]
        out[s] = x.copy() if s not in out else out[s] + x
    return out


def attribution(pool: dict, val: dict, proxies: dict[str, tuple[dict, dict]]) -> dict:
    from scipy.stats import spearmanr

    from iprox_lightning.analysis import group_table, layer_blocks, layer_contributions, task_layer_table

    ids, X, info = pool["ids"], pool["X"], pool["info"]
    blocks = layer_blocks(info["layout"], info["dim"])
    S = suite_sums(val["tasks"], val["X"])
    prepared = {}  # per proxy, once: its layer blocks and suite sums
    for name, (ppool, pval) in proxies.items():
        if ppool["ids"] != ids:
            raise ValueError(f"proxy {name}: its pool store holds other examples than the target's")
        prepared[name] = (ppool["X"], layer_blocks(ppool["info"]["layout"], ppool["info"]["dim"]),
                          suite_sums(pval["tasks"], pval["X"]))
    out = {}
    for suite in suite_order(S):
        score, contrib = layer_contributions(X, S[suite], blocks)
        row: dict = {"modules": task_layer_table(score, contrib),
                     "by_type": group_table(contrib, score, "type"), "by_block": group_table(contrib, score, "block"),
                     "proxies": {}}
        for name, (pX, pb, pS) in prepared.items():
            pscore, pcontrib = layer_contributions(pX, pS[suite], pb)
            row["proxies"][name] = {
                "spearman": float(spearmanr(pscore, score)[0]),
                "modules": task_layer_table(score, contrib, pcontrib),
                "by_type": group_table(contrib, score, "type", pcontrib),
                "by_block": group_table(contrib, score, "block", pcontrib),
                "proxy_by_type": group_table(pcontrib, pscore, "type"),
            }
        out[suite] = row
    return out


def health_per_suite(args, fid: Path, target_dir: str, proxies: dict[str, str]) -> dict:
    """``{model: {suite: proxy_health}}`` on each suite's validation examples (the aligned proxies, and the
    Stage-1-only proxy of ``--stage1`` compressed here)."""
    import copy

    import torch

    from iprox_lightning.compression import collect_probes, compress_model, proxy_health
    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.engine import find_target_linears
    from iprox_lightning.models import load_model

    warmed = target_dir
    dm = SFTDataModule(pool=str(fid / "sample.jsonl"), validation=str(fid / "validation.jsonl"), tokenizer=warmed,
                       max_length=args.max_length, batch_size=args.batch_size, seed=args.seed)
    recs = dm.validation_records
    by_suite = {s: [r for r in recs if str(r["category"]).split(".")[0] == s]
                for s in suite_order(str(r["category"]).split(".")[0] for r in recs)}
    target = load_model(warmed, tokenizer=False)[0].eval()
    models: dict[str, torch.nn.Module] = {n: load_model(d, tokenizer=False)[0].eval() for n, d in proxies.items()}
    if args.stage1:
        from fidelity_v2 import parse_variant

        v = parse_variant(args.stage1)
        # the product's probe split of the pool the proxies were built from (IPSVDCallback's)
        pdm = SFTDataModule(pool=args.pool, validation=None, tokenizer=warmed, max_length=args.max_length,
                            batch_size=args.batch_size, seed=args.seed)
        t0 = time.perf_counter()
        probes = collect_probes(target, pdm.probe_dataloader(), find_target_linears(target),
                                num_tokens=v["ipsvd"].get("num_probe_tokens", 1024), seed=args.seed, progress=False)
        opts = {k: val for k, val in v["ipsvd"].items() if k != "num_probe_tokens"}
        stage1 = copy.deepcopy(target)
        compress_model(stage1, None, probes=probes, progress=False, seed=args.seed, **opts)
        models[f"stage1 {args.stage1}"] = stage1.eval()
        print(f"stage-1 proxy {args.stage1} compressed in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for name, m in models.items():
        out[name] = {s: proxy_health(target, m, dm.records_dataloader(r)) for s, r in by_suite.items() if r}
        print(f"health {name}: " + "; ".join(f"{s} KL {h['kl']:.2f}" for s, h in out[name].items()), flush=True)
    return out


def proxy_ranks(proxy_dir: str) -> dict[str, str]:
    """``{module: "r<rank> (<share> of dense)"}`` of a proxy's factorised layers (its manifest); absent: dense."""
    man = Path(proxy_dir) / "iprox_proxy.json"
    if not man.exists():
        return {}
    layers = json.loads(man.read_text()).get("layers") or {}
    return {k: f"r{v['rank']} ({v['rank'] * (v['in_features'] + v['out_features']) / (v['in_features'] * v['out_features']):.2f} of dense)"
            for k, v in layers.items()}


def markdown(d: dict) -> str:
    m = d["meta"]
    lines = ["# Where the per-task ranking lives, and what the proxy keeps (bench/layer_diagnosis.py)", "",
             f"Warmed target vs {', '.join(m['proxies'])}; {m['pool_n']} pool examples (the fidelity sample), each "
             f"suite's summed validation gradient; stores with k = {m['k']} projection rows per side. `share`: the "
             "layer group's share of the target's score variance (sums to 1); `alone`: Spearman of the group's "
             "contribution with the full score; `kept`: Spearman of the proxy's contribution with the target's. "
             f"Commit {m['commit']}.", ""]
    for suite, r in d["attribution"].items():
        names = list(r["proxies"])
        lines += [f"## {suite}", "", "Whole score, proxy vs target Spearman: " + "; ".join(
            f"{n} {r['proxies'][n]['spearman']:+.2f}" for n in names), "",
                  "| layer type | share | alone | " + " | ".join(f"kept ({n})" for n in names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for g, v in sorted(r["by_type"].items(), key=lambda kv: -kv[1]["share"]):
            lines.append(f"| {g} | {v['share']:+.2f} | {v['alone']:+.2f} | " + " | ".join(
                f"{r['proxies'][n]['by_type'][g]['kept']:+.2f}" for n in names) + " |")
        top = sorted(r["modules"].items(), key=lambda kv: -kv[1]["share"])[:8]
        lines += ["", f"Top 8 layers (together {sum(v['share'] for _, v in top):.2f} of the variance); the proxy's "
                  "rank for each (`dense`: not factorised):", "",
                  "| layer | share | alone | " + " | ".join(f"kept ({n}) | rank ({n})" for n in names) + " |",
                  "|---|---|---|" + "---|---|" * len(names)]
        for mod, v in top:
            lines.append(f"| {mod} | {v['share']:+.2f} | {v['alone']:+.2f} | " + " | ".join(
                f"{r['proxies'][n]['modules'][mod]['kept']:+.2f} | {m['proxy_ranks'].get(n, {}).get(mod, 'dense')}"
                for n in names) + " |")
        lines += ["", "| block | share | alone | " + " | ".join(f"kept ({n})" for n in names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for g, v in sorted(r["by_block"].items(), key=lambda kv: int(kv[0].split(".")[-1])):
            lines.append(f"| {g} | {v['share']:+.2f} | {v['alone']:+.2f} | " + " | ".join(
                f"{r['proxies'][n]['by_block'][g]['kept']:+.2f}" for n in names) + " |")
        lines.append("")
    if d.get("health"):
        lines += ["## Stage-1 health per suite (validation examples)", "",
                  "| model | suite | target loss | proxy loss | KL(target ‖ proxy) | top-1 agreement |", "|---|---|---|---|---|---|"]
        for name, per in d["health"].items():
            for s, h in per.items():
                lines.append(f"| {name} | {s} | {h['target_loss']:.2f} | {h['proxy_loss']:.2f} | {h['kl']:.2f} | "
                             f"{h['top1_agreement']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fidelity", default=str(ROOT / "bench" / "results" / "fidelity_v2"))
    ap.add_argument("--effect", default=str(ROOT / "bench" / "results" / "effect"),
                    help="the effect run whose pool stores (OUT/stores/<name>) are diagnosed")
    ap.add_argument("--proxy", action="append", default=[], metavar="NAME",
                    help="a proxy selector of the effect run (e.g. iprox@0.5) whose pool store is EFFECT/stores/<NAME>")
    ap.add_argument("--stage1", default=None, help="also the Stage-1 health of this fidelity_v2 variant (compressed here)")
    ap.add_argument("--pool", default=str(ROOT.parent / "shared" / "data" / "pool" / "instructions.jsonl"),
                    help="the pool whose probe split Stage 1 uses (--stage1)")
    ap.add_argument("--no-health", action="store_true")
    ap.add_argument("--summary-only", action="store_true",
                    help="recompute the attribution (seconds) and keep the health rows of the previous run")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--in-process", action="store_true",
                    help="run each stage's train.py command in this process, not as a subprocess (tests)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out, fid, eff = Path(args.out).resolve(), Path(args.fidelity).resolve(), Path(args.effect).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    st = Stages(out, args.threads, lambda msg: print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True),
                in_process=args.in_process)
    stores = {"target": eff / "stores" / "target", **{n: eff / "stores" / dir_name(n) for n in args.proxy}}
    loaded, models = {}, {}
    for name, pool_store in stores.items():
        info = json.loads((pool_store / "store.json").read_text())
        model = models[name] = info["model_source"]  # the model the pool store was built with
        s = info["fingerprint"]["settings"]
        tok = info.get("tokenization", {})
        vdir = out / "valstores" / dir_name(name)
        ov = {"model": model, "output_dir": str(vdir), "pool": str(fid / "validation.jsonl"),
              "tokenizer": tok.get("tokenizer", model), "k": s["k"], "seed": s["seed"],
              "max_length": tok.get("max_length", args.max_length), "batch_size": tok.get("batch_size", args.batch_size),
              "progress": False}
        st.run(f"valstore:{name}", "build_store", [], ov, {"pool_store": info["fingerprint"], "validation": hashlib.sha256(
            (fid / "validation.jsonl").read_bytes()).hexdigest()},
               vdir / "store.json", clean=vdir)
        if (vdir / "projection.safetensors").read_bytes() != (pool_store / "projection.safetensors").read_bytes():
            raise SystemExit(f"{name}: the validation store's projections differ from the pool store's")
        p_ids, _, pX, pinfo = read_store(pool_store)
        v_ids, v_tasks, vX, _ = read_store(vdir)
        loaded[name] = ({"ids": p_ids, "X": pX, "info": pinfo}, {"ids": v_ids, "tasks": v_tasks, "X": vX})
        print(f"{name}: pool {pX.shape}, validation {vX.shape}", flush=True)
    target_pool, target_val = loaded.pop("target")
    result = {"meta": {"commit": git_commit(True), "pool_n": len(target_pool["ids"]), "proxies": list(args.proxy),
                       "models": models,
                       "k": target_pool["info"]["fingerprint"]["settings"]["k"], "stages": st.state["stages"]},
              "attribution": attribution(target_pool, target_val, loaded)}
    result["meta"]["proxy_ranks"] = {n: proxy_ranks(models[n]) for n in args.proxy}
    previous = json.loads((out / "diagnosis.json").read_text()) if (out / "diagnosis.json").exists() else {}
    (out / "diagnosis.json").write_text(json.dumps(result, indent=1))
    if args.summary_only and previous.get("health"):
        result["health"] = previous["health"]  # (measured by an earlier full run of this command)
        (out / "diagnosis.json").write_text(json.dumps(result, indent=1))
    elif not args.no_health:
        result["health"] = health_per_suite(args, fid, models["target"], {n: models[n] for n in args.proxy})
        (out / "diagnosis.json").write_text(json.dumps(result, indent=1))
    (out / "diagnosis.md").write_text(markdown(result))
    print(f"wrote {out / 'diagnosis.json'} and diagnosis.md ({time.perf_counter() - t0:.0f} s)")
    return result


if __name__ == "__main__":
    main()
