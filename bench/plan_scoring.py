"""Scoring and the store build against ``train.py plan`` on the CPU (issue 64 item 5): per setting, a child process
runs the product's own code on a random-init model of a shape (``bench/plan_memory.py``'s ``STAGE1_SHAPES``:
``small``, ``llama-3.2-1b``, ``wide``; ``--layers`` decoder layers) and random token batches, sampling its anonymous
resident memory (``RssAnon`` every 5 ms, ``plan_memory.PeakSampler``) from before the model is built to the end; the
peak over the same process's after its imports is compared with the plan's peak for the same settings.

* ``score``: :func:`iprox_lightning.scoring.influence_scores` (``per_task``; ``--columns`` validation tasks) with the
  method and the settings of ``--settings`` (``SCORE_SETTINGS``: K-FAC / EK-FAC partitions and offload, the TracIn
  validation-gradient holdings), against ``scoring_plan`` (the ``scoring (<method>)`` row of ``train.py plan``);
* ``store``: a gradient store's build (``GradientStoreModule`` + ``GradientStoreWriter`` in a ``Trainer.predict``,
  what ``build_store`` runs), with and without ``gradient_checkpointing``, against ``store_plan``.

On a CPU the device is the host: what the plan places in host memory (validation gradients held on the host or
accumulated there in float32 before bfloat16, K-FAC factors offloaded) lives in the same memory as the rest, so the
compared figure is the plan's device peak plus those host bytes (:func:`cpu_peak`; zero for the default settings).

  flock /tmp/iprox-model.lock python bench/plan_scoring.py score --shape llama-3.2-1b --layers 2 \\
      --out bench/results/plan/scoring_llama-3.2-1b.json
  flock /tmp/iprox-model.lock python bench/plan_scoring.py store --shape llama-3.2-1b --layers 2 \\
      --out bench/results/plan/store_llama-3.2-1b.json

Each run is appended to the JSON's ``runs`` with its command line;
``tests/test_plan_scoring_levers_measured.py`` checks every recorded run against today's plan (±20%, no model run).
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SCORE_SETTINGS = {
    "tracin": {"method": "tracin"},
    "tracin_bf16": {"method": "tracin", "validation_gradients": {"dtype": "bfloat16"}},
    "tracin_host": {"method": "tracin", "validation_gradients": {"device": "cpu"}},
    "tracin_groups": {"method": "tracin", "validation_gradients": {"column_groups": 1000}},  # a pass per column
    "kfac": {"method": "kfac"},
    "kfac_partitions4": {"method": "kfac", "kfac_partitions": 4},
    "kfac_partitions4_offload": {"method": "kfac", "kfac_partitions": 4, "kfac_offload": True},
    "ekfac": {"method": "ekfac"},
    "ekfac_partitions4_offload": {"method": "ekfac", "kfac_partitions": 4, "kfac_offload": True},
}
STORE_SETTINGS = {"store": {}, "store_ckpt": {"gradient_checkpointing": True}}
PROMPT_SHARE = 0.5  # the first half of each sequence is prompt (not scored)


def batches(config, n: int, B: int, T: int, prefix: str, columns: int = 0, seed: int = 1) -> list[dict]:
    """``n`` random examples in batches of ``B`` (seeded), the prompt's labels masked; ``columns`` > 0: a ``task``
    per row (round robin)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(0, n, B):
        b = min(B, n - j)
        ids = torch.randint(3, config.vocab_size, (b, T), generator=g)
        labels = ids.clone()
        labels[:, : int(T * PROMPT_SHARE)] = -100
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                 "id": [f"{prefix}{j + r}" for r in range(b)]}
        if columns:
            batch["task"] = [f"t{(j + r) % columns}" for r in range(b)]
        out.append(batch)
    return out


def child(args: dict) -> None:
    import lightning as L  # noqa: F401  (the imports a stage makes, before the baseline)
    import torch
    from transformers import AutoModelForCausalLM
    import transformers.models.llama.modeling_llama  # noqa: F401

    from iprox_lightning.scoring import influence_scores  # noqa: F401
    from iprox_lightning.scoring import GradientStoreModule, GradientStoreWriter  # noqa: F401
    from plan_memory import PeakSampler, stage1_config, vm_hwm

    torch.set_num_threads(args["threads"])
    config = stage1_config(args["shape"], args["layers"])
    B, T = args["batch_size"], args["max_length"]
    pool = batches(config, args["pool"], B, T, "p", seed=1)
    sampler = PeakSampler(0.005)
    t0 = time.time()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # the construction's transient (a tied head is initialised apart, then tied: +0.98 GiB at the 1B shape) is not
    # the stage's: the peak is taken from here, over the baseline before the model
    sampler.stop()
    sampler = PeakSampler(0.005, base=sampler.base)
    if args["kind"] == "score":
        from iprox_lightning.scoring import influence_scores

        val = batches(config, 2 * args["columns"], B, T, "v", columns=args["columns"], seed=2)
        setting = dict(SCORE_SETTINGS[args["setting"]])
        table = influence_scores(model, pool, val, progress=False, per_task=True, kfac_examples=args["pool"],
                                 **setting)
        assert len(table) == args["pool"]
    else:
        import lightning as L

        from iprox_lightning.scoring import GradientStoreModule, GradientStoreWriter

        module = GradientStoreModule(model, k=args["k"], **STORE_SETTINGS[args["setting"]])
        writer = GradientStoreWriter(args["out_dir"], write_every_n_batches=args["write_every_n_batches"])
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False,
                            enable_progress_bar=False, inference_mode=False, callbacks=[writer],
                            enable_checkpointing=False, precision="32-true")
        from torch.utils.data import DataLoader

        trainer.predict(module, DataLoader(pool, batch_size=None), return_predictions=False)
    peak = sampler.stop()
    print(json.dumps({"baseline": sampler.base, "peak": peak, "vm_hwm": vm_hwm(), "seconds": time.time() - t0}))


