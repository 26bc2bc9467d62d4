"""``train.py plan``'s Stage 1 against the measured per-rank peak of the product's Stage 1 (``bench/plan_memory.py
--stage1``: ``IPSVDCallback`` in a ``ProxyAlignModule`` fit of a random model, stopped after Stage 1, each rank's peak
``RssAnon`` over its baseline after the imports) at a small shape: 512 wide, MLP 2048, 2 layers, vocabulary 8192
(65 MB of float32 weights), 128 probe tokens; and every run recorded in ``bench/results/plan/stage1_*.json`` (the
small and Llama-3.2-1B shapes; the wide shape, the 8B width, heads and vocabulary with two decoder layers, once
recorded) against today's plan for the same settings (no model run: a plan change that breaks the agreement fails).

Tolerance ±20%, the issue's target. What is not modelled: a few MB the run allocates besides its tensors (the Lightning
trainer, the module objects, the probe batches; 4 MB measured at a 64-wide shape, 3% here) and what the plan takes as
an upper bound (the float64 work of the largest layer all at once). The 1B and wide (8B-width) shapes are measured by
the same code and recorded in ``bench/results/plan/stage1_*.json`` (too slow for the suite: minutes to an hour on
this CPU, each under the machine's model lock; the commands are in the JSON, ``command_line``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_bench("plan_memory")


def _args(**over):
    return {"shape": "small", "layers": None, "precision": "32-true", "devices": 1, "probe_tokens": 128,
            "probe_group_layers": None, "batch_size": 1, "max_length": 64, "threads": 1, "allocation": None, **over}


def _check(result):
    for measured, ratio in zip(result["measured_bytes"], result["ratio"]):
        assert 0.8 <= ratio <= 1.2, (f"plan {result['predicted_bytes'] / 2**20:.1f} MiB vs measured "
                                     f"{measured / 2**20:.1f} MiB", result["plan"]["parts"])


def test_stage_one_plan_is_within_20_percent_of_the_measured_peak():
    result = _bench().stage1_measure(_args(), timeout=300)
    _check(result)


@pytest.mark.distributed
def test_stage_one_plan_is_within_20_percent_on_each_of_two_gloo_ranks_probing_groups():
    bench = _bench()
    result = bench.stage1_measure(_args(devices=2, probe_group_layers=2), timeout=400)
    assert len(result["measured_bytes"]) == 2
    _check(result)
    whole = bench.stage1_plan(_args())
    assert result["plan"]["parts"]["probes"] < whole["parts"]["probes"] / 2  # one group of the rank's share


def _recorded_runs():
    """Every Stage 1 measurement recorded by ``bench/plan_memory.py --stage1`` (``bench/results/plan/stage1_*.json``
    with ``runs`` of per-rank ``measured_bytes``; the equivalence records beside them hold no measurement)."""
    for path in sorted((ROOT / "bench" / "results" / "plan").glob("stage1_*.json")):
        runs = json.loads(path.read_text()).get("runs")
        for i, run in enumerate(runs if isinstance(runs, list) else []):
            if isinstance(run, dict) and "measured_bytes" in run:
                a = run["args"]
                yield pytest.param(run, id=f"{path.stem}:{i}:{a['shape']}:{a['precision']}:{a['devices']}proc")


RUNS = list(_recorded_runs())


def test_the_small_and_1b_shapes_are_recorded():
    assert {(r.values[0]["args"]["shape"], r.values[0]["args"]["devices"]) for r in RUNS} >= {
        ("small", 1), ("small", 2), ("llama-3.2-1b", 1), ("llama-3.2-1b", 2)}


@pytest.mark.parametrize("run", RUNS)
def test_recorded_stage_one_peaks_are_within_20_percent_of_todays_plan(run):
    """Each recorded run's per-rank measured peak against the plan this checkout makes for the run's settings."""
    plan = _bench().stage1_plan(run["args"])
    assert len(run["measured_bytes"]) == run["args"]["devices"]
    for measured in run["measured_bytes"]:
        assert 0.8 <= plan["peak"] / measured <= 1.2, (
            f"{run['command_line']}: plan {plan['peak'] / 2**30:.2f} GiB vs measured {measured / 2**30:.2f} GiB",
            {k: round(v / 2**30, 3) for k, v in plan["parts"].items()})
