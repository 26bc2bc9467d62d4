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

The memory levers of warm-up and the store build (issue 64): ``--micro-batch-size N`` and ``--gradient-checkpointing``
(warm-up's ``model.micro_batch_size`` / ``model.gradient_checkpointing``), ``--store-checkpointing`` (``build_store
--gradient_checkpointing``); the stage ``store`` builds a gradient store of ``--steps`` batches of the pool:

  flock /tmp/iprox-model.lock python bench/plan_memory.py --shape llama-3.2-1b --precision bf16-true --max-length 64 \
      --batch-size 4 --micro-batch-size 1 --gradient-checkpointing --stages warmup \
      --out bench/results/plan/levers_llama-3.2-1b_micro1_ckpt.json

``--stage1`` measures Stage 1 alone, per rank (one process, or several gloo DDP processes): the product's
``IPSVDCallback`` in a ``fit`` of ``ProxyAlignModule`` on a random model of a shape (``small``; ``llama-3.2-1b``;
``wide``: the 8B width, heads and vocabulary with two decoder layers), stopped right after Stage 1; each rank's peak
``RssAnon`` over its baseline against the plan's Stage 1 (``build_proxy_plan``). Runs with a model above ~2 GB go under
the machine's model lock:

  flock /tmp/iprox-model.lock python bench/plan_memory.py --stage1 --shape wide --precision bf16-true --devices 2 \
      --out bench/results/plan/stage1_wide.json

``--scoring`` measures scoring per rank: the product's ``InfluenceScoringModule`` under ``ModelParallelStrategy``
(FSDP2 over ``--devices`` gloo processes; ``--shard-layers``: each rank holds its share of the K-FAC factors or the
TracIn validation gradients) on a random model of a ``SCORING_SHAPES`` shape, against ``scoring_plan``; with
``--store``, build_store's gradient store build instead (``GradientStoreModule`` + ``GradientStoreWriter`` in a
``trainer.predict`` on ``--devices`` DDP processes, ``--store-checkpointing`` its ``gradient_checkpointing``),
against ``train.py plan``'s ``store build`` row:

  python bench/plan_memory.py --scoring --shape kfac --method tracin --shard-layers \
      --out bench/results/plan/scoring_shard_kfac.json
  python bench/plan_memory.py --scoring --shape kfac --store --store-checkpointing --batch-size 8 --max-length 256 \
      --out bench/results/plan/store_shard_kfac.json
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


def append_run(out: Path, result: dict) -> None:
    """Add ``result`` to the record ``out`` (``{"runs": [...]}``, made if absent) and print its ratio."""
    record = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    record["runs"].append(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: result[k] for k in ("measured_bytes", "predicted_bytes", "ratio", "seconds")}))


