"""The benchmark tables the pages show are what the kept results give.

``bench/tables.py`` regenerates every generated table of ``docs/BENCHMARKS.md`` (and of ``RESULTS.md`` / the README
where they carry one) and every run's ``summary.md`` from the recorded JSON with the bench scripts' own table
writers; below, the effect summaries' numbers are recomputed from the kept per-example evaluations. No model runs.
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import effect  # noqa: E402
import tables  # noqa: E402
from variants import dir_name  # noqa: E402

from iprox_lightning.evaluation import paired_gain, percentile_interval  # noqa: E402


def test_every_generated_table_matches_its_results():
    assert tables.differences() == []


def test_benchmarks_page_carries_every_table_and_fits_a_read():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 300
    for begin, end in tables.page_tables():
        if (begin, end) in tables.PLANNED:  # the plan's tables (nothing measured): the README carries them
            assert (ROOT / "README.md").read_text().count(begin) == 1, begin
            continue
        assert text.count(begin) == 1 and text.count(end) == 1, begin


def test_a_changed_number_is_caught(tmp_path):
    """The check compares numbers, not just the markers: one digit changed in a page's table is reported."""
    page = tmp_path / "BENCHMARKS.md"
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    begin, end = effect.headline_markers(Path("effect_gpu2048"))
    body = tables.block(text, begin, end)
    changed = body.replace("+0.", "+9.", 1)
    assert changed != body
    page.write_text(text.replace(body, changed))
    assert any(begin in w and "differs" in w for w in tables.differences([page]))


def evaluations(run: str) -> dict[str, dict]:
    """``{key: {task: {"ids": [...], metric: array}}}`` of the kept per-example evaluations of an effect run."""
    out: dict[str, dict] = {}
    for p in sorted((tables.RESULTS / run / "evals").glob("*.json")):
        ev = json.loads(p.read_text())
        assert p.name == f"{dir_name(ev['key'])}.json"
        out[ev["key"]] = {t: {"ids": [e["id"] for e in r["examples"]],
                              **{m: np.asarray([float(e[m]) for e in r["examples"]]) for m in effect.METRICS}}
                          for t, r in ev["tasks"].items()}
    return out


@pytest.mark.parametrize("run", tables.EFFECT_RUNS)
def test_effect_rows_recomputed_from_the_kept_evaluations(run):
    """Each row's mean, its bootstrap CI and its paired gain over the random subsets (with CI) follow from the kept
    per-example held-out values: a selection fine-tuned with several seeds counts with its per-example mean."""
    summary = tables.recorded(f"{run}/summary.json")
    meta, evals = summary["meta"], evaluations(run)
    boot, seed = 1000, 0  # bench/effect.py's defaults, with which every recorded summary was written
    checked = 0
    for row in summary["rows"]:
        task, sel, m = row["task"], row["selector"], row["metric"]

        def values(selector: str) -> np.ndarray:
            key = selector if selector == "base" or effect.task_free(selector.split("~")[0]) or \
                selector.startswith("random:") else f"{task}/{selector}"
            runs = [evals[key][task]] + [by_task[task] for k, by_task in evals.items()
                                          if k.startswith(f"{key}{effect.FT_SUFFIX}") and task in by_task]
            assert selector != sel or sel == "base" or len(runs) == len(row["finetune_seeds"])
            assert all(r["ids"] == runs[0]["ids"] for r in runs)
            assert len(runs[0]["ids"]) == row["heldout_n"]
            return np.mean([r[m] for r in runs], axis=0)

        v = values(sel)
        assert row["value"] == pytest.approx(float(v.mean()), abs=1e-12)
        assert row["ci"] == pytest.approx(percentile_interval(lambda ix: float(v[ix].mean()), len(v), boot, seed),
                                          abs=1e-12)
        if "diff_vs_random" in row:
            rand = [values(f"random:{s}") for s in meta["random_seeds"]]
            diff, ci, gains = paired_gain(v, rand, row["higher_is_better"], boot, seed)
            assert row["diff_vs_random"] == pytest.approx(diff, abs=1e-12)
            assert row["diff_ci"] == pytest.approx(ci, abs=1e-12)
            assert row["diff_vs_best_random_seed"] == pytest.approx(min(gains), abs=1e-12)
        checked += 1
    assert checked == len(summary["rows"]) > 100


def test_results_fidelity_table_numbers_are_recorded_rows():
    """docs/RESULTS.md's per-task fidelity table is a reading of the generated one: each of its rows' MMLU / BBH /
    TyDiQA Spearman (2 decimals) is a row of ``bench/results/fidelity_v2/summary.json.gz``, its ceiling the recorded
    split-half reliability (3 decimals)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    summary = json.loads(gzip.decompress((root / "bench/results/fidelity_v2/summary.json.gz").read_bytes()))
    recorded = {tuple(round(r["per_task"][t]["spearman"], 2) for t in ("mmlu", "bbh", "tydiqa"))
                for r in summary["rows"] if all(t in r.get("per_task", {}) for t in ("mmlu", "bbh", "tydiqa"))}
    text = (root / "docs/RESULTS.md").read_text()
    section = text[text.index("## Per-task fidelity of the proxies"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| row")][:20]
    rows = rows[:next((i for i, r in enumerate(rows) if not r.strip().endswith("|")), len(rows))]
    num = lambda s: float(s.strip().replace("−", "-").replace("+", ""))  # noqa: E731
    checked = 0
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("ceiling"):
            half = {t: v["spearman"] for t, v in summary["meta"]["target_split_half_per_task"].items()}
            assert tuple(num(c) for c in cells[1:4]) == tuple(round(half[t], 3) for t in ("mmlu", "bbh", "tydiqa"))
            checked += 1
            continue
        triple = tuple(num(c) for c in cells[1:4])
        assert triple in recorded, f"RESULTS.md row {cells[0]!r}: {triple} is no recorded fidelity_v2 row"
        checked += 1
    assert checked >= 8
