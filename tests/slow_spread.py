"""Write ``tests/data/slow_spread.json`` (the ranges ``tests/test_pipeline_smollm.py`` asserts) from recorded runs.

    IPROX_SLOW_RECORD=/tmp/native.json python -m pytest tests/test_pipeline_smollm.py --runslow
    ATEN_CPU_CAPABILITY=avx2 IPROX_SLOW_RECORD=/tmp/avx2.json python -m pytest tests/test_pipeline_smollm.py --runslow
    python tests/slow_spread.py native=/tmp/native.json aten_avx2=/tmp/avx2.json

Each range is the min..max over the runs; each tolerance is 5x the spread between them, at least ``FLOOR`` (a
relative floor for losses, an absolute one for rank correlations), so that another x86 CPU's summation order passes
and a changed computation does not. Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

JSON = Path(__file__).resolve().parent / "data" / "slow_spread.json"
FLOOR = {"loss": 1e-3, "spearman": 0.02}  # relative (losses), absolute (rank correlations)


def values(rec: dict) -> dict[str, float]:
    out = {"base_loss": rec["base_loss"], "off_the_shelf_spearman": rec["spearman"]["off_the_shelf"]}
    out.update({f"base_loss_{t}": v for t, v in rec["base_per_task_loss"].items()})
    return out


def main(argv: list[str]) -> None:
    import importlib.metadata as im

    runs = {name: json.loads(Path(path).read_text()) for name, path in (a.split("=", 1) for a in argv)}
    per_run = {name: values(rec) for name, rec in runs.items()}
    names = next(iter(per_run.values())).keys()
    ranges, tol = {}, {}
    for k in names:
        xs = [v[k] for v in per_run.values()]
        lo, hi = min(xs), max(xs)
        ranges[k] = [lo, hi]
        floor = FLOOR["spearman"] if k.endswith("spearman") else FLOOR["loss"] * abs(hi)
        tol[k] = max(5 * (hi - lo), floor)
    JSON.write_text(json.dumps({
        "how": __doc__.strip().split("\n")[0] + " — " + " ".join(sys.argv[1:]),
        "versions": {p: im.version(p) for p in ("torch", "transformers", "lightning", "gguf", "numpy")},
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "ranges": ranges, "tolerance": tol, "runs": per_run, "recorded": runs}, indent=1) + "\n")
    print(f"wrote {JSON}")


if __name__ == "__main__":
    main(sys.argv[1:])
