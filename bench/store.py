"""Gradient store benchmark (issue 25.5): build once, query many, against exact scoring — every number from the
product's own commands (``python train.py predict`` with ``configs/score.yaml``, ``build_store``, ``query``).

Per model (``--model``, and ``--proxy`` when given) and method (``--methods``: tracin, kfac, ekfac):

1. **exact**: ``train.py predict --config configs/score.yaml`` + an overlay (``OUT/configs/``) -> ``OUT/exact/<who>-<method>``;
2. **build**: ``train.py build_store`` at each ``--k`` and ``--projections`` (``gaussian``; ``pca`` with TracIn:
   ``OUT/stores/<who>-<method>-pca-k<k>``) -> ``OUT/stores/<who>-<method>-k<k>``, with the exact run's
   ``--factors_dir OUT/factors``: K-FAC / EK-FAC factors and PCA moments fitted once per model and factor data, the
   time they take counted in whichever stage fits them first;
3. **query**: ``train.py query`` of the validation set (twice: the first computes the validation gradients, the
   second re-reads them from the store's cache: a re-query) -> ``OUT/queries/<who>-<method>-k<k>``;
4. **a new task** (``--new-task SUITE``, with the first of ``--methods``): that suite's validation examples alone as a
   validation set the store has never seen, scored both ways — a fresh exact scoring (pool pass + its validation
   pass) and a cold query of the store -> ``OUT/exact/<who>-<method>-<suite>``, ``OUT/queries/<who>-<method>-k<k>-<suite>``.

Rows of ``OUT/results.json`` (written after every stage, results first; ``summary.md`` is generated from it; rows of
earlier invocations with other settings are kept, a row measured again is replaced):
``build_s`` / ``exact_s`` (wall seconds of the commands), ``build_vs_exact``, ``query_s`` (cold) and ``requery_s``
(cached), ``query_share`` / ``requery_share`` (their seconds / exact seconds), ``new_task`` (the new suite's
``query_share``: cold query / fresh exact scoring of that suite; goal <= 0.05; and its Spearman per column),
``bytes_per_example`` (shard bytes / rows), ``spearman`` per task column and pooled
(projected query vs exact scores of the same model and method; goal >= 0.95; rows with ``norms: exact`` were
measured at commit 85d0abc, whose stores kept each example's exact gradient norm and whose query divided by it, with
``spearman_projected_norms`` the same store dividing by its vectors' norms as before and since: no gain, reverted),
and, with ``--proxy``,
``proxy_vs_target`` per method (Spearman per task between the proxy's and the target's query tables: EK-FAC vs K-FAC
vs TracIn fidelity; ``exact`` holds each exact scoring's seconds). ``--exact-only`` runs the exact scorings
alone (no store). Every stage is skipped when its output exists and its settings match ``OUT/state.json``;
re-run the same command to resume.

    python bench/store.py --model OUT_FID/warmed --proxy OUT_FID/proxies/ipsvd@0.25+align \\
        --pool OUT_FID/sample.jsonl --validation OUT_FID/validation.jsonl --new-task tydiqa --out bench/results/store \\
        --threads 2
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from ledger import Stages  # bench/: the stage ledger

from iprox_lightning.analysis import spearman_columns

ROOT = Path(__file__).resolve().parents[1]


def _columns(path: Path) -> dict:
    from iprox_lightning.io import read_table

    t = read_table(path)[1].to_pydict()
    order = sorted(range(len(t["id"])), key=lambda j: t["id"][j])
    return {c: [t[c][j] for j in order] for c in t if c == "id" or c == "score" or c.startswith("score/")}


def _compare(a: Path, b: Path) -> dict:
    ca, cb = _columns(a), _columns(b)
    if ca["id"] != cb["id"]:
        raise ValueError(f"{a} and {b} hold other ids")
    return {c: spearman_columns(np.asarray(ca[c], float), np.asarray(cb[c], float)) for c in ca if c != "id" and c in cb}


def _bytes_per_example(store: Path) -> float:
    info = json.loads((store / "store.json").read_text())
    size = sum(f.stat().st_size for f in (store / "shards").glob("rank*.safetensors"))
    return size / max(info.get("rows", 1), 1)


def _settings(st: dict) -> dict:
    """A stage's settings without the K-FAC options when nothing in it reads them (TracIn, unless a PCA store fits
    its moments on ``kfac_examples``)."""
    unread = st.get("method") == "tracin" and st.get("projection", "gaussian") != "pca"
    return {k: v for k, v in st.items() if not unread or k not in ("kfac_examples", "damping")}


def _score_overlay(out: Path, name: str, model: str, method: str, a) -> dict:
    """The overlay of ``name``'s exact scoring (``train.py predict`` on top of ``configs/score.yaml``)."""
    return {"trainer": {"logger": False, "enable_progress_bar": not a.in_process,
                        "default_root_dir": str(out / "lightning"), "callbacks": [
        {"class_path": "iprox_lightning.scoring.InfluenceWriter",
         "init_args": {"output_dir": str(out / "exact" / name), "write_every_n_batches": 50}}]},
        "model": {"init_args": {"model": model, "method": method, "kfac_examples": a.kfac_examples,
                                "damping": a.damping, "factors_dir": str(out / "factors")}},
        "data": {"init_args": {"pool": a.pool, "validation": a.validation, "tokenizer": model,
                               "max_length": a.max_length, "batch_size": a.batch_size}}}


