"""LESS scoring over a LoRA warm-up's checkpoints, batch by batch against ``checkpoints_in_turn``, on SmolLM2-135M:
the peak memory of each (a child process's ``RssAnon`` over its baseline, ``bench/plan_memory.py``'s ``--child``), its
wall time, the two score tables compared, and ``train.py plan``'s peak for each (``less_scoring_plan`` on a CPU).

It runs the product's own command, ``train.py predict --config configs/score.yaml --config configs/less/score.yaml``
with the effect run's recorded LESS overlay (``bench/results/effect_gpu2048/configs/score_less.yaml``: its LoRA
warm-up's 4 checkpoints, the eval suites' 93 subtask columns, validation gradients held in bfloat16), on the first
``--rows`` rows of its sample, once per mode (``model.checkpoints_in_turn`` false / true), outputs in ``--work``.
Needs that warm-up's adapters (``bench/effect.py --selectors less+max``; not in git) and the model lock:

  flock /tmp/iprox-model.lock python bench/less_in_turn.py --rows 16 --out bench/results/plan/less_in_turn_smollm2.json

Each run is appended to the JSON's ``runs``; ``tests/test_plan_less_in_turn_measured.py`` checks it against today's plan.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RECORDED = ROOT / "bench" / "results" / "effect_gpu2048" / "configs" / "score_less.yaml"
MODES = {"together": False, "in_turn": True}


def overlay(recorded: dict, pool: Path, out: Path, in_turn: bool) -> dict:
    """The recorded LESS scoring overlay on ``pool``, writing into ``out``, with ``checkpoints_in_turn``."""
    cfg = json.loads(json.dumps(recorded))
    cfg["trainer"]["default_root_dir"] = str(out / "lightning")
    cfg["trainer"]["callbacks"][0]["init_args"]["output_dir"] = str(out / "scores")
    cfg["data"]["init_args"]["pool"] = str(pool)
    cfg["model"]["init_args"]["checkpoints_in_turn"] = in_turn
    return cfg


SHAPE = "smollm2-135m"  # the named shape of SmolLM2-135M (train.py plan --model smollm2-135m): no file needed


def plan_settings(recorded: dict, rows: int, tasks: int) -> dict:
    """What the plan of this measurement takes (recorded with it, so a test prices it again with no model file): the
    shape, the rows, columns, checkpoints, T, batch, holding and the warm-up's LoRA settings."""
    ckpts = recorded["model"]["init_args"]["checkpoints"]
    lora = json.loads((Path(ckpts[0]["path"]) / "adapter_config.json").read_text())
    d = recorded["data"]["init_args"]
    return {"model": SHAPE, "pool_size": rows, "tasks": tasks, "checkpoints": len(ckpts),
            "max_length": d["max_length"], "batch_size": d["batch_size"],
            "validation_gradients": recorded["model"]["init_args"].get("validation_gradients"),
            "lora": {"r": lora["r"], "alpha": lora["lora_alpha"], "dropout": lora["lora_dropout"],
                     "target_modules": sorted(lora["target_modules"])}}


def plan_peak(settings: dict, in_turn: bool) -> dict:
    """``train.py plan``'s LESS scoring row on a CPU for ``settings`` (:func:`plan_settings`): ``{"peak", "parts"}``."""
    from iprox_lightning.analysis import ModelSizes, RunSettings, load_config, plan_stages, run_activations

    s = dict(settings)
    config = load_config(s.pop("model"))
    run = RunSettings(**s, checkpoints_in_turn=in_turn, method="less", device_kind="cpu")
    acts, acts32 = run_activations(config, run)
    (stage,) = [x for x in plan_stages(ModelSizes.from_config(config), config, run, acts=acts, acts32=acts32)
                if x.stage == "scoring (less)"]
    return {"peak": stage.peak, "parts": stage.parts}


def check_shape(recorded: dict) -> None:
    """The warm-up's model has the named shape the plan prices."""
    from iprox_lightning.analysis import load_config

    ckpt = Path(recorded["model"]["init_args"]["checkpoints"][0]["path"])
    got, want = load_config(str(ckpt.parents[1])).to_dict(), load_config(SHAPE).to_dict()
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    if [got.get(k) for k in keys] != [want.get(k) for k in keys]:
        sys.exit(f"the warm-up's model is not the {SHAPE} shape: {[got.get(k) for k in keys]}")


def main() -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recorded", default=str(RECORDED), help="the effect run's LESS scoring overlay (not in git)")
    ap.add_argument("--rows", type=int, default=16, help="pool rows scored (the first of the recorded sample)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/less_in_turn")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    recorded = yaml.safe_load(Path(a.recorded).read_text())
    for c in recorded["model"]["init_args"]["checkpoints"]:
        if not (Path(c["path"]) / "optimizer_state.safetensors").is_file():
            sys.exit(f"{c['path']}: the effect run's LESS warm-up checkpoint is not here (bench/effect.py "
                     "--selectors less+max makes it; docs/GUIDE.md 'LoRA')")
    check_shape(recorded)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    pool = work / f"pool_{a.rows}.jsonl"
    with open(recorded["data"]["init_args"]["pool"]) as f:
        pool.write_text("".join(next(f) for _ in range(a.rows)))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads),
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # (as plan_memory.measured_child: RssAnon follows the tensors)
    from iprox_lightning.scoring import ScoreTable

    result = {"command": " ".join(sys.argv), "rows": a.rows, "modes": {}}
    tables = {}
    for mode in a.modes:
        out = work / mode
        cfg = work / f"{mode}.yaml"
        cfg.write_text(yaml.safe_dump(overlay(recorded, pool, out, MODES[mode])))
        argv = ["predict", "--config", str(ROOT / "configs" / "score.yaml"), "--config",
                str(ROOT / "configs" / "less" / "score.yaml"), "--config", str(cfg), "--trainer.logger", "false"]
        t0 = time.time()
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_memory.py"), "--child", *argv], cwd=ROOT,
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{mode} failed (rc {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
        m = json.loads(p.stdout.strip().splitlines()[-1])
        tables[mode] = t = ScoreTable.load(str(out / "scores"))
        result["plan_settings"] = settings = plan_settings(recorded, len(t), len(t.task_names))
        plan = plan_peak(settings, MODES[mode])
        meas = m["peak"] - m["baseline"]
        result["modes"][mode] = {"argv": argv, "measured": m, "measured_bytes": meas, "seconds": time.time() - t0,
                                 "predicted_bytes": plan["peak"], "ratio": plan["peak"] / meas, "plan": plan,
                                 "columns": len(t.task_names), "rows": len(t)}
        print(json.dumps({mode: {k: result["modes"][mode][k] for k in ("measured_bytes", "predicted_bytes",
                                                                       "ratio", "seconds")}}), flush=True)
    if set(tables) == set(MODES):
        x, y = tables["together"], tables["in_turn"]
        result["same_ids"] = x.ids == y.ids and x.task_names == y.task_names
        result["scores_bit_equal"] = bool(result["same_ids"] and (x.scores == y.scores).all()
                                          and (x.task_scores == y.task_scores).all())
    path = Path(a.out)
    record = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    record["runs"].append(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
