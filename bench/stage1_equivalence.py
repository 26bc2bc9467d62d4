"""Stage 1's factors on SmolLM2-135M: a checkout's single pass against this one's single pass, probe groups and 2 gloo
processes (each rank its share of the layers).

Every run is ``compress`` (the global allocation, the library's defaults, ρ 0.5) of SmolLM2-135M-Instruct (the shared
GGUF) on the probe split of the first ``--pool-rows`` rows of the shared pool (``SFTDataModule``, T 256, batch 4), one
thread per process; the factors of each run are saved, then compared with the reference run's (``--before``'s single
pass when given, else this checkout's): bitwise equal tensors, or the largest relative Frobenius error. Run under the
machine's model lock:

  flock /tmp/iprox-model.lock python bench/stage1_equivalence.py --before /work/main \\
      --out bench/results/plan/stage1_equivalence_smollm2.json
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

ROOT = Path(__file__).resolve().parents[1]
GGUF = "/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"
POOL = "/work/shared/data/pool/instructions.jsonl"


def _batches(pool_rows: int, work: Path, tokenizer: str):
    from iprox_lightning.data import SFTDataModule

    pool = work / "pool.jsonl"
    if not pool.is_file():
        with open(POOL) as f:
            pool.write_text("".join(next(f) for _ in range(pool_rows)))
    dm = SFTDataModule(pool=str(pool), validation="builtin", tokenizer=tokenizer, max_length=256, batch_size=4, seed=0,
                       construction_fraction=0.5, probe_fraction=0.1, train_split="align")
    dm.setup("fit")
    return list(dm.probe_dataloader())


def run(args: dict) -> None:
    """One run (this process, or one torchrun rank): ``compress`` and the factors saved to ``args["out"]``."""
    import torch
    from safetensors.torch import save_file

    from iprox_lightning.compression import CompressionConfig, compress
    from iprox_lightning.models import load_model

    torch.set_num_threads(1)
    kwargs = {}
    if args.get("group"):
        kwargs["probe_group_layers"] = args["group"]
    if args.get("distributed"):
        import torch.distributed as dist

        from iprox_lightning.compression import TorchExchange

        dist.init_process_group("gloo")
        kwargs["exchange"] = TorchExchange()
    model, _ = load_model(args["model"], dtype="float32")
    batches = _batches(args["pool_rows"], Path(args["work"]), args["model"])
    t0 = time.time()
    report = compress(model, batches, CompressionConfig(sparsity=0.5, num_probe_tokens=args["probe_tokens"]),
                      progress=False, **kwargs)
    rank = int(os.environ.get("RANK", 0))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k.endswith((".A", ".B"))}
    save_file(state, str(Path(args["out"]) / f"factors{rank}.safetensors"))
    (Path(args["out"]) / f"report{rank}.json").write_text(json.dumps(
        {"ranks": report.ranks, "seconds": time.time() - t0, "probe_tokens": report.probe_tokens}))
    if args.get("distributed"):
        torch.distributed.destroy_process_group()


def _launch(package: Path, args: dict, processes: int = 1) -> tuple[list[Path], str]:
    out = Path(tempfile.mkdtemp(prefix="stage1_eq_"))
    args = {**args, "out": str(out), "distributed": processes > 1}
    env = {**os.environ, "PYTHONPATH": str(package), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    script = str(ROOT / "bench" / "stage1_equivalence.py")
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--master_port=29517",
               script, "child", json.dumps(args)]
    else:
        cmd = [sys.executable, script, "child", json.dumps(args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError((p.stdout + p.stderr)[-4000:])
    return [out / f"factors{r}.safetensors" for r in range(processes)], " ".join(
        [f"PYTHONPATH={package}"] + cmd[1:-1] + [repr(json.dumps(args))])


def compare(ref: dict, got: dict) -> dict:
    import torch

    assert set(ref) == set(got), "different factorised layers"
    differ = [k for k in ref if not torch.equal(ref[k], got[k])]
    worst = max((float((ref[k] - got[k]).norm() / ref[k].norm()) for k in differ), default=0.0)
    return {"tensors": len(ref), "bitwise_equal": len(ref) - len(differ), "max_relative_error": worst}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        return run(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="another checkout whose single pass is the reference")
    ap.add_argument("--model", default=GGUF, help="the model (and its tokenizer); builtin: a dry run")
    ap.add_argument("--pool-rows", type=int, default=400)
    ap.add_argument("--probe-tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=21, help="probe_group_layers of the grouped run")
    ap.add_argument("--runs", nargs="+", default=["reference", "single_pass", "groups", "gloo_2", "gloo_2_groups"],
                    help="which runs (reference: --before's single pass, or this checkout's)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from safetensors.torch import load_file

    work = Path(tempfile.mkdtemp(prefix="stage1_eq_work_"))
    base = {"pool_rows": a.pool_rows, "probe_tokens": a.probe_tokens, "work": str(work), "model": a.model}
    runs = {}
    ref_pkg = Path(a.before) if a.before else ROOT
    plan = [("reference", ref_pkg, {}, 1), ("single_pass", ROOT, {}, 1), ("groups", ROOT, {"group": a.group}, 1),
            ("gloo_2", ROOT, {}, 2), ("gloo_2_groups", ROOT, {"group": a.group}, 2)]
    for name, package, extra, procs in [r for r in plan if r[0] in a.runs]:
        t0 = time.time()
        files, cmd = _launch(package, {**base, **extra}, procs)
        runs[name] = {"command": cmd, "files": files, "seconds": time.time() - t0,
                      "ranks": [json.loads((f.parent / f"report{r}.json").read_text())["ranks"]
                                for r, f in enumerate(files)]}
        print(name, f"{runs[name]['seconds']:.0f} s", flush=True)
    ref = load_file(str(runs["reference"]["files"][0]))
    one_process = {g: load_file(str(runs[one]["files"][0])) for g, one in (("gloo_2", "single_pass"),
                                                                          ("gloo_2_groups", "groups"))
                   if g in runs and one in runs}
    result = {"model": a.model, "settings": {**base, "group": a.group, "sparsity": 0.5, "allocation": "global (default)"},
              "reference": str(ref_pkg), "code": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                                                capture_output=True, text=True).stdout.strip(),
              "comparisons": {}}
    for name, r in runs.items():
        if name == "reference":
            continue
        for i, f in enumerate(r["files"]):
            got = load_file(str(f))
            result["comparisons"][f"{name} rank {i} vs reference"] = {
                **compare(ref, got), "same_ranks": r["ranks"][i] == runs["reference"]["ranks"][0]}
            if name in one_process:  # the one-process run with the same probe groups
                same = "single_pass" if name == "gloo_2" else "groups"
                result["comparisons"][f"{name} rank {i} vs {same}"] = compare(one_process[name], got)
    result["runs"] = {k: {"command": v["command"], "seconds": v["seconds"]} for k, v in runs.items()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["comparisons"], indent=1))


if __name__ == "__main__":
    main()