def _new_task_validation(out: Path, validation: str, suite: str) -> Path:
    """``OUT/validation-<suite>.jsonl``: the validation records of ``suite`` (category ``suite`` or ``suite.*``)."""
    lines = [line for line in Path(validation).read_text(encoding="utf-8").splitlines() if line.strip()
             and json.loads(line).get("category", "").split(".")[0] == suite]
    if not lines:
        raise SystemExit(f"--new-task {suite}: no validation record of {validation} has category {suite} or {suite}.*")
    p = out / f"validation-{suite}.jsonl"
    if not p.exists() or p.read_text(encoding="utf-8") != "\n".join(lines) + "\n":
        p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _new_task(out: Path, st: Stages, a, name: str, model: str, method: str, settings: dict, key: str,
              bst: dict) -> dict:
    """A validation set the store has never seen (``--new-task``): a fresh exact scoring of it against a cold query."""
    val = _new_task_validation(out, a.validation, a.new_task)
    sub = f"{name}-{a.new_task}"
    exact_dir = out / "exact" / sub
    exact = _exact(out, st, argparse.Namespace(**{**vars(a), "validation": str(val)}), sub, model, method,
                   {**settings, "validation": str(val), "new_task": a.new_task})
    query_s = _query(out, st, key, {**bst, "validation": str(val), "new_task": a.new_task}, str(val),
                     f"{key}-{a.new_task}")
    qdir = out / "queries" / f"{key}-{a.new_task}"
    return {"task": a.new_task, "n_validation": sum(1 for _ in open(val, encoding="utf-8")),
            "exact_s": exact["exact_s"], "query_s": query_s, "query_share": query_s / exact["exact_s"],
            "spearman": _compare(qdir / "scores.parquet", exact_dir / "scores.parquet")}


def _stores(a, method: str) -> list[tuple[int, str, str]]:
    """``(k, projection, tag)`` of each store measured for ``method`` (``pca``: TracIn only); ``tag`` names its
    directories: ``k<k>`` (gaussian, the names of stores built before the option) or ``<projection>-k<k>``."""
    return [(k, p, f"k{k}" if p == "gaussian" else f"{p}-k{k}")
            for k in a.k for p in a.projections if p == "gaussian" or method == "tracin"]


def _exact(out: Path, st: Stages, a, name: str, model: str, method: str, settings: dict) -> dict:
    """The exact scoring of ``model`` by ``method`` (``train.py predict``): recorded, or run now."""
    d = out / "exact" / name
    rec = st.run(f"exact/{name}", "predict", [ROOT / "configs" / "score.yaml"], _score_overlay(out, name, model, method, a),
                 settings, d / "scores.parquet", clean=d)
    return {"exact_s": rec["wall_s"]}


def _build(out: Path, st: Stages, a, key: str, model: str, method: str, k: int, projection: str, bst: dict) -> dict:
    """The store ``key`` (``train.py build_store``): recorded, or built now (a store of other settings is set aside
    first; a killed build of these settings resumes)."""
    store = out / "stores" / key
    ov = {"model": model, "output_dir": str(store), "pool": a.pool, "k": k, "method": method,
          "kfac_examples": a.kfac_examples, "damping": a.damping, "store_dtype": a.store_dtype,
          "max_length": a.max_length, "batch_size": a.batch_size, "projection": projection,
          "factors_dir": str(out / "factors"),  # the exact run's, shared
          "progress": not a.in_process}
    return {"build_s": st.run(f"build/{key}", "build_store", [], ov, bst, store / "store.json", clean=store)["wall_s"]}


