"""Stage 1 (``IPSVDCallback``) per rank: one process vs two gloo CPU processes (Lightning DDP, ``torchrun``).

Each run is the product's proxy build — ``ProxyAlignModule`` on a built-in-vocabulary Llama, ``SFTDataModule`` on the
built-in demo data (the demo's splits: ``construction_fraction`` 0.1, probes 10% of it), ``IPSVDCallback`` at ρ 0.5
with every probe token — stopped after one alignment step. Two callbacks around ``IPSVDCallback`` measure, on every
rank, Stage 1 alone: its wall seconds, its CPU seconds (``time.process_time``: the work itself, which a busy shared
machine does not inflate as it does the wall time), and the peak resident memory during it (Linux: the peak is reset through
``/proc/self/clear_refs`` just before, ``VmHWM`` read just after; ``rss_before_mb`` is the resident memory before:
the teacher and the proxy copy, built by ``configure_model`` before the clock starts). Every process runs one torch
thread, so one rank's seconds compare with the one-process run's.

    python bench/ddp_stage1.py --shape wide --out bench/results/ddp/stage1_wide.json
    python bench/ddp_stage1.py --shape wide --package /tmp/base-checkout --label before \\
        --out bench/results/ddp/stage1_wide.json   # the same runs with another checkout's package (rows appended)

``--package DIR`` puts ``DIR`` first on ``PYTHONPATH`` (e.g. a checkout of the commit before Stage 1 ran once:
every rank computed it); the rows record the package's git commit.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SHAPES = {  # overrides of models.builtin.builtin_model (built-in tokenizer's vocabulary)
    "demo": {},  # the demo's: hidden 64, MLP 128, 2 layers (~86k parameters)
    "wide": dict(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4),  # ~13M
}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _worker(shape: str, out: str) -> None:
    import lightning as L
    import torch

    from iprox_lightning.callbacks import IPSVDCallback
    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.models import builtin_model
    from iprox_lightning.modules import ProxyAlignModule

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    row: dict = {"rank": rank, "world_size": world}

    class Start(L.Callback):
        def setup(self, trainer, pl_module, stage):
            pl_module.configure_model()  # teacher + proxy copy: before the clock (IPSVDCallback calls it again)
            row["rss_before_mb"] = _status_mb("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident memory (VmHWM)
            row["t0"], row["cpu0"] = time.perf_counter(), time.process_time()

    class Stop(L.Callback):
        def setup(self, trainer, pl_module, stage):
            row["stage1_s"] = time.perf_counter() - row.pop("t0")
            row["stage1_cpu_s"] = time.process_time() - row.pop("cpu0")  # this process's CPU seconds, all threads
            row["stage1_peak_rss_mb"] = _status_mb("VmHWM")
            rep = pl_module.ipsvd_report
            row.update(probe_tokens=rep.probe_tokens, params_before=rep.params_before, params_after=rep.params_after)

    dm = SFTDataModule(pool="builtin", validation="builtin", tokenizer="builtin", max_length=128, batch_size=4,
                       construction_fraction=0.1, probe_fraction=0.1, train_split="align", seed=0)
    module = ProxyAlignModule(target=builtin_model(seed=0, **SHAPES[shape]), lr=5e-5, log_layer_cosines=False)
    callback = IPSVDCallback(sparsity=0.5, num_probe_tokens=918)  # every probe token of the demo's probe split
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[Start(), callback, Stop()])
    trainer.fit(module, datamodule=dm)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commit(package: Path) -> str:
    r = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if r.returncode != 0:
        return "unknown (not a git checkout: see the label)"
    dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+changes" if dirty else "")


def _run(world: int, shape: str, package: Path, rows_file: Path) -> list[dict]:
    rows_file.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(package)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    script = [str(HERE), "--worker", "--shape", shape, "--rows", str(rows_file)]
    if world == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={_free_port()}", *script]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(res.stdout + res.stderr)[-4000:]}")
    wall = time.perf_counter() - t0
    rows = sorted((json.loads(line) for line in rows_file.read_text().splitlines()), key=lambda r: r["rank"])
    load = round(os.getloadavg()[0], 2)  # the machine is shared: its load when the run ended
    return [{**r, "command_wall_s": round(wall, 2), "load_avg_1min_after": load} for r in rows]


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (label, processes, rank): the median over repeats of Stage 1's CPU and wall seconds and of its
    peak resident memory above the memory before it."""
    from statistics import median

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["processes"], r["rank"]), []).append(r)
    return [{"label": label, "processes": n, "rank": rank, "repeats": len(rs),
             "stage1_cpu_s": round(median(r["stage1_cpu_s"] for r in rs), 2),
             "stage1_wall_s": round(median(r["stage1_s"] for r in rs), 2),
             "stage1_peak_above_before_mb": round(median(r["stage1_peak_rss_mb"] - r["rss_before_mb"] for r in rs), 1)}
            for (label, n, rank), rs in groups.items() if all("stage1_cpu_s" in r for r in rs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    ap.add_argument("--out", default="bench/results/ddp/stage1.json")
    ap.add_argument("--package", default=str(HERE.parents[1]), help="checkout whose iprox_lightning is measured")
    ap.add_argument("--label", default="rank0_once", help="name of this code's behaviour in the rows")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--summary-only", action="store_true", help="rewrite the summary of --out's rows, run nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.shape, a.rows)
        return
    out, package = Path(a.out), Path(a.package).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.exists() else {"rows": []}
    result["description"] = __doc__.split("\n\n")[0]
    commit = _commit(package)
    for repeat in range(0 if a.summary_only else a.repeats):
        for world in (1, 2):
            rows = _run(world, a.shape, package, out.with_suffix(".rows.tmp"))
            for r in rows:
                r.update(shape=a.shape, shape_overrides=SHAPES[a.shape], label=a.label, package_commit=commit,
                         repeat=repeat, processes=world, backend="gloo" if world > 1 else None, threads_per_process=1)
                print(json.dumps(r), flush=True)
            result["rows"].extend(rows)
            result["summary"] = summarise(result["rows"])
            out.write_text(json.dumps(result, indent=1))
    result["summary"] = summarise(result["rows"])
    out.write_text(json.dumps(result, indent=1))
    for line in result["summary"]:
        print(json.dumps(line))
    out.with_suffix(".rows.tmp").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