def run_settings(args: dict):
    from iprox_lightning.analysis import RunSettings

    T = args["max_length"]
    share = (T - int(T * PROMPT_SHARE)) / T  # scored positions (labels[t + 1] != -100) over all positions
    common = dict(max_length=T, batch_size=args["batch_size"], precision="32-true", device_kind="cpu",
                  response_share=share, pool_size=args["pool"])
    if args["kind"] == "score":
        s = SCORE_SETTINGS[args["setting"]]
        return RunSettings(**common, tasks=args["columns"], kfac_examples=args["pool"], method=s["method"],
                           kfac_partitions=s.get("kfac_partitions", 1), kfac_offload=s.get("kfac_offload", False),
                           validation_gradients=s.get("validation_gradients"))
    return RunSettings(**common, store_k=args["k"], write_every_n_batches=args["write_every_n_batches"],
                       store_gradient_checkpointing=STORE_SETTINGS[args["setting"]].get("gradient_checkpointing",
                                                                                         False))


@functools.lru_cache(maxsize=None)
def _counts(shape: str, layers: int | None, max_length: int):
    """The config, its sizes and its activations (float32, counted on fake tensors) at ``max_length``: once per
    shape (the CI test checks many records of the same one)."""
    from iprox_lightning.analysis import ModelSizes, RunSettings, run_activations
    from plan_memory import stage1_config

    config = stage1_config(shape, layers)
    return config, ModelSizes.from_config(config, name=shape), run_activations(config, RunSettings(
        max_length=max_length, precision="32-true"))


def cpu_peak(args: dict) -> dict:
    """The plan's stage for ``args`` (``scoring_plan`` / ``store_plan``, what ``train.py plan`` prints) and its CPU
    figure, the same: on a CPU (``device_kind``) the plan counts what it holds in host memory, the same memory (the
    validation gradients where they are held and their float32 sums while they are prepared; ``kfac_offload`` as
    no move)."""
    from iprox_lightning.analysis import plan_stages

    config, sizes, (acts, acts32) = _counts(args["shape"], args["layers"], args["max_length"])
    run = run_settings(args)

    def stage(r, name):  # the row train.py plan prints
        return {s.stage: s for s in plan_stages(sizes, config, r, acts=acts, acts32=acts32)}[name]

    if args["kind"] == "store":
        plan = stage(run, "store build")
        return {"plan": plan.to_dict(), "host": 0.0, "peak": plan.peak}
    # (on a CPU the plan counts the host's parts itself: kfac_offload moves nothing, and the validation gradients
    # count where they are held, their float32 sums at their preparation: memory.with_validation_preparation)
    plan = stage(run, f"scoring ({run.method})")
    return {"plan": plan.to_dict(), "host": 0.0, "peak": plan.peak}


def measure(args: dict, timeout: float | None = None) -> dict:
    from plan_memory import measured_child

    with tempfile.TemporaryDirectory() as tmp:
        run = measured_child(str(Path(__file__).resolve()), {**args, "out_dir": str(Path(tmp) / "store")},
                             args["setting"], cpu_peak(args), threads=args["threads"], cwd=tmp, timeout=timeout)
    return {"args": args, **run}


def main() -> None:
    from plan_memory import append_run

    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["score", "store"])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--pool", type=int, default=8, help="pool examples scored (also the K-FAC factor examples)")
    ap.add_argument("--columns", type=int, default=3, help="score: validation tasks (2 examples each)")
    ap.add_argument("--k", type=int, default=16, help="store: projection rows per side")
    ap.add_argument("--write-every-n-batches", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settings", nargs="+", default=None,
                    help=f"score: of {list(SCORE_SETTINGS)} (default all); store: of {list(STORE_SETTINGS)}")
    ap.add_argument("--out", required=True, help="JSON file; each run is appended under 'runs'")
    a = ap.parse_args()
    table = SCORE_SETTINGS if a.kind == "score" else STORE_SETTINGS
    settings = a.settings or list(table)
    bad = [s for s in settings if s not in table]
    if bad:
        ap.error(f"unknown settings {bad} for {a.kind}: {list(table)}")
    out = Path(a.out)
    code = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for setting in settings:
        args = {"kind": a.kind, "setting": setting, "shape": a.shape, "layers": a.layers, "max_length": a.max_length,
                "batch_size": a.batch_size, "pool": a.pool, "columns": a.columns, "k": a.k,
                "write_every_n_batches": a.write_every_n_batches, "threads": a.threads}
        t0 = time.time()
        try:
            result = measure(args)
        except RuntimeError as e:
            print(setting, "FAILED", str(e)[-1500:], flush=True)
            continue
        result.update(seconds=time.time() - t0, code=code,
                      command_line="python bench/plan_scoring.py " + " ".join(sys.argv[1:]))
        print(setting, end=" ")
        append_run(out, result)


if __name__ == "__main__":
    main()
