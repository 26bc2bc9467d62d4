"""Validate ``train.py plan``'s Stage 2 (alignment) on CPU: one alignment step per child process, its peak memory
against the plan's, with and without activation checkpointing and micro-batches.

Each child imports the project, then records its anonymous resident memory (``RssAnon``, ``bench/plan_memory.py``'s
sampler, every 10 ms) as the baseline, builds a random-init model of a shape (``--shape``: a named shape of
``train.py plan``, cut to ``--layers`` decoder blocks) as the target, an SVD proxy of it (sparsity 0.5), the AdamW
optimiser over the factors, and runs ``--steps`` steps of ``ProxyAlignModule.alignment_step`` + backward + AdamW step
(the module's own step without a Trainer, so nothing else is resident) on random token batches (half prompt, half
response). It reports ``peak - baseline`` and the plan's Stage 2 peak for the same settings (``build_proxy_plan``,
``device_kind=cpu``). Above ~2 GB: run under the machine's model lock:

  flock /tmp/iprox-model.lock python bench/plan_stage2.py --shape llama-3.2-1b --layers 2 --max-length 256 \\
      --batch-size 4 --out bench/results/plan/stage2_llama-3.2-1b-2l.json

``--devices N`` (N > 1): N gloo processes under FSDP2 (Lightning's ``ModelParallelStrategy``, the run's own sharding of
the proxy, the teacher and, with micro-batches, the accumulation buffers): a Lightning ``fit`` of the same
``ProxyAlignModule`` for ``--steps`` steps, each rank on its own random batches; each rank's peak is sampled from the
start of training (after the models are built and sharded: building the whole random model before sharding it is the
benchmark's, not the run's) and reported over its baseline after the imports, against the plan for ``--devices N
--strategy fsdp``. ``--shape`` also takes ``bench/plan_memory.py``'s random shapes (``small``, ``wide``).
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = {  # name: ProxyAlignModule settings
    "default": {},
    "checkpointing": {"activation_checkpointing": True},
    "micro_batch_1": {"micro_batch_size": 1},
    "checkpointing+micro_batch_1": {"activation_checkpointing": True, "micro_batch_size": 1},
    # (FSDP only: the proxy gathered one decoder block at a time, issue 63)
    "reshard_proxy": {"reshard_proxy": True},
    "reshard_proxy+micro_batch_1": {"reshard_proxy": True, "micro_batch_size": 1},
}


def config_of(shape: str, layers: int):
    """A named shape of ``train.py plan`` or a random shape of ``bench/plan_memory.py``, cut to ``layers`` blocks."""
    from plan_memory import STAGE1_SHAPES, stage1_config

    from iprox_lightning.analysis import load_config, with_layers
    from iprox_lightning.analysis import NAMED_SHAPES

    if shape in NAMED_SHAPES or shape not in STAGE1_SHAPES:
        return with_layers(load_config(shape), layers)
    return with_layers(stage1_config(shape, None), layers)


def random_batch(V: int, B: int, T: int, seed: int) -> dict:
    import torch

    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, : T // 2] = -100
    return dict(input_ids=ids, attention_mask=torch.ones(B, T, dtype=torch.long), labels=labels,
                id=[str(i) for i in range(B)])


def child(args: dict) -> None:
    if args.get("devices", 1) > 1:
        return fsdp_child(args)
    import torch
    from plan_memory import PeakSampler
    from transformers import AutoModelForCausalLM

    from iprox_lightning.compression import compress_model
    from iprox_lightning.modules import ProxyAlignModule

    sampler = PeakSampler(0.01)  # the baseline: after the imports (as bench/plan_memory.py)
    torch.manual_seed(0)
    config = config_of(args["shape"], args["layers"])
    target = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    module = ProxyAlignModule(target=target, keep_best=False, **args["settings"])
    module.configure_model()
    compress_model(module.proxy, None, 0.5, method="svd", progress=False)
    module.configure_model()
    opt = module.configure_optimizers()
    B, T, V = args["batch_size"], args["max_length"], config.vocab_size
    t0 = time.time()
    for step in range(args["steps"]):
        batch = random_batch(V, B, T, step)
        out = module.alignment_step(batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = sampler.stop()
    print(json.dumps({"peak_bytes": peak - sampler.base, "seconds": time.time() - t0, "loss": float(out.loss)}))


def fsdp_child(args: dict) -> None:
    """One rank of ``--devices N``: ``ProxyAlignModule`` fitted under FSDP2 (gloo); writes ``<rank_dir>/rank<r>.json``.
    Lightning's subprocess launcher starts the other ranks with this same command line."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from plan_memory import PeakSampler, rss_anon
    from transformers import AutoModelForCausalLM

    from iprox_lightning.compression import compress_model
    from iprox_lightning.modules import ProxyAlignModule

    base = rss_anon()  # after the imports
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    config = config_of(args["shape"], args["layers"])
    target = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    module = ProxyAlignModule(target=target, keep_best=False, log_layer_cosines=False, **args["settings"])
    del target
    module.configure_model()
    compress_model(module.proxy, None, 0.5, method="svd", progress=False)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    B, T, V = args["batch_size"], args["max_length"], config.vocab_size
    data = [random_batch(V, B, T, 1000 * step + rank) for step in range(args["steps"])]
    state: dict = {}

    class Peak(L.Callback):
        def on_train_start(self, trainer, pl_module):  # the models built, compressed and sharded
            state["sampler"], state["t0"] = PeakSampler(0.01), time.time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state["loss"] = float(outputs["loss"])

        def on_train_end(self, trainer, pl_module):
            peak = state["sampler"].stop()
            Path(args["rank_dir"], f"rank{rank}.json").write_text(json.dumps(
                {"peak_bytes": peak - base, "seconds": time.time() - state["t0"], "loss": state["loss"]}))

    trainer = L.Trainer(accelerator="cpu", devices=args["devices"], max_steps=args["steps"], logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=args["devices"], tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Peak()],
                        precision=args.get("precision", "32-true"))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))


