"""Validate ``train.py plan`` on CPU: each real stage in its own process, its peak memory against the plan's.

Per stage a child process imports the project, records its anonymous resident memory (``RssAnon`` of
``/proc/self/status``: the heap, not the file pages a model load maps) as the baseline, runs the stage through
``iprox_lightning.cli.main`` (the same ``fit`` / ``predict`` a user runs, with the shipped stage configs and an overlay)
while a thread samples ``RssAnon`` every 10 ms, and reports ``peak - baseline`` (and ``VmHWM``, the kernel's peak RSS,
for reference). The parent compares it with the plan's peak for the same settings. Models are random-init Hugging Face
directories of a named shape (``--shape``) with the SmolLM2 tokenizer; the pool is the first ``--pool-rows`` rows of
the shared pool; validation sets the built-in ones. One stage at a time; run it under the machine's heavy lock:

  flock /tmp/iprox-heavy.lock python bench/plan_memory.py --shape smollm2-135m --max-length 128 --batch-size 4 \
      --out bench/results/plan/smollm2-135m_cpu.json
  python bench/plan_memory.py --repredict bench/results/plan/smollm2-135m_cpu.json   # the plan again, same measurements
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not another one installed
GGUF = "/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"
POOL = "/work/shared/data/pool/instructions.jsonl"


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child(argv: list[str]) -> None:
    """Run one stage's command line, print ``{"baseline", "peak", "vm_hwm"}`` as the last line."""
    from iprox_lightning.cli import main  # noqa: F401  (the imports a stage makes, before the baseline)
    import lightning  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    base = rss_anon()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    from iprox_lightning.cli import main

    main(argv)
    done.set()
    t.join()
    peak[0] = max(peak[0], rss_anon())
    print(json.dumps({"baseline": base, "peak": peak[0], "vm_hwm": vm_hwm()}))


def make_model(shape: str, out: Path) -> Path:
    """A random-init model of ``shape`` saved with the SmolLM2 tokenizer (once)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from iprox_lightning.analysis import load_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config(shape))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(Path(GGUF).parent), gguf_file=Path(GGUF).name).save_pretrained(out)
    return out


def response_share(pool: Path, tokenizer: Path, max_length: int, batch_size: int, batches: int = 4) -> tuple[float, int]:
    """Mean share of scored tokens and the mean padded length of the first batches (the plan's ``response_share``)."""
    from iprox_lightning.data import SFTDataModule

    dm = SFTDataModule(pool=str(pool), validation="builtin", tokenizer=str(tokenizer), max_length=max_length,
                       batch_size=batch_size, seed=0, train_split="pool")
    dm.setup("fit")
    share, lengths = [], []
    for i, b in enumerate(dm.train_dataloader()):
        if i == batches:
            break
        share.append(float((b["labels"] != -100).float().mean()))
        lengths.append(b["input_ids"].shape[1])
    return sum(share) / len(share), round(sum(lengths) / len(lengths))


def overlays(stage: str, model: Path, pool: Path, work: Path, a, validation: str) -> list[str]:
    data = {"pool": str(pool), "validation": validation, "tokenizer": str(model), "max_length": a.max_length,
            "batch_size": a.batch_size}
    trainer = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "precision": a.precision}
    if stage == "warmup":
        cfg = {"trainer": {**trainer, "max_steps": a.steps, "limit_val_batches": 0},
               "model": {"init_args": {"model": str(model), "save_dir": None}},
               "data": {"init_args": {**data, "warmup_fraction": 0.5}}}
        return ["fit", "--config", str(ROOT / "configs/warmup.yaml"), "--config", _write(work, stage, cfg)]
    if stage == "build_proxy":
        cfg = {"trainer": {**trainer, "max_steps": a.steps, "limit_val_batches": 1, "num_sanity_val_steps": 0,
                           "val_check_interval": None, "check_val_every_n_epoch": 1000,
                           "callbacks": [{"class_path": "iprox_lightning.callbacks.IPSVDCallback",
                                          "init_args": {"sparsity": 0.5, "num_probe_tokens": a.probe_tokens,
                                                        "health_batches": 0}}]},
               "model": {"init_args": {"target": str(model), "save_dir": None, "keep_best": False}},
               "data": {"init_args": {**data, "batch_size": a.align_batch_size,
                                      "construction_fraction": a.construction_fraction}}}
        return ["fit", "--config", str(ROOT / "configs/build_proxy.yaml"), "--config", _write(work, stage, cfg)]
    if stage == "score":
        cfg = {"trainer": {**trainer, "limit_predict_batches": a.steps,
                           "callbacks": [{"class_path": "iprox_lightning.scoring.InfluenceWriter",
                                          "init_args": {"output_dir": str(work / f"scores_{model.name}"),
                                                        "overwrite": True,
                                                        "write_every_n_batches": 50}}]},
               "model": {"init_args": {"model": str(model), "method": "tracin", "per_task": True}},
               "data": {"init_args": data}}
        return ["predict", "--config", str(ROOT / "configs/score.yaml"), "--config", _write(work, stage, cfg)]
    raise ValueError(stage)


