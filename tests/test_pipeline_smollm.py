"""The pipeline and every baseline / ablation config on the real SmolLM2-135M (slow; small sizes).

This test guards the real-model code paths (GGUF loading, the Llama layers, the chat template, the eval suites,
every stage and baseline command) and the defaults, not quality: at this toy size (40 pool examples of at most 64
tokens, a warm-up on 2 of them) a proxy's ranking of 40 examples is not stable across machines (another x86 CPU and
a freshly resolved environment moved the proxy's Spearman from 0.19 to 0.03), so no such ranking is asserted here.
Quality claims live in the benchmarks (``bench/fidelity_v2.py``, ``bench/effect.py``; docs/BENCHMARKS.md).

What is asserted:
- exactly, what follows from the settings: parameter counts (sparsity, allocation, rank rounding), the stages that
  ran, nothing dropped by truncation, the number of examples scored and evaluated, the alignment's step count, the
  methods the ablation configs resolve to, the set of variants;
- the numbers of the models that see only a deterministic computation, at tolerances derived from runs under
  several CPU kernel sets and thread counts (``tests/data/slow_spread.json``, written by ``IPROX_SLOW_RECORD``):
  the warmed target's held-out loss (the base row of the effect table) and the un-warmed model's agreement with it;
- invariants: the models fine-tuned on the target's and on the seeded random selection have a held-out loss below
  the un-fine-tuned one's (by 0.65 and 0.2 nats); every variant scored every pool example with a finite score;
  ``no_kl`` that kept step 0 ranks exactly like ``no_alignment``.

Measured across CPU kernels (this AMD EPYC, 2 threads, native AVX-512 vs ``ATEN_CPU_CAPABILITY=avx2``, torch 2.13.0,
transformers 5.23.0): the warmed target's held-out loss moves by 3e-6 relative and the un-warmed model's Spearman
not at all, while the proxy's Spearman goes from 0.19 to −0.05, svd_init's from 0.35 to 0.13, and the proxy's
2-example fine-tune from 2.45 to 3.15 (``tests/data/slow_spread.json``, "recorded").

``IPROX_SLOW_RECORD=FILE python -m pytest tests/test_pipeline_smollm.py --runslow`` writes the measured values
(JSON) before asserting, to extend ``tests/data/slow_spread.json`` with another machine or setting.
"""
import json
import math
import os
from pathlib import Path

import pytest

from iprox_lightning.commands.pipeline import pipeline

from test_pipeline import run_all_variants

pytestmark = pytest.mark.slow

DATA = {"max_length": 64, "batch_size": 4, "val_per_task": 2, "construction_fraction": 0.25, "probe_fraction": 0.5,
        "warmup_fraction": 0.05}
SPREAD_FILE = Path(__file__).parent / "data" / "slow_spread.json"
STAGES = ("warmup", "build_proxy", "score:target", "score:proxy", "finetune:proxy", "finetune:target", "finetune:random")
VARIANTS = {"svd_init", "random_init", "no_alignment", "no_kl", "kfac", "off_the_shelf", "layer_extraction",
            "regression_scorer", "random"}


def _within(name, value):
    """``value`` lies in the range measured for ``name`` across settings, widened by the recorded tolerance."""
    spread = json.loads(SPREAD_FILE.read_text())
    lo, hi = spread["ranges"][name]
    tol = spread["tolerance"][name]
    assert lo - tol <= value <= hi + tol, f"{name}: {value} outside [{lo}, {hi}] ± {tol} (tests/data/slow_spread.json)"


def test_pipeline_and_variants_on_smollm(smollm_gguf, shared_dir, tmp_path, monkeypatch):
    from iprox_lightning.compression.apply import read_manifest

    monkeypatch.chdir(tmp_path)
    pool = tmp_path / "pool.jsonl"
    with open(shared_dir / "data" / "pool" / "instructions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = rows[:: len(rows) // 40][:40]  # 40 examples spread over the file (28 categories, 5 sources)
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {**DATA, "pool": str(pool)}
    wd = tmp_path / "run"
    # select_rule pooled: one subset each for the proxy, the target and random, as tests/data/slow_spread.json measured
    # (the default, balanced, fine-tunes once per task: the README recipe's test runs it on this model)
    s = pipeline(workdir=str(wd), target=str(smollm_gguf), pool=str(pool),
                 validation=f"eval:{shared_dir / 'data' / 'eval'}", data_args=DATA, select_rule="pooled",
                 proxy_validation="proxy")  # the proxy's own validation gradients, as slow_spread.json measured
    res = run_all_variants(wd, tmp_path, demo=False, data=data, base_model=str(smollm_gguf), le_fraction="0.1")
    aligned = read_manifest(wd / "proxy" / "model")["alignment"]
    no_kl = read_manifest(tmp_path / "no_kl" / "model")["alignment"]
    metrics = s["selection_effect"]["metrics"]
    measured = {
        "params": [s["target_params"], s["proxy_params"]],
        "base_loss": metrics["base"]["loss"],
        "base_per_task_loss": {t: metrics["base"]["per_task"][t]["loss"] for t in ("mmlu", "bbh", "tydiqa")},
        "loss": {who: m["loss"] for who, m in metrics.items()},
        "spearman": {name: v[0] for name, v in res.items()},
        "proxy_spearman": s["retention_proxy_vs_target"]["spearman"],
        "alignment_best_step": aligned["best"]["step"],
        "no_kl_best_step": no_kl["best"]["step"],
    }
    if os.environ.get("IPROX_SLOW_RECORD"):
        Path(os.environ["IPROX_SLOW_RECORD"]).write_text(json.dumps(measured, indent=1))

    # exact: what follows from the settings
    assert (s["target_params"], s["proxy_params"]) == (134_515_008, 81_430_848)
    assert {k: v["status"] for k, v in s["stages"].items()} == {k: "ran" for k in STAGES}
    assert all(part["dropped"] == 0 for who in s["truncation_dropped"].values() for part in who.values())
    assert s["retention_proxy_vs_target"]["n"] == 40 and s["retention_random_vs_target"]["n"] == 40
    assert aligned["steps"] == 4 and 0 <= aligned["best"]["step"] <= 4
    assert set(metrics) == {"base", "proxy", "target", "random"}
    assert all(m["n"] == 375 for m in metrics.values())
    assert set(res) == VARIANTS
    # deterministic computations: the warmed target's held-out loss, and how the un-warmed model ranks against it
    _within("base_loss", metrics["base"]["loss"])
    for t, v in measured["base_per_task_loss"].items():
        _within(f"base_loss_{t}", v)
    _within("off_the_shelf_spearman", res["off_the_shelf"][0])
    # invariants: fine-tuning on the target's or the seeded random 2 examples lowers the held-out loss (not asserted
    # for the proxy's 2: under ATen's AVX2 kernels its toy ranking picks other examples, which raised the loss to 3.146
    # from 3.067); every variant ranks all 40
    for who in ("target", "random"):
        assert metrics[who]["loss"] < metrics["base"]["loss"] - 0.1, who
    for name, (rho, ids) in res.items():
        assert math.isfinite(rho) and -1 <= rho <= 1 and len(ids) == len(set(ids)) > 0, name
    if no_kl["best"]["step"] == 0:  # keep_best restored the un-aligned factors: the no_alignment ranking exactly
        assert res["no_kl"] == res["no_alignment"]