def plan(args: dict) -> dict:
    from iprox_lightning.analysis import ModelSizes, RunSettings, build_proxy_plan
    from iprox_lightning.analysis import run_activations

    config = config_of(args["shape"], args["layers"])
    s = args["settings"]
    devices = args.get("devices", 1)
    run = RunSettings(max_length=args["max_length"], align_batch_size=args["batch_size"],
                      precision=args.get("precision", "32-true"),
                      device_kind="cpu", response_share=0.5, align_checkpointing=s.get("activation_checkpointing", False),
                      align_micro_batch_size=s.get("micro_batch_size"), devices=devices,
                      align_reshard_proxy=s.get("reshard_proxy", False),
                      strategy="fsdp" if devices > 1 else "ddp")
    acts, acts32 = run_activations(config, run)
    return build_proxy_plan(ModelSizes.from_config(config, name=args["shape"]), acts, run, acts32)[1].to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--devices", type=int, default=1, help="gloo processes under FSDP2 (> 1), or one process")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--precision", default="32-true", help="trainer.precision of --devices N > 1 (default 32-true)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    results = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "variants": {}}
    for name in a.variants:
        args = {"shape": a.shape, "layers": a.layers, "max_length": a.max_length, "batch_size": a.batch_size,
                "steps": a.steps, "settings": VARIANTS[name], "devices": a.devices}
        if a.precision != "32-true":
            if a.devices < 2:
                raise SystemExit("--precision: only with --devices N > 1 (the Trainer's precision plugin)")
            args["precision"] = a.precision
        # glibc: freed blocks leave the RSS at every size (as bench/plan_memory.py --stage1)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONPATH": str(ROOT),
               "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "PYTHONWARNINGS": "ignore"}
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", a.out, "--child",
                                   json.dumps({**args, "rank_dir": tmp})], env=env, capture_output=True, text=True,
                                  cwd=tmp)
            if proc.returncode:
                raise SystemExit(f"{name}: child failed\n{proc.stderr[-4000:]}")
            if a.devices > 1:
                ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(a.devices)]
            else:
                ranks = [json.loads(proc.stdout.strip().splitlines()[-1])]
        p = plan(args)
        measured = max(ranks, key=lambda r: r["peak_bytes"])
        results["variants"][name] = {**args, "measured": measured, "ranks": ranks, "plan": p,
                                     "ratio_plan_over_measured": p["peak"] / measured["peak_bytes"]}
        print(f"{name}: measured {[round(r['peak_bytes'] / 2**30, 3) for r in ranks]} GiB, plan "
              f"{p['peak'] / 2**30:.3f} GiB (ratio {p['peak'] / measured['peak_bytes']:.2f}), "
              f"{measured['seconds']:.0f} s", flush=True)
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
