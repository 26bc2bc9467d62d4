"""Is FAISS worth an optional path for ``query --neighbours`` at a million stored rows? (issue 56, item 4)

Our blocked top-k (``iprox_lightning.scoring.nearest``, the stored rows streamed shard by shard) against FAISS's exact
inner-product index (``IndexFlatIP``; the store is not a FAISS index, so building it from the shards is part of its
time), on the same in-memory synthetic float16 rows (cosine: both sides normalise), same queries, same k; both sides'
thread counts recorded. Writes JSON (``--out``). Needs ``faiss-cpu`` (not a dependency: run it in a scratch venv):

    python bench/neighbours_faiss.py --rows 1000000 --dim 256 --queries 16 --k 10 --repeats 4 --out bench/results/neighbours_faiss.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    import faiss
    import torch

    from iprox_lightning.scoring import nearest
    from neighbours import shards as synthetic_shards  # bench/ (this script's folder)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--shard-rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    # bench/neighbours.py's synthetic shards, held in memory here so that both sides search the same rows
    shards = list(synthetic_shards(a.rows, a.dim, a.shard_rows, 0))
    Q = torch.randn(a.queries, a.dim, generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(a.repeats):  # interleaved
        t = time.perf_counter()
        ids, _ = nearest(shards, Q, a.k)
        ours = time.perf_counter() - t
        t = time.perf_counter()
        index = faiss.IndexFlatIP(a.dim)
        for s in shards:
            v = s["vectors"].float().numpy()
            faiss.normalize_L2(v)
            index.add(v)
        q = Q.numpy().copy()
        faiss.normalize_L2(q)
        _, found = index.search(q, a.k)
        theirs = time.perf_counter() - t
        overlap = sum(len(set(x) & {str(j) for j in y}) for x, y in zip(ids, found.tolist())) / (a.queries * a.k)
        runs.append({"ours_s": round(ours, 3), "faiss_s": round(theirs, 3), "neighbour_overlap": overlap})
    res = {"command": "python bench/neighbours_faiss.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": a.rows, "dim": a.dim, "queries": a.queries, "k": a.k, "faiss": faiss.__version__,
           "torch": torch.__version__, "threads": {"torch": torch.get_num_threads(), "faiss": faiss.omp_get_max_threads()},
           "runs": runs, "ratio_ours_over_faiss": round(min(r["ours_s"] for r in runs) / min(r["faiss_s"] for r in runs), 3)}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