def _query(out: Path, st: Stages, key: str, qst: dict, validation: str, name: str | None = None,
           again: bool = False) -> float:
    """``train.py query`` of the store ``key`` with ``validation`` into ``OUT/queries/<name>`` (default ``key``):
    recorded, or run now; its wall seconds. The query's settings include its store's, so a store built with
    other settings is queried again. ``again``: the same query once more (stage ``requery/<name>``, into
    ``OUT/requeries/<name>``), re-reading the validation gradients the first one cached in the store."""
    kind, folder = ("requery", "requeries") if again else ("query", "queries")
    qdir = out / folder / (name or key)
    ov = {"store": str(out / "stores" / key), "validation": validation, "output_dir": str(qdir)}
    fp = {**qst, "requery": True} if again else qst
    return st.run(f"{kind}/{name or key}", "query", [], ov, fp, qdir / "scores.parquet", clean=qdir)["wall_s"]


def _store_row(out: Path, st: Stages, a, who: str, model: str, method: str, settings: dict, exact: dict, k: int,
               projection: str, tag: str) -> dict:
    """One row of ``results.json``: the store ``<who>-<method>-<tag>`` built, queried and compared with the exact
    scoring of the same model and method (and, with ``--new-task``, the new suite)."""
    name = f"{who}-{method}"
    key = f"{name}-{tag}"
    bst = {**settings, "k": k, "store_dtype": a.store_dtype, "batch_size": a.batch_size,
           **({"projection": projection, "kfac_examples": a.kfac_examples} if projection != "gaussian" else {})}
    built = _build(out, st, a, key, model, method, k, projection, bst)
    queried = {"query_s": _query(out, st, key, bst, a.validation)}
    queried["requery_s"] = _query(out, st, key, bst, a.validation, again=True)
    rho = _compare(out / "queries" / key / "scores.parquet", out / "exact" / name / "scores.parquet")
    new_task = (_new_task(out, st, a, name, model, method, settings, key, bst)
                if a.new_task and method == a.methods[0] else None)
    return {"who": who, "method": method, "k": k, "projection": projection, **exact, **built, **queried,
            "build_vs_exact": built["build_s"] / exact["exact_s"],
            "query_share": queried["query_s"] / exact["exact_s"],
            "requery_share": queried["requery_s"] / exact["exact_s"], "new_task": new_task,
            "bytes_per_example": _bytes_per_example(out / "stores" / key), "spearman": rho,
            "spearman_min_task": min((v for c, v in rho.items() if c != "score"), default=float("nan"))}


def _row_key(r: dict) -> tuple:
    return r["who"], r["method"], r["k"], r.get("projection", "gaussian")


def run(a) -> dict:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    st = Stages(out, a.threads, lambda msg: print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True),
                in_process=a.in_process)
    # rows of earlier invocations with other settings (k, projection, method, model) are kept: each row says its own
    # settings, and a row this invocation measures again replaces its old one
    before = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    results: dict = {"meta": {"model": a.model, "proxy": a.proxy, "pool": a.pool, "validation": a.validation,
                              "k": a.k, "methods": a.methods, "projections": a.projections,
                              "store_dtype": a.store_dtype, "max_length": a.max_length,
                              "threads": a.threads, "new_task": a.new_task}, "rows": before.get("rows", []),
               "exact": before.get("exact", {}), "proxy_vs_target": before.get("proxy_vs_target", {}),
               "proxy_vs_target_proxy": a.proxy or before.get("proxy_vs_target_proxy")}

    def save():
        tmp = out / ".results.json.tmp"
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(out / "results.json")

    models = {"target": a.model, **({"proxy": a.proxy} if a.proxy else {})}
    for who, model in models.items():
        for method in a.methods:
            name = f"{who}-{method}"
            settings = _settings({"model": model, "method": method, "pool": a.pool, "validation": a.validation,
                                  "max_length": a.max_length, "kfac_examples": a.kfac_examples, "damping": a.damping})
            exact = _exact(out, st, a, name, model, method, settings)
            results["exact"][name] = {"model": model, **exact}
            save()
            for k, projection, tag in [] if a.exact_only else _stores(a, method):
                row = _store_row(out, st, a, who, model, method, settings, exact, k, projection, tag)
                results["rows"] = sorted([r for r in results["rows"] if _row_key(r) != _row_key(row)] + [row],
                                         key=_row_key)
                save()
    if a.proxy:
        for method in a.methods:
            for _, _, tag in [] if a.exact_only else _stores(a, method):
                results["proxy_vs_target"][f"{method}-{tag}"] = _compare(
                    out / "queries" / f"proxy-{method}-{tag}" / "scores.parquet",
                    out / "queries" / f"target-{method}-{tag}" / "scores.parquet")
            results["proxy_vs_target"][f"{method}-exact"] = _compare(
                out / "exact" / f"proxy-{method}" / "scores.parquet", out / "exact" / f"target-{method}" / "scores.parquet")
    save()
    (out / "summary.md").write_text(summary_markdown(results, a.new_task))
    return results


