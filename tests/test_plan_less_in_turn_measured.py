"""``checkpoints_in_turn`` measured on SmolLM2-135M's LESS scoring (the effect run's LoRA warm-up: 4 checkpoints, r 128
on q/k/v/o, 93 subtask columns held in bfloat16, 16 pool rows, T 128 × 8; ``bench/less_in_turn.py``, one process per
mode, its peak anonymous resident memory over its baseline): every recorded run against the plan this checkout makes
for its settings (``less_scoring_plan`` on a CPU, the named ``smollm2-135m`` shape), within ±25%, and the two modes'
score tables equal bit for bit. No model run: the measurement takes about an hour under the model lock
(``flock /tmp/iprox-model.lock python bench/less_in_turn.py --rows 16 --recorded <effect run>/configs/score_less.yaml
--out bench/results/plan/less_in_turn_smollm2.json``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

RECORD = Path(__file__).resolve().parents[1] / "bench" / "results" / "plan" / "less_in_turn_smollm2.json"
RUNS = [pytest.param(r, id=f"run{i}") for i, r in enumerate(json.loads(RECORD.read_text())["runs"])]


@pytest.mark.parametrize("run", RUNS)
def test_each_mode_is_within_a_quarter_of_todays_plan_and_in_turn_holds_less(run):
    bench = load_bench("less_in_turn")
    measured = {}
    for mode, in_turn in (("together", False), ("in_turn", True)):
        m = run["modes"][mode]
        plan = bench.plan_peak(run["plan_settings"], in_turn)["peak"]
        ratio = plan / m["measured_bytes"]
        assert 0.8 <= ratio <= 1.25, (mode, plan / 2**30, m["measured_bytes"] / 2**30)
        measured[mode] = m["measured_bytes"]
    assert run["scores_bit_equal"] and run["modes"]["in_turn"]["rows"] == run["plan_settings"]["pool_size"]
    assert measured["in_turn"] < 0.6 * measured["together"]  # one checkpoint's scorer held instead of four
