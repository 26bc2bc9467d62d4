"""The memory levers of warm-up against ``train.py plan`` on the CPU (issue 64): one warm-up ``fit`` per setting
(``WarmupModule`` of the product, a random-init model, random token batches) in its own process, its peak anonymous
resident memory (``RssAnon`` sampled every 5 ms, from before the model is built to the end of ``fit``) over the same
process's after its imports, against the plan's warm-up peak (``training_plan``) for the same settings.

  python bench/plan_levers.py --shape small --out bench/results/plan/levers_small.json
  flock /tmp/iprox-model.lock python bench/plan_levers.py --shape llama-3.2-1b --precision bf16-true \\
      --max-length 64 --batch-size 4 --out bench/results/plan/levers_llama-3.2-1b.json   # above 2 GB: the lock

Settings measured (``--settings``): ``none`` (the whole batch), ``micro1`` (``micro_batch_size=1``), ``ckpt``
(``gradient_checkpointing``), ``micro1_ckpt`` (both).
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

SETTINGS = {"none": {}, "micro1": {"micro_batch_size": 1}, "ckpt": {"gradient_checkpointing": True},
            "micro1_ckpt": {"micro_batch_size": 1, "gradient_checkpointing": True}}
PROMPT_SHARE = 0.25  # the first quarter of each sequence is prompt (not scored)


def batches(config, B: int, T: int, steps: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(steps):
        ids = torch.randint(3, config.vocab_size, (B, T), generator=g)
        labels = ids.clone()
        labels[:, : int(T * PROMPT_SHARE)] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                    "id": [f"{s}-{i}" for i in range(B)]})
    return out


def child(args: dict) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from iprox_lightning.modules import WarmupModule
    import transformers.models.llama.modeling_llama  # noqa: F401
    from plan_memory import PeakSampler, stage1_config, vm_hwm

    torch.set_num_threads(args["threads"])
    config = stage1_config(args["shape"], args["layers"])
    data = DataLoader(batches(config, args["batch_size"], args["max_length"], args["steps"]), batch_size=None)
    sampler = PeakSampler(0.005)
    t0 = time.time()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args["precision"] == "bf16-true" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    module = WarmupModule(model=model, lr=1e-5, **SETTINGS[args["setting"]])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args["steps"], logger=False, precision=args["precision"],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    peak = sampler.stop()
    print(json.dumps({"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm(), "seconds": time.time() - t0}))


def predicted(args: dict) -> dict:
    from iprox_lightning.analysis import ModelSizes, RunSettings, saved_activation_bytes
    from iprox_lightning.analysis import training_plan
    from plan_memory import stage1_config

    config = stage1_config(args["shape"], args["layers"])
    sizes = ModelSizes.from_config(config, name=args["shape"])
    T = args["max_length"]
    share = (T - 1 - int(T * PROMPT_SHARE) + 1) / T  # scored positions t predict labels[t + 1] != -100
    run = RunSettings(max_length=T, batch_size=args["batch_size"], precision=args["precision"], device_kind="cpu",
                      response_share=share, **SETTINGS[args["setting"]])
    acts = saved_activation_bytes(config, seq_len=T, precision=args["precision"])
    return training_plan(sizes, acts, run, stage="warm-up", n_examples=args["batch_size"] * args["steps"]).to_dict()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    base = {"shape": a.shape, "layers": a.layers, "precision": a.precision, "max_length": a.max_length,
            "batch_size": a.batch_size, "steps": a.steps, "threads": a.threads}
    out = Path(a.out)
    result = {"command_line": "python bench/plan_levers.py " + " ".join(sys.argv[1:]), "args": base, "runs": {}}
    if out.is_file():
        result["runs"] = json.loads(out.read_text()).get("runs", {})
    # glibc's mmap threshold fixed at 128 KiB (as the Stage 1 measurement does): each large tensor is its own mapping,
    # returned when freed; with the default, dynamic threshold the heap keeps freed micro-batch activations resident
    # and RssAnon over-counts the live tensors by 0.1-0.25 GiB at the small shape
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads),
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    for setting in a.settings:
        args = {**base, "setting": setting}
        plan = predicted(args)
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(args)], cwd=ROOT,
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            result["runs"][setting] = {"error": p.stderr[-3000:]}
        else:
            m = json.loads(p.stdout.strip().splitlines()[-1])
            meas = m["peak"] - m["baseline"]
            result["runs"][setting] = {"measured": m, "measured_bytes": meas, "predicted_bytes": plan["peak"],
                                       "ratio": plan["peak"] / meas, "plan": plan}
        r = result["runs"][setting]
        print(setting, {k: r.get(k) for k in ("measured_bytes", "predicted_bytes", "ratio")} if "ratio" in r
              else r["error"][-1500:], flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    result["plan_code"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True).stdout.strip()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