def summary_markdown(results: dict, new_task: str | None) -> str:
    """``summary.md``: one line per store row, then the proxy-vs-target Spearman per method and score column."""
    lines = ["| model | method | k | projection | exact s | build s | build/exact | query s (share) | re-query s (share) | "
             f"new task {new_task or '—'}: exact s, query s (share) | bytes/example | Spearman pooled | min task | "
             "norms | pooled, min task with projected norms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        nt = r.get("new_task")
        lines.append(f"| {r['who']} | {r['method']} | {r['k']} | {r.get('projection', 'gaussian')} | {r['exact_s']:.1f} | {r['build_s']:.1f} | "
                     f"{r['build_vs_exact']:.2f} | {r['query_s']:.1f} ({r['query_share']:.3f}) | "
                     f"{r['requery_s']:.1f} ({r['requery_share']:.3f}) | "
                     + (f"{nt['exact_s']:.1f}, {nt['query_s']:.1f} ({nt['query_share']:.3f})" if nt else "—")
                     + f" | {r['bytes_per_example']:.0f} | {r['spearman'].get('score', float('nan')):.3f} | "
                     f"{r['spearman_min_task']:.3f} | {r.get('norms', 'projected')} | "
                     + (f"{r['spearman_projected_norms'].get('score', float('nan')):.3f}, "
                        f"{r['spearman_min_task_projected_norms']:.3f} |" if "spearman_projected_norms" in r else "— |"))
    cols = sorted({c for v in results["proxy_vs_target"].values() for c in v}, key=lambda c: (c != "score", c))
    if cols:
        lines += ["", f"Proxy vs target, Spearman per score column (proxy `{results['proxy_vs_target_proxy']}`; exact "
                      "scorings, or k = projected "
                      "stores):", "", "| method | scores | " + " | ".join(c.replace("score/", "") or c for c in cols)
                  + " |", "|---|---|" + "---|" * len(cols)]
        for key, v in sorted(results["proxy_vs_target"].items()):
            method, src = key.split("-", 1)
            lines.append(f"| {method} | {src} | " + " | ".join(f"{v.get(c, float('nan')):.3f}" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the target (dir, hub id, builtin)")
    ap.add_argument("--proxy", default=None, help="a proxy dir: its store and scores are compared with the target's")
    ap.add_argument("--pool", required=True)
    ap.add_argument("--validation", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, nargs="+", default=[16], help="projection sizes per side")
    ap.add_argument("--methods", nargs="+", default=["tracin", "kfac", "ekfac"])
    ap.add_argument("--projections", nargs="+", default=["gaussian"], choices=["gaussian", "pca"],
                    help="store projections to measure at each k (pca: TracIn only)")
    ap.add_argument("--store-dtype", default="float16")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kfac-examples", type=int, default=256)
    ap.add_argument("--damping", type=float, default=1e-3)
    ap.add_argument("--new-task", default=None, metavar="SUITE",
                    help="also score the validation records of SUITE alone (a set the store has not seen): fresh "
                         "exact scoring vs a cold query, with the first of --methods")
    ap.add_argument("--exact-only", action="store_true",
                    help="only the exact scorings (and, with --proxy, their proxy-vs-target Spearman): no store")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--in-process", action="store_true", help="run the commands in this process (tests)")
    a = ap.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    return run(a)


if __name__ == "__main__":
    main()