def _write(work: Path, stage: str, cfg: dict) -> str:
    import yaml

    p = work / f"{stage}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def predicted(shape: str, model: Path, a, share: float, length: int) -> dict:
    from iprox_lightning.analysis import ModelSizes, RunSettings, load_config, plan_stages

    cfg = load_config(str(model))
    sizes = ModelSizes.from_config(cfg, name=shape)
    n_pool = a.pool_rows
    run = RunSettings(pool_size=n_pool, max_length=length, batch_size=a.batch_size,
                        align_batch_size=a.align_batch_size, response_share=share, precision=a.precision,
                        device_kind="cpu", num_probe_tokens=a.probe_tokens, construction_fraction=a.construction_fraction,
                        tasks=a.tasks)
    st = {s.stage: s for s in plan_stages(sizes, cfg, run)}
    s1, s2 = st["build_proxy: Stage 1 (IPSVD)"], st["build_proxy: Stage 2 (alignment)"]
    bp = s1 if s1.peak >= s2.peak else s2
    return {"warmup": st["warm-up"].to_dict(), "build_proxy": bp.to_dict(), "build_proxy_stage1": s1.to_dict(),
            "build_proxy_stage2": s2.to_dict(), "score": st["scoring (tracin)"].to_dict(),
            "settings": {k: getattr(run, k) for k in run.__dataclass_fields__}}


def repredict(path: str) -> None:
    """Recompute the plan's side of a recorded validation with this checkout's memory model (the measurements stay)."""
    result = json.loads(Path(path).read_text())
    a = argparse.Namespace(**result["args"])
    model = Path(a.work) / "models" / a.shape
    plan = predicted(a.shape, model, a, result["response_share"], result["padded_length"])
    for stage, r in result["stages"].items():
        if "measured_bytes" not in r:
            continue
        r.update(predicted_bytes=plan[stage]["peak"], ratio=plan[stage]["peak"] / r["measured_bytes"],
                 plan=plan[stage])
        if stage == "build_proxy":
            r.update(plan_stage1=plan["build_proxy_stage1"], plan_stage2=plan["build_proxy_stage2"])
        print(stage, {k: r[k] for k in ("measured_bytes", "predicted_bytes", "ratio")})
    result["settings"] = plan["settings"]
    result["plan_code"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True).stdout.strip()
    Path(path).write_text(json.dumps(result, indent=1))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--repredict":
        return repredict(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--align-batch-size", type=int, default=2)
    ap.add_argument("--probe-tokens", type=int, default=256)
    ap.add_argument("--construction-fraction", type=float, default=0.05)
    ap.add_argument("--pool-rows", type=int, default=400)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=2, help="validation tasks of the built-in validation sets (2)")
    ap.add_argument("--validation-tasks", type=int, default=0,
                    help="> 0: a validation file of that many tasks (4 pool rows each) instead of the built-in sets")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--stages", nargs="+", default=["warmup", "build_proxy", "score"])
    ap.add_argument("--work", default="/tmp/plan_memory")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    pool = work / f"pool_{a.pool_rows}.jsonl"
    if not pool.is_file():
        with open(POOL) as f:
            pool.write_text("".join(next(f) for _ in range(a.pool_rows)))
    validation = "builtin"
    if a.validation_tasks:  # that many tasks of 4 examples each, from pool rows after the ones used as the pool
        rows = [json.loads(line) for line in open(POOL)][a.pool_rows:a.pool_rows + 4 * a.validation_tasks]
        val = work / f"validation_{a.validation_tasks}.jsonl"
        val.write_text("".join(json.dumps({**r, "id": f"val-{i}", "category": f"task{i // 4}"}) + "\n"
                               for i, r in enumerate(rows)))
        validation, a.tasks = str(val), a.validation_tasks
    model = make_model(a.shape, work / "models" / a.shape)
    share, length = response_share(pool, model, a.max_length, a.batch_size)
    plan = predicted(a.shape, model, a, share, length)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(a), "response_share": share, "padded_length": length, "stages": {}}
    if out.is_file():  # a re-run of some stages keeps the others' records
        result["stages"] = json.loads(out.read_text()).get("stages", {})
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    for stage in a.stages:
        argv = overlays(stage, model, pool, work, a, validation)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            result["stages"][stage] = {"command": cmd, "error": p.stderr[-3000:]}
        else:
            m = json.loads(p.stdout.strip().splitlines()[-1])
            meas = m["peak"] - m["baseline"]
            pred = plan[stage]["peak"]
            result["stages"][stage] = {"command": " ".join(cmd[1:]), "measured": m, "measured_bytes": meas,
                                       "predicted_bytes": pred, "ratio": pred / meas, "seconds": time.time() - t0,
                                       "plan": plan[stage]}
            if stage == "build_proxy":
                result["stages"][stage]["plan_stage1"] = plan["build_proxy_stage1"]
                result["stages"][stage]["plan_stage2"] = plan["build_proxy_stage2"]
        out.write_text(json.dumps(result, indent=1))
        r = result["stages"][stage]
        print(stage, {k: r.get(k) for k in ("measured_bytes", "predicted_bytes", "ratio")} if "ratio" in r
              else r["error"][-800:], flush=True)
    result["settings"] = plan["settings"]
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
