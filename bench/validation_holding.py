"""Which holding of the exact scorer's validation gradients keeps the scores (``ScoringConfig.validation_gradients``).

Every run is ``python train.py predict`` with the shipped ``configs/score.yaml`` and an overlay that changes only
``validation_gradients`` (and the output directory); each run's score table is compared with the default holding's
(float32 on the model's device, one pass) on the same model and data, per score column (``score`` and every task /
subtask column): Spearman, the top 5% overlap and the largest absolute difference.

* ``demo``: the built-in demo's target and proxy, with the configs a finished ``python train.py pipeline --workdir W``
  wrote (``W/configs/score_<who>.yaml``; the reference is the pipeline's own score table)::

    python bench/validation_holding.py demo --workdir W --out bench/results/plan/validation_holding_builtin.json

* ``smollm2``: SmolLM2-135M-Instruct (the shared GGUF) scoring the first ``--pool-rows`` rows of the shared pool
  against the ``eval:`` suites with one column per subtask (``validation_subtasks``), T 256; under the machine's
  model lock::

    flock /tmp/iprox-model.lock python bench/validation_holding.py smollm2 --pool-rows 64 \\
        --out bench/results/plan/validation_holding_smollm2.json

* ``rss``: the memory each holding saves on this CPU against the plan's count of it: per holding a child process
  scores (``influence_scores``) random tokens with a random-init model of the SmolLM2-135M shape cut to ``--layers``
  decoder layers against ``--columns`` validation tasks, sampling its anonymous resident memory (``RssAnon``, every
  10 ms, ``bench/plan_memory.py``'s sampler) from after the model is built; the peak over that baseline is compared,
  as a difference to the default holding's, with the plan's difference in ``validation_gradients`` +
  ``validation_layer`` (on a CPU the host is the device: both count)::

    python bench/validation_holding.py rss --layers 4 --columns 8 --out bench/results/plan/validation_holding_rss.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GGUF = "/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"
POOL = "/work/shared/data/pool/instructions.jsonl"
EVAL = "/work/shared/data/eval"

HOLDINGS = {
    "host": {"device": "cpu"},
    "column_groups_2": {"column_groups": 2},
    "column_groups_all": {"column_groups": 1000},  # one pass per column (at most one group per column)
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16_host_groups_2": {"dtype": "bfloat16", "device": "cpu", "column_groups": 2},
}


def predict(configs: list[str], overlay: dict, work: Path, name: str) -> tuple[Path, float]:
    """``train.py predict`` with ``configs`` and ``overlay`` (written to ``work/name.json``; JSON is YAML)."""
    ov = work / f"{name}.yaml"
    ov.write_text(json.dumps(overlay))
    cmd = [sys.executable, "train.py", "predict", *sum((["--config", c] for c in configs), []), "--config", str(ov)]
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if rc:
        raise SystemExit(f"{name} failed (rc {rc}): see {work / f'{name}.log'}")
    return Path(overlay["trainer"]["callbacks"][0]["init_args"]["output_dir"]) / "scores.parquet", \
        time.perf_counter() - t0


def compare(path: Path, ref: Path) -> dict:
    """Per score column: Spearman, top 5% overlap and the largest |difference| against the reference table."""
    import pyarrow.parquet as pq

    from iprox_lightning.analysis import spearman, topk_overlap

    a = pq.read_table(path).to_pandas().set_index("id")
    b = pq.read_table(ref).to_pandas().set_index("id").loc[a.index]
    out = {}
    for c in [c for c in a.columns if c == "score" or c.startswith("score/")]:
        x, y = a[c].to_numpy(np.float64), b[c].to_numpy(np.float64)
        out[c] = {"spearman": spearman(x, y), "top5%": topk_overlap(x, y, 0.05),
                  "max_abs_diff": float(np.abs(x - y).max())}
    return out


def summary(cols: dict) -> dict:
    return {"min_spearman": min(v["spearman"] for v in cols.values()),
            "min_top5%": min(v["top5%"] for v in cols.values()),
            "max_abs_diff": max(v["max_abs_diff"] for v in cols.values()), "columns": len(cols)}


def writer(out_dir: Path) -> dict:
    return {"callbacks": [{"class_path": "iprox_lightning.scoring.InfluenceWriter",
                           "init_args": {"output_dir": str(out_dir)}}], "logger": False}


def run_demo(a) -> dict:
    W = Path(a.workdir)
    work = Path(tempfile.mkdtemp(prefix="valgrad-"))
    result = {}
    for who in ("target", "proxy"):
        configs = ["configs/score.yaml", "configs/builtin/score.yaml", str(W / "configs" / f"score_{who}.yaml")]
        ref = W / "scores" / who / "scores.parquet"
        result[who] = {}
        for name in a.holdings:
            holding = HOLDINGS[name]
            ov = {"trainer": writer(work / who / name), "model": {"init_args": {"validation_gradients": holding}}}
            path, secs = predict(configs, ov, work, f"{who}.{name}")
            cols = compare(path, ref)
            result[who][name] = {"holding": holding, "seconds": round(secs, 1), **summary(cols), "per_column": cols}
            print(who, name, summary(cols), flush=True)
    return result


def run_smollm2(a) -> dict:
    work = Path(tempfile.mkdtemp(prefix="valgrad-smollm2-"))
    pool = work / "pool.jsonl"
    with open(POOL) as f:
        pool.write_text("".join(next(f) for _ in range(a.pool_rows)))
    base = {"trainer": {"accelerator": "cpu", "devices": 1},
            "model": {"init_args": {"model": GGUF, "method": "tracin"}},
            "data": {"init_args": {"pool": str(pool), "validation": f"eval:{EVAL}", "tokenizer": GGUF,
                                   "validation_subtasks": a.column_kind == "subtasks", "val_per_task": a.val_per_task,
                                   "max_length": a.max_length, "batch_size": 4, "seed": 0}}}
    bpath = work / "base.yaml"
    bpath.write_text(json.dumps(base))
    configs = ["configs/score.yaml", str(bpath)]
    ref, secs = predict(configs, {"trainer": writer(work / "default")}, work, "default")
    result = {"default": {"seconds": round(secs, 1)}}
    print("default", secs, flush=True)
    for name in a.holdings:
        holding = HOLDINGS[name]
        ov = {"trainer": writer(work / name), "model": {"init_args": {"validation_gradients": holding}}}
        path, secs = predict(configs, ov, work, name)
        cols = compare(path, ref)
        result[name] = {"holding": holding, "seconds": round(secs, 1), **summary(cols), "per_column": cols}
        print(name, summary(cols), flush=True)
    return result


RSS_HOLDINGS = {"default": None, "bfloat16": {"dtype": "bfloat16"}, "column_groups_4": {"column_groups": 4},
                "column_groups_8": {"column_groups": 8},
                "bfloat16_groups_4": {"dtype": "bfloat16", "column_groups": 4}}


def rss_child(a) -> None:
    """One holding's scoring in this process; prints ``{"peak_over_baseline"}`` as the last line."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from plan_memory import PeakSampler

    from iprox_lightning.analysis import load_config
    from iprox_lightning.scoring import influence_scores

    torch.set_num_threads(1)
    cfg = load_config("smollm2-135m")
    cfg.num_hidden_layers = a.layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)

    def batches(n, seed_task):
        out = []
        for j in range(0, n, 4):
            ids = torch.randint(3, cfg.vocab_size, (4, a.max_length), generator=g)
            labels = ids.clone()
            labels[:, : a.max_length // 2] = -100
            out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                        "id": [f"{seed_task}{j + r}" for r in range(4)],
                        "task": [f"t{(j + r) % a.columns}" for r in range(4)]})
        return out

    val, pool = batches(2 * a.columns, "v"), batches(8, "p")
    holding = json.loads(a.holding)
    sampler = PeakSampler(0.01)
    influence_scores(model, pool, val, progress=False, validation_gradients=holding)
    peak = sampler.stop()
    print(json.dumps({"peak_over_baseline": peak - sampler.base}))


