"""Does Lightning's ``FSDPStrategy`` (FSDP1) run the warm-up and the scoring on 2 CPU gloo processes?

Each variant runs the product's CLI (``python train.py fit|predict``) with the shipped config, the
built-in demo overlay and an overlay naming the strategy (2 CPU processes, a 200-example built-in pool, 4 warm-up
steps), and records its exit code and last error lines:

* ``fsdp``, ``fsdp_cpu_offload``: Lightning's registered names;
* ``fsdp1_subclass``, ``fsdp1_subclass_offload``: ``FSDPStrategy`` under a subclass's name (written into OUT as
  ``cpufsdp.py``; Lightning's accelerator check compares the exact type, so the subclass reaches torch's
  ``FullyShardedDataParallel``), without and with ``cpu_offload=True``.

    python bench/fsdp1_cpu.py --out bench/results/ddp/fsdp1_cpu.json
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
SUBCLASS = '''from lightning.pytorch.strategies import FSDPStrategy


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy under another type: Lightning refuses `type(strategy) is FSDPStrategy` on the CPU accelerator."""
'''
VARIANTS = {
    "fsdp": "fsdp",
    "fsdp_cpu_offload": "fsdp_cpu_offload",
    "fsdp1_subclass": {"class_path": "cpufsdp.CPUFSDPStrategy"},
    "fsdp1_subclass_offload": {"class_path": "cpufsdp.CPUFSDPStrategy", "init_args": {"cpu_offload": True}},
}


def _run(work: Path, name: str, sub: str, stage: str, overlay: dict) -> dict:
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(overlay))
    args = [sys.executable, str(ROOT / "train.py"), sub, "--config", str(ROOT / "configs" / f"{stage}.yaml"),
            "--config", str(ROOT / "configs" / "builtin" / f"{stage}.yaml"), "--config", str(cfg)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{work}", IPROX_ALLOW_IMPORTS="cpufsdp",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=900)
    text = r.stdout + "\n" + r.stderr
    errors = [line for line in text.splitlines() if line.rstrip().endswith(("Error", "detected.", "use FSDP."))
              or ": RuntimeError: " in line or line.startswith("ValueError")]
    return {"variant": name, "exit_code": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "errors": list(dict.fromkeys(errors))[-3:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/ddp/fsdp1_cpu.json")
    a = ap.parse_args()
    import lightning
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "cpufsdp.py").write_text(SUBCLASS)
        data = {"pool": "builtin", "validation": "builtin", "seed": 0, "builtin_size": 200}
        trainer = {"accelerator": "cpu", "devices": 2, "logger": False, "enable_progress_bar": False,
                   "enable_model_summary": False, "default_root_dir": str(work / "lightning")}
        from iprox_lightning.models import builtin_model, builtin_tokenizer

        dense = work / "dense"  # the model scored: the built-in one, saved (the warm-up under test may save nothing)
        builtin_model().save_pretrained(dense)
        builtin_tokenizer().save_pretrained(dense)
        for name, strategy in VARIANTS.items():
            rows.append(_run(work, f"warmup-{name}", "fit", "warmup", {
                "seed_everything": 0, "trainer": {**trainer, "strategy": strategy, "max_steps": 4},
                "model": {"init_args": {"model": "builtin", "save_dir": str(work / name / "warm")}},
                "data": {"init_args": {**data, "tokenizer": "builtin", "train_split": "warmup"}}}))
            rows.append(_run(work, f"score-{name}", "predict", "score", {
                "seed_everything": 0, "trainer": {**trainer, "strategy": strategy, "callbacks": [
                    {"class_path": "iprox_lightning.scoring.InfluenceWriter",
                     "init_args": {"output_dir": str(work / name / "scores")}}]},
                "model": {"init_args": {"model": str(dense), "method": "tracin"}},
                "data": {"init_args": {**data, "tokenizer": str(dense)}}}))
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"description": __doc__.split("\n\n")[0], "torch": torch.__version__,
                               "lightning": lightning.__version__, "processes": 2, "backend": "gloo",
                               "accelerator": "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
