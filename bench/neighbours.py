"""Nearest neighbours at a million stored examples: ``query --neighbours``'s blocked top-k (``scoring.query``'s
``nearest``, the stored rows streamed in shards) against the brute-force ``[queries × pool]`` cosines, on synthetic
random vectors (no model), in one process: seconds and peak resident memory of each.

    python bench/neighbours.py --rows 1000000 --dim 256 --queries 16 --k 10 --out bench/results/neighbours.json
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def shards(rows: int, dim: int, shard_rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for a in range(0, rows, shard_rows):
        n = min(shard_rows, rows - a)
        yield {"ids": [str(j) for j in range(a, a + n)], "vectors": torch.randn(n, dim, generator=g).half(),
               "zero_grad": torch.zeros(n, dtype=torch.bool), "nonfinite": torch.zeros(n, dtype=torch.bool)}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> dict:
    from iprox_lightning.scoring import nearest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--shard-rows", type=int, default=50_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    Q = torch.randn(a.queries, a.dim, generator=torch.Generator().manual_seed(1))
    base = peak_mib()
    t0 = time.perf_counter()
    ids, sims = nearest(shards(a.rows, a.dim, a.shard_rows, 0), Q, a.k)
    blocked = {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_mib(), "rss_before_mib": base}
    # brute force: every cosine held ([queries, rows] float64) and one topk (the vectors are generated shard by
    # shard here too, so the difference is the cosine matrix)
    t0 = time.perf_counter()
    Qn = torch.nn.functional.normalize(Q.double(), dim=1)
    cos = torch.cat([Qn @ torch.nn.functional.normalize(s["vectors"].double(), dim=1).t()
                     for s in shards(a.rows, a.dim, a.shard_rows, 0)], 1)
    v, i = torch.topk(cos, a.k, dim=1)
    full = {"seconds": time.perf_counter() - t0, "peak_rss_mib": peak_mib(), "cosines_mib": cos.numel() * 8 / 2**20}
    same = [[str(j) for j in row] for row in i.tolist()] == ids
    out = {"meta": {k: getattr(a, k) for k in ("rows", "dim", "queries", "k", "shard_rows", "threads")},
           "blocked": blocked, "full": full, "same_neighbours": same, "torch": torch.__version__}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
