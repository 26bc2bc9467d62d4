"""The paper's sizes against the device: ``plan --fit`` for each target of issues 63 and 64 (the README's table).

For each target (model, devices, strategy) at the paper's settings (bf16-mixed, T 512, batch 8, build batch 4, pool
16k, the configs' fractions, 3 task columns, 80 GB per device), :mod:`iprox_lightning.analysis.fit` finds per stage
the largest per-device batch and the fewest levers that fit, priced by ``plan``'s own stage functions; nothing is
measured and no number is typed in: rerun this after the plan changes and ``python bench/tables.py`` renders the
table into the README (``--check`` fails until then: ``tests/test_benchmark_tables.py``; ``tests/test_plan_fit.py``
checks the JSON is what the plan gives today).

    python bench/plan_targets.py                 # writes bench/results/plan/targets.json
    python bench/plan_targets.py --check         # exit 1 when the JSON is not what the plan gives today
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "plan" / "targets.json"
DEVICE_MEMORY = "80GB"
PAPER = dict(precision="bf16-mixed", max_length=512, batch_size=8, align_batch_size=4, pool_size=16000, tasks=3)
"""The paper's settings (the configs' fractions and probe tokens are ``RunSettings``' defaults, the configs')."""

ALL = None  # every stage plan prints
TARGETS = (
    # (model, devices, strategy, stages: ALL or the ones the issue asks of this target)
    ("llama-3.2-1b", 1, "ddp", ALL),
    ("llama-3.2-3b", 1, "ddp", ALL),
    ("llama-3.1-8b", 8, "fsdp", ALL),
    ("qwen2.5-7b", 8, "fsdp", ALL),
    # issue 63: Stage 1 on one device; issue 64: scoring with the proxy (TracIn; the store), the store build and the
    # query (the dense target's scoring, store and query beside them)
    ("llama-3.1-8b", 1, "ddp", ("build_proxy: Stage 1 (IPSVD)", "scoring (tracin)", "store build",
                                "scoring with the proxy (tracin)", "store build (proxy)", "query",
                                "query (proxy store)")),
)
NOT_MODELLED: dict = {}


def compute() -> dict:
    """Every target's fit, as ``plan --fit --output`` writes it (``fit``)."""
    from iprox_lightning.analysis import RunSettings, fit_target

    out = []
    for model, devices, strategy, stages in TARGETS:
        t = fit_target(model, RunSettings(**PAPER, devices=devices, strategy=strategy), DEVICE_MEMORY, stages)
        out.append({**t, "not_modelled": NOT_MODELLED.get((model, devices, strategy), [])})
    return {"meta": {"command": "python bench/plan_targets.py", "device_memory": DEVICE_MEMORY, "settings": PAPER,
                     "search": "iprox_lightning/analysis/fit.py"}, "targets": out}


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------
SHORT_STAGES = {"build_proxy: Stage 1 (IPSVD)": "Stage 1", "build_proxy: Stage 2 (alignment)": "Stage 2",
                "scoring (tracin)": "TracIn", "scoring (kfac)": "K-FAC", "scoring (ekfac)": "EK-FAC",
                "scoring with the proxy (tracin)": "TracIn, proxy", "store build (proxy)": "store build, proxy",
                "query (proxy store)": "query, proxy store"}


def short_levers(settings: dict) -> str:
    """A stage's levers in a few words (the full overlay is in the JSON)."""
    words = []
    for k, v in settings.items():
        if k in ("micro_batch_size", "align_micro_batch_size"):
            words.append(f"micro-batch {v}")
        elif k in ("gradient_checkpointing", "align_checkpointing", "store_gradient_checkpointing") and v:
            words.append("checkpointing")
        elif k == "fsdp_cpu_offload" and v:
            words.append("CPU offload")
        elif k == "probe_group_layers":
            words.append(f"probe groups of {v}")
        elif k == "batch_size":
            words.append(f"batch {v}")
        elif k == "validation_batch_size":
            words.append(f"validation batch {v}")
        elif k == "validation_gradients" and v:
            where = " on the host" if v.get("device") == "cpu" else ""
            groups = f", {v['column_groups']} column groups" if v.get("column_groups", 1) > 1 else ""
            words.append(f"V {v.get('dtype', 'float32')}{where}{groups}")
        elif k == "kfac_partitions":
            words.append(f"{v} partitions")
        elif k == "kfac_offload" and v:
            words.append("factors on the host")
        elif k == "shard_layers" and v:
            words.append("factors split over ranks")
        elif k == "align_reshard_proxy" and v:
            words.append("proxy per block")
    return ", ".join(words)


def _cell(s: dict) -> str:
    gib = s["peak"] / 1024**3
    levers = short_levers(s["settings"])
    if s["fits"]:
        return f"yes, {gib:.1f}" + (f": {levers}" if levers else "")
    parts = ", ".join(f"{k} {v / 1024**3:.1f}" for k, v in s["largest_parts"].items())
    fits_at = ""
    if s.get("nearest_fitting"):
        words = []
        for near in s["nearest_fitting"]:
            (key, value), = near["setting"].items()
            words.append(f"{'T' if key == 'max_length' else key} {value} ({near['peak'] / 1024**3:.1f}"
                         + (f": {short_levers(near['settings'])})" if near["settings"] else ")"))
        fits_at = "; fits at " + " or ".join(words)
    return f"**no**, {gib:.1f} at {levers or 'no lever'} ({parts}){fits_at}"


def markdown(results: dict) -> str:
    """The README's table: a row per target, a column per stage: fits (peak GiB per device: the levers chosen), or
    not (the nearest setting's peak and its largest parts); exact TracIn's route; what the plan does not model."""
    targets = results["targets"]
    stages = list(dict.fromkeys(s["stage"] for t in targets for s in t["stages"]))
    rows = ["| target (80 GB devices) | " + " | ".join(SHORT_STAGES.get(s, s) for s in stages) + " | exact TracIn |",
            "|---" * (len(stages) + 2) + "|"]
    for t in targets:
        head = f"{t['model']} ×{t['devices']}" + (" fsdp" if t["strategy"] == "fsdp" else "")
        if t["not_modelled"]:
            head += " (not modelled: " + "; ".join(t["not_modelled"]) + ")"
        cells = []
        for stage in stages:
            s = next((x for x in t["stages"] if x["stage"] == stage), None)
            cells.append("—" if s is None else _cell(s))
        r = t["tracin"]
        route = "—" if r is None else (f"→ the store ({r['exact_passes']} passes)" if r["to_store"] and r["exact_passes"]
                                       else "→ the store (no pass fits)" if r["to_store"] else "one pass")
        rows.append(f"| {head} | " + " | ".join(cells) + f" | {route} |")
    return "\n".join(rows)


def markers() -> tuple[str, str]:
    return ("<!-- plan-targets:begin (generated by bench/tables.py from bench/results/plan/targets.json) -->",
            "<!-- plan-targets:end -->")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the JSON differs from the plan")
    args = ap.parse_args(argv)
    now = json.loads(json.dumps(compute()))
    if args.check:
        same = RESULTS.exists() and json.loads(RESULTS.read_text()) == now
        print("bench/results/plan/targets.json is what the plan gives" if same else
              "bench/results/plan/targets.json differs from the plan: run python bench/plan_targets.py")
        return 0 if same else 1
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(now, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}; now python bench/tables.py renders it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
