"""K-FAC / EK-FAC factor sums in float32 (``kfac_dtype``'s default, kronfluence's) against float64 (what K-FAC summed
in before the option) on SmolLM2-135M-Instruct (issue 64 item 1): per method, ``python train.py predict`` with the
shipped ``configs/score.yaml`` and an overlay that changes only ``kfac_dtype`` (and the output directory), scoring the
first ``--pool-rows`` rows of the shared pool against the ``eval:`` suites (a column per task, ``--val-per-task``
examples each; the K-FAC factors fitted on the same pool rows), each float32 table compared with the float64 one per
score column (``score`` and every task column): Spearman, the top 5% overlap and the largest absolute difference
(``bench/validation_holding.py``'s comparison). Under the machine's model lock::

    flock /tmp/iprox-model.lock python bench/kfac_dtype.py --pool-rows 256 --max-length 128 \\
        --out bench/results/plan/kfac_dtype_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from validation_holding import EVAL, GGUF, POOL, compare, predict, summary, writer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["kfac", "ekfac"], choices=("kfac", "ekfac"))
    p.add_argument("--pool-rows", type=int, default=256)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--val-per-task", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kfac-dtype-"))
    pool = work / "pool.jsonl"
    with open(POOL) as f:
        pool.write_text("".join(next(f) for _ in range(a.pool_rows)))
    result = {}
    for method in a.methods:
        base = {"trainer": {"accelerator": "cpu", "devices": 1},
                "model": {"init_args": {"model": GGUF, "method": method}},
                "data": {"init_args": {"pool": str(pool), "validation": f"eval:{EVAL}", "tokenizer": GGUF,
                                       "val_per_task": a.val_per_task, "max_length": a.max_length, "batch_size": 4,
                                       "seed": 0}}}
        bpath = work / f"base_{method}.yaml"
        bpath.write_text(json.dumps(base))
        configs = ["configs/score.yaml", str(bpath)]
        tables, seconds = {}, {}
        for dtype in ("float64", "float32"):
            ov = {"trainer": writer(work / f"{method}_{dtype}"), "model": {"init_args": {"kfac_dtype": dtype}}}
            tables[dtype], seconds[dtype] = predict(configs, ov, work, f"{method}_{dtype}")
            print(method, dtype, f"{seconds[dtype]:.0f} s", flush=True)
        cols = compare(tables["float32"], tables["float64"])
        result[method] = {"reference": "kfac_dtype float64", "compared": "kfac_dtype float32",
                          "seconds": {k: round(v, 1) for k, v in seconds.items()}, **summary(cols), "per_column": cols}
        print(method, summary(cols), flush=True)
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    doc = {"command": "python " + " ".join(sys.argv), "commit": r.stdout.strip(),
           "seconds": round(time.perf_counter() - t0), "model": GGUF,
           "criterion": "Spearman >= 0.999 and the same top 5% (overlap 1.0) against float64, every score column",
           "results": result}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