def measured_child(script: str, payload: dict, label: str, plan: dict, *, threads: int, cwd: str | None = None,
                   timeout: float | None = None) -> dict:
    """Run ``script --child <payload>`` in a fresh process and compare its peak with ``plan`` (``{"peak": bytes, ...}``):
    the record the plan benches append. glibc's mmap threshold is fixed at 128 KiB (each large tensor its own mapping,
    returned when freed, so RssAnon follows the live tensors); the child prints ``{"peak", "baseline", ...}`` last."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads),
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    p = subprocess.run([sys.executable, script, "--child", json.dumps(payload)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{label} failed (rc {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
    m = json.loads(p.stdout.strip().splitlines()[-1])
    meas = m["peak"] - m["baseline"]
    return {"measured": m, "measured_bytes": meas, "predicted_bytes": plan["peak"], "ratio": plan["peak"] / meas,
            "plan": plan}


def _status_bytes(key: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def rss_anon() -> int:
    value = _status_bytes("RssAnon")
    if value is None:
        raise RuntimeError("no RssAnon in /proc/self/status")
    return value


def vm_hwm() -> int:
    return _status_bytes("VmHWM") or 0


def random_sft_batch_maker(vocab_size: int, B: int, T: int, seed: int = 1):
    """A function giving random SFT batches ``[B, T]`` of token ids in ``[3, vocab_size)`` (seeded: the same sequence
    of batches each time), the first half of each row's labels masked, every position attended."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def batch():
        ids = torch.randint(3, vocab_size, (B, T), generator=g)
        labels = ids.clone()
        labels[:, : T // 2] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                "id": [str(i) for i in range(B)]}

    return batch


class PeakSampler:
    """This process's RssAnon from now on: ``base`` at the start, the largest value sampled every ``interval`` seconds
    by a daemon thread until :meth:`stop`, which returns the peak (the value at the stop included)."""

    def __init__(self, interval: float, base: int | None = None) -> None:
        self.base = rss_anon() if base is None else base  # base: an earlier sampler's (its peak not carried)
        self._peak = self.base
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._done.is_set():
            self._peak = max(self._peak, rss_anon())
            time.sleep(interval)

    def stop(self, join: bool = True) -> int:
        self._done.set()
        if join:
            self._thread.join()
        self._peak = max(self._peak, rss_anon())
        return self._peak


def child(argv: list[str]) -> None:
    """Run one stage's command line, print ``{"baseline", "peak", "vm_hwm"}`` as the last line."""
    from iprox_lightning.cli import main  # noqa: F401  (the imports a stage makes, before the baseline)
    import lightning  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    sampler = PeakSampler(0.01)
    from iprox_lightning.cli import main

    main(argv)
    peak = sampler.stop()
    print(json.dumps({"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm()}))


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
               "model": {"init_args": {"model": str(model), "save_dir": None, "micro_batch_size": a.micro_batch_size,
                                       "gradient_checkpointing": a.gradient_checkpointing}},
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
    if stage == "store":  # a store of the first --steps batches of the pool
        small = work / f"pool_{a.steps * a.batch_size}.jsonl"
        with open(pool) as f:
            small.write_text("".join(next(f) for _ in range(a.steps * a.batch_size)))
        return ["build_store", "--model", str(model), "--output_dir", str(work / f"store_{model.name}"), "--pool",
                str(small), "--max_length", str(a.max_length), "--batch_size", str(a.batch_size), "--precision",
                a.precision, "--accelerator", "cpu", "--overwrite", "true", "--progress", "false",
                "--gradient_checkpointing", str(a.store_checkpointing).lower()]
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
                        tasks=a.tasks, micro_batch_size=getattr(a, "micro_batch_size", None),
                        gradient_checkpointing=getattr(a, "gradient_checkpointing", False),
                        store_gradient_checkpointing=getattr(a, "store_checkpointing", False))
    st = {s.stage: s for s in plan_stages(sizes, cfg, run)}
    s1, s2 = st["build_proxy: Stage 1 (IPSVD)"], st["build_proxy: Stage 2 (alignment)"]
    bp = s1 if s1.peak >= s2.peak else s2
    return {"warmup": st["warm-up"].to_dict(), "build_proxy": bp.to_dict(), "build_proxy_stage1": s1.to_dict(),
            "build_proxy_stage2": s2.to_dict(), "score": st["scoring (tracin)"].to_dict(),
            "store": st["store build"].to_dict(),
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


# --------------------------------------------------------------------------------------------------------------------
# Stage 1 alone, per rank: --stage1
# --------------------------------------------------------------------------------------------------------------------
STAGE1_SHAPES = {  # random-init shapes (Hugging Face configs): name -> (named shape or config, layers override)
    "small": dict(model_type="llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False,
                  max_position_embeddings=2048),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                 max_position_embeddings=2048),
    "llama-3.2-1b": "llama-3.2-1b",
    # the 8B width, heads and vocabulary (Llama-3.1-8B), two decoder layers: ~1.5B parameters, 6 GB in float32
    "wide": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=131072),
}


def stage1_config(shape: str, layers: int | None):
    from transformers import AutoConfig

    from iprox_lightning.analysis import load_config

    spec = STAGE1_SHAPES[shape]
    if isinstance(spec, str):
        config = load_config(spec)
    else:
        d = dict(spec)
        config = AutoConfig.for_model(d.pop("model_type"), **d)
    if layers:
        config.num_hidden_layers = layers
    return config


def stage1_child(args: dict) -> None:
    """One rank of Stage 1: the product's ``IPSVDCallback`` in a Lightning ``fit`` of ``ProxyAlignModule`` on a random
    model of the shape, stopped right after Stage 1; writes ``{"baseline", "peak", "vm_hwm", "seconds"}`` (RssAnon
    bytes: after the imports, and the largest sampled every 5 ms from the model's construction to the end of Stage 1)
    to ``<out>/rank<r>.json``. Lightning's subprocess launcher starts the other ranks with this same command line."""
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    from iprox_lightning.compression import compress  # noqa: F401  (Stage 1's imports, probes and tracking: before the baseline)
    import transformers.models.llama.modeling_llama  # noqa: F401
    from iprox_lightning.callbacks import IPSVDCallback
    from iprox_lightning.modules import ProxyAlignModule

    torch.set_num_threads(args["threads"])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = PeakSampler(0.005)
    t0 = time.time()
    config = stage1_config(args["shape"], args["layers"])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args["precision"] == "bf16-true" else torch.float32  # model.dtype of the run
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    if args.get("after_construction"):  # the peak from here (a tied head is initialised apart, then tied)
        sampler.stop()
        sampler = PeakSampler(0.005, base=sampler.base)
    B, T, N = args["batch_size"], args["max_length"], args["probe_tokens"]
    batch = random_sft_batch_maker(config.vocab_size, B, T)
    probe = [batch() for _ in range(-(-N // (B * T)))]  # every token valid: N columns

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return [batch()]

        def probe_dataloader(self):
            return probe

    class Stop(L.Callback):
        def setup(self, trainer, pl_module, stage):  # right after IPSVDCallback.setup (its barrier passed)
            peak = sampler.stop(join=False)  # the process ends here (os._exit): the sampler thread with it
            out = Path(args["out"]) / f"rank{rank}.json"
            out.write_text(json.dumps({"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm(),
                                       "seconds": time.time() - t0}))
            sys.stdout.flush()
            os._exit(0)

    world = args["devices"]
    module = ProxyAlignModule(target=model, log_layer_cosines=False, keep_best=False)
    del model
    callback = IPSVDCallback(sparsity=0.5, num_probe_tokens=N, health_batches=0,
                             probe_group_layers=args["probe_group_layers"], allocation=args.get("allocation"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=1,
                        precision=args["precision"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[callback, Stop()])
    trainer.fit(module, datamodule=Data())
    raise RuntimeError("Stage 1 did not stop the run")


def stage1_plan(args: dict) -> dict:
    """The plan's Stage 1 for the same settings (``bench`` and the CI test compare it with the measured peak)."""
    from iprox_lightning.analysis import ModelSizes, RunSettings
    from iprox_lightning.analysis import build_proxy_plan, saved_activation_bytes

    config = stage1_config(args["shape"], args["layers"])
    sizes = ModelSizes.from_config(config, name=args["shape"])
    run = RunSettings(max_length=args["max_length"], align_batch_size=args["batch_size"], precision=args["precision"],
                      devices=args["devices"], device_kind="cpu", num_probe_tokens=args["probe_tokens"],
                      probe_group_layers=args["probe_group_layers"])
    acts = saved_activation_bytes(config, seq_len=run.max_length, precision=run.precision)
    acts32 = saved_activation_bytes(config, seq_len=run.max_length, precision="32-true")
    return build_proxy_plan(sizes, acts, run, acts32)[0].to_dict()


def stage1_measure(args: dict, timeout: float | None = None) -> dict:
    """Run :func:`stage1_child` (``args["devices"]`` ranks) and compare each rank's peak with the plan's."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        child_args = {**args, "out": tmp}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage1-child", json.dumps(child_args)]
        # glibc raises its mmap threshold (up to 32 MB) each time a mapped block is freed, after which freed blocks
        # below it stay in the heap and in RSS: fixed at 128 KiB, RSS follows the live tensors at any shape (as it
        # does anyway for tensors above 32 MB)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args["threads"]),
               "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        t0 = time.time()
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args["devices"])
                 if (Path(tmp) / f"rank{r}.json").is_file()]
        if len(ranks) != args["devices"]:
            raise RuntimeError(f"Stage 1 run failed (rc {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
    plan = stage1_plan(args)
    measured = [r["peak"] - r["baseline"] for r in ranks]
    return {"args": args, "command": " ".join(["python bench/plan_memory.py --stage1-child", repr(json.dumps(args))]),
            "ranks": ranks, "measured_bytes": measured, "predicted_bytes": plan["peak"],
            "ratio": [plan["peak"] / m for m in measured], "seconds": time.time() - t0, "plan": plan}


def stage1_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="Stage 1's per-rank peak RSS against the plan (--stage1)")
    ap.add_argument("--shape", default="small", choices=sorted(STAGE1_SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--devices", type=int, default=1, help="processes (gloo DDP on CPU when > 1)")
    ap.add_argument("--probe-tokens", type=int, default=128)
    ap.add_argument("--probe-group-layers", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--allocation", default=None, choices=["global", "uniform"],
                    help="IPSVDCallback allocation (default: global); uniform decomposes each layer once, not twice "
                         "(the plan's 'decompositions' part, the global allocation's kept ones, is then not held)")
    ap.add_argument("--after-construction", action="store_true",
                    help="sample the peak from after the model's construction (over the baseline before it): a "
                         "random-init model with a tied head holds the head twice while it is built")
    ap.add_argument("--out", required=True, help="JSON file; a record per run is appended under 'runs'")
    a = ap.parse_args(argv)
    args = {"shape": a.shape, "layers": a.layers, "precision": a.precision, "devices": a.devices,
            "probe_tokens": a.probe_tokens, "probe_group_layers": a.probe_group_layers, "batch_size": a.batch_size,
            "max_length": a.max_length, "threads": a.threads, "allocation": a.allocation,
            **({"after_construction": True} if a.after_construction else {})}
    result = stage1_measure(args)
    result["code"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result["command_line"] = "python bench/plan_memory.py --stage1 " + " ".join(argv)
    append_run(Path(a.out), result)


# --------------------------------------------------------------------------------------------------------------------
# Scoring under FSDP2 with shard_layers, per rank: --scoring
# --------------------------------------------------------------------------------------------------------------------
SCORING_SHAPES = {
    # K-FAC's factors dominate: 4 blocks of width 1024 / MLP 4096 (~0.96 GB of float32 factors, ~0.5 GB per rank of 2)
    "kfac": dict(model_type="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False,
                 max_position_embeddings=2048),
    # wider (issue 64 item 5): 2 blocks of width 2048 / MLP 8192, a 32k vocabulary (~1 GB of float32 weights)
    "wide2k": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
                   max_position_embeddings=2048),
    "tiny": STAGE1_SHAPES["tiny"],
    "wide": STAGE1_SHAPES["wide"],  # the 8B width and vocabulary, two blocks (~6 GB of float32 weights per rank)
}


def scoring_settings(args: dict) -> dict:
    """The :class:`ScoringConfig` fields of a ``--scoring`` run."""
    return {"method": args["method"], "kfac_examples": args["kfac_examples"], "kfac_partitions": args["partitions"],
            "shard_layers": args["shard_layers"]}


def scoring_child(args: dict) -> None:
    """One rank of scoring: the product's ``InfluenceScoringModule`` under ``ModelParallelStrategy`` (FSDP2: the model
    sharded per block; ``args["devices"]`` gloo processes) on a random model of the shape, ``trainer.predict`` over a
    few random batches; writes ``{"baseline", "peak", "vm_hwm", "seconds"}`` (RssAnon bytes after the imports, and the
    largest sampled every 5 ms from the model's construction to the end of the predict loop) to
    ``<out>/rank<r>.json``. Lightning's subprocess launcher starts the other ranks with this same command line."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from transformers import AutoConfig, AutoModelForCausalLM

    import transformers.models.llama.modeling_llama  # noqa: F401  (before the baseline)
    from iprox_lightning.scoring import GradientStoreModule, GradientStoreWriter, InfluenceScoringModule

    torch.set_num_threads(args["threads"])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = PeakSampler(0.005)
    t0 = time.time()
    d = dict(SCORING_SHAPES[args["shape"]])
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    B, T = args["batch_size"], args["max_length"]
    batch = random_sft_batch_maker(config.vocab_size, B, T)

    def rows(n, tasks):
        out = []
        for j in range(n):
            b = batch()
            b["id"] = [f"{j}-{i}" for i in range(B)]
            b["task"] = [tasks[(j * B + i) % len(tasks)] for i in range(B)]
            out.append(b)
        return out

    pool = rows(args["pool_batches"], ["x"])
    val = rows(args["val_batches"], [f"t{k}" for k in range(args["tasks"])])

    from torch.utils.data import DataLoader

    class Data(L.LightningDataModule):  # (each rank scores every pool batch; the factor and validation passes split)
        def predict_dataloader(self):
            return DataLoader(pool, batch_size=None)

        def dataloader(self, split):
            return DataLoader(pool, batch_size=None)

        def validation_dataloader(self):
            return DataLoader(val, batch_size=None)

    world = args["devices"]
    if args.get("store"):  # build_store's predict: each rank its share of the pool (DDP, or FSDP2 per block)
        store = GradientStoreModule(model, k=args["k"], gradient_checkpointing=args["store_checkpointing"])
        del model
        writer = GradientStoreWriter(str(Path(args["out"], "store")), write_every_n_batches=args["write_every_n_batches"])
        sharded = args.get("strategy") == "fsdp" and world > 1  # build_store --strategy fsdp: FSDP2 per block
        trainer = L.Trainer(accelerator="cpu", devices=world, logger=False,
                            strategy=(ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
                                      if sharded else "ddp" if world > 1 else "auto"),
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            inference_mode=False, callbacks=[writer], precision="32-true")
        trainer.predict(store, DataLoader(pool, batch_size=None), return_predictions=False)
        peak = sampler.stop()
        rows = json.loads(Path(args["out"], "store", "store.json").read_text())["rows"]  # (rank 0's, after a barrier)
        Path(args["out"], f"rank{rank}.json").write_text(json.dumps(
            {"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm(), "seconds": time.time() - t0,
             "store_rows": rows, "store_dim": store.projector.dim}))
        return
    module = InfluenceScoringModule(model, **scoring_settings(args))
    del model
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if world > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.predict(module, datamodule=Data(), return_predictions=False)
    peak = sampler.stop()
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(
        {"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm(), "seconds": time.time() - t0,
         "factors_held": len(module.metric.eigens) if hasattr(module.metric, "eigens") else 0,
         "validation_gradients_held": len(module.scorer.V)}))


def scoring_plan_of(args: dict) -> dict:
    """The plan's scoring stage for the same settings (``bench`` and the CI test compare it with the measured peak)."""
    from transformers import AutoConfig

    from iprox_lightning.analysis import ModelSizes, RunSettings, saved_activation_bytes
    from iprox_lightning.analysis import scoring_plan

    d = dict(SCORING_SHAPES[args["shape"]])
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    sizes = ModelSizes.from_config(config, name=args["shape"])
    if args.get("store"):  # the "store build" row train.py plan prints (plan_scoring.cpu_peak's)
        from iprox_lightning.analysis import plan_stages

        T = args["max_length"]
        run = RunSettings(max_length=T, batch_size=args["batch_size"], precision="32-true", devices=args["devices"],
                          strategy=args["strategy"], device_kind="cpu", attn_implementation="eager",
                          response_share=(T - T // 2) / T, pool_size=args["pool_batches"] * args["batch_size"],
                          store_k=args["k"], write_every_n_batches=args["write_every_n_batches"],
                          store_gradient_checkpointing=args["store_checkpointing"])
        acts = saved_activation_bytes(config, seq_len=T, precision=run.precision, attn_implementation="eager")
        return {s.stage: s for s in plan_stages(sizes, config, run, acts=acts, acts32=acts)}["store build"].to_dict()
    run = RunSettings(max_length=args["max_length"], batch_size=args["batch_size"], precision="32-true",
                      devices=args["devices"], strategy="fsdp" if args["devices"] > 1 else "ddp", device_kind="cpu",
                      tasks=args["tasks"], kfac_examples=args["kfac_examples"], kfac_partitions=args["partitions"],
                      shard_layers=args["shard_layers"])
    acts = saved_activation_bytes(config, seq_len=run.max_length, precision=run.precision)
    return scoring_plan(sizes, acts, run, args["method"]).to_dict()


def scoring_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="Scoring's per-rank peak RSS under FSDP2 + shard_layers (--scoring)")
    ap.add_argument("--shape", default="kfac", choices=sorted(SCORING_SHAPES))
    ap.add_argument("--method", default="kfac")
    ap.add_argument("--devices", type=int, default=2, help="processes (FSDP2 over gloo on CPU when > 1)")
    ap.add_argument("--shard-layers", action="store_true")
    ap.add_argument("--partitions", type=int, default=1, help="kfac_partitions")
    ap.add_argument("--kfac-examples", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--pool-batches", type=int, default=4)
    ap.add_argument("--val-batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--store", action="store_true",
                    help="the store build instead (build_store's GradientStoreModule + GradientStoreWriter; DDP ranks)")
    ap.add_argument("--k", type=int, default=16, help="--store: projection rows per side")
    ap.add_argument("--store-checkpointing", action="store_true", help="--store: gradient_checkpointing")
    ap.add_argument("--store-strategy", default="ddp", choices=["ddp", "fsdp"],
                    help="--store: build_store --strategy (fsdp: the model sharded per block, FSDP2)")
    ap.add_argument("--write-every-n-batches", type=int, default=50, help="--store: batches per shard")
    ap.add_argument("--out", required=True, help="JSON file; a record per run is appended under 'runs'")
    a = ap.parse_args(argv)
    # ("store", not plan_scoring.py's "kind": tests/test_plan_scoring_levers_measured.py reads that script's records)
    store = {"store": True, "strategy": a.store_strategy, "k": a.k, "store_checkpointing": a.store_checkpointing,
             "write_every_n_batches": a.write_every_n_batches} if a.store else {}
    args = {**store, "shape": a.shape, "method": a.method, "devices": a.devices, "shard_layers": a.shard_layers,
            "partitions": a.partitions, "kfac_examples": a.kfac_examples, "tasks": a.tasks, "batch_size": a.batch_size,
            "max_length": a.max_length, "pool_batches": a.pool_batches, "val_batches": a.val_batches,
            "threads": a.threads}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--scoring-child", json.dumps({**args, "out": tmp})]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads),
               "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # (see stage1_measure)
        t0 = time.time()
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(a.devices)
                 if (Path(tmp) / f"rank{r}.json").is_file()]
        if len(ranks) != a.devices:
            raise RuntimeError(f"scoring run failed (rc {p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
    plan = scoring_plan_of(args)
    measured = [r["peak"] - r["baseline"] for r in ranks]
    result = {"args": args, "ranks": ranks, "measured_bytes": measured, "predicted_bytes": plan["peak"],
              "ratio": [plan["peak"] / m for m in measured], "seconds": time.time() - t0, "plan": plan,
              "code": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
              "command_line": "python bench/plan_memory.py --scoring " + " ".join(argv)}
    append_run(Path(a.out), result)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--scoring-child":
        return scoring_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "--scoring":
        return scoring_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--stage1-child":
        return stage1_child(json.loads(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "--stage1":
        return stage1_main(sys.argv[2:])
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
    ap.add_argument("--stages", nargs="+", default=["warmup", "build_proxy", "score"],
                    choices=["warmup", "build_proxy", "score", "store"])
    ap.add_argument("--micro-batch-size", type=int, default=None, help="warm-up's model.micro_batch_size")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="warm-up's model.gradient_checkpointing")
    ap.add_argument("--store-checkpointing", action="store_true", help="build_store --gradient_checkpointing")
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