def run_rss(a) -> dict:
    from iprox_lightning.analysis import ModelSizes, load_config, validation_gradient_bytes

    tracked = None
    result = {}
    for name, holding in RSS_HOLDINGS.items():
        cmd = [sys.executable, __file__, "rss-child", "--layers", str(a.layers), "--columns", str(a.columns),
               "--max-length", str(a.max_length), "--holding", json.dumps(holding), "--out", "-"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if a.mmap_threshold:  # glibc serves blocks above this from mmap: a freed one leaves the resident set at once
            env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"{name} failed: {r.stderr[-2000:]}")
        measured = json.loads(r.stdout.strip().splitlines()[-1])["peak_over_baseline"]
        if tracked is None:
            cfg = load_config("smollm2-135m")
            cfg.num_hidden_layers = a.layers
            shape = ModelSizes.from_config(cfg).shape
            tracked = [(l.in_features, l.out_features) for l in shape.linears if l.tracked]
        vg = validation_gradient_bytes(tracked, a.columns, holding)
        # on a CPU the host is the device: the larger of the preparation's (float32 sums, on the host or the device,
        # and one layer's stacked copy) and the scoring's (held, and one layer widened) peaks
        prep = (vg["host"] or vg["held"]) + vg["layer"]
        result[name] = {"holding": holding, "measured_peak_over_baseline": measured,
                        "plan_validation_gradients": max(prep, vg["held"] + vg["layer"])}
        print(name, result[name], flush=True)
    base = result["default"]
    for name, r in result.items():
        if name != "default":
            saved_measured = base["measured_peak_over_baseline"] - r["measured_peak_over_baseline"]
            saved_plan = base["plan_validation_gradients"] - r["plan_validation_gradients"]
            r["saved_measured"], r["saved_plan"] = saved_measured, saved_plan
            r["saved_ratio"] = saved_measured / saved_plan if saved_plan else None
    return {"layers": a.layers, "columns": a.columns, "max_length": a.max_length, "mmap_threshold": a.mmap_threshold,
            "holdings": result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("which", choices=("demo", "smollm2", "rss", "rss-child"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--columns", type=int, default=8, help="rss: validation tasks")
    p.add_argument("--max-length", type=int, default=None, help="tokens per example (rss: 64, smollm2: 256)")
    p.add_argument("--columns-of", dest="column_kind", default="subtasks", choices=("subtasks", "tasks"),
                   help="smollm2: a score column per eval subtask (93; dense float32 validation gradients of 39 GB at "
                        "SmolLM2-135M) or per task (3)")
    p.add_argument("--holding", default="null")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="rss: glibc's MALLOC_MMAP_THRESHOLD_ for the children (0: glibc's default)")
    p.add_argument("--workdir", help="demo: a finished `train.py pipeline` workdir")
    p.add_argument("--pool-rows", type=int, default=64)
    p.add_argument("--val-per-task", type=int, default=3)
    p.add_argument("--holdings", nargs="+", choices=list(HOLDINGS),
                   default=["host", "column_groups_2", "bfloat16", "bfloat16_host_groups_2"])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.which == "demo" and not a.workdir:
        p.error("demo needs --workdir")
    if a.max_length is None:
        a.max_length = 256 if a.which == "smollm2" else 64
    if a.which == "rss-child":
        return rss_child(a)
    t0 = time.perf_counter()
    result = run_demo(a) if a.which == "demo" else run_smollm2(a) if a.which == "smollm2" else run_rss(a)
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    doc = {"command": "python " + " ".join(sys.argv), "commit": r.stdout.strip(), "seconds": round(time.perf_counter() - t0),
           "criterion": "Spearman >= 0.999 and the same top 5% against the default holding, every score column"
           if a.which != "rss" else "the memory each holding saves against the plan's count, within 20%",
           "results": result}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
