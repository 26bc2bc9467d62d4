"""Top-k selection: size (count / fraction), determinism, per-task (LESS max), dedup, zero-grad rows,
and the output read back by the data module."""
from __future__ import annotations

import json

import numpy as np
import pytest

from iprox_lightning.scoring import ScoreTable
from iprox_lightning.selection.select import select

N = 40


@pytest.fixture()
def scored(tmp_path):
    rng = np.random.default_rng(0)
    ids = [f"ex-{j:03d}" for j in range(N)]
    scores = rng.normal(size=N).round(2)  # rounding creates ties -> tie-break by id is exercised
    task_scores = rng.normal(size=(N, 2))
    zero = np.zeros(N, bool)
    zero[[3, 17]] = True
    scores[zero] = 0.0
    task_scores[zero] = 0.0
    scores[5] = scores.max() + 1  # best example, and its text duplicates ex-006 below
    table = ScoreTable(ids, scores, ["bbh", "mmlu"], task_scores, np.where(zero, 0, 5), zero, ["t"] * N)
    path = tmp_path / "scores.parquet"
    table.save(str(path))
    pool = tmp_path / "pool.jsonl"
    with open(pool, "w") as f:
        for j, i in enumerate(ids):
            text = "same  text" if j in (5, 6) else f"text {j}"
            f.write(json.dumps({"id": i, "source": "s", "category": "c", "instruction": text, "context": "",
                                "response": "r"}) + "\n")
    return table, str(path), str(pool)


def ranked(table, values, drop=()):
    rows = [(v, i) for v, i, z in zip(values, table.ids, table.zero_grad) if not z and i not in drop]
    return [i for v, i in sorted(rows, key=lambda r: (-r[0], r[1]))]


def read_ids(path):
    return [json.loads(line)["id"] for line in open(path)]


def test_count_fraction_and_determinism(scored, tmp_path):
    table, path, pool = scored
    out = select(path, k=7, dedup=False, pool=pool, output=str(tmp_path / "a.jsonl"))
    assert read_ids(out) == ranked(table, table.scores)[:7]
    again = select(path, k=7, dedup=False, pool=pool, output=str(tmp_path / "b.jsonl"))
    assert open(out).read() == open(again).read()
    # fraction of the 38 rankable examples (2 zero-gradient rows are never selected)
    out = select(path, k=0.25, dedup=False, pool=pool, output=str(tmp_path / "c.jsonl"))
    ids = read_ids(out)
    assert len(ids) == round(0.25 * (N - 2)) == 10 and "ex-003" not in ids and "ex-017" not in ids
    rec = json.loads(open(out).readline())
    # one format: id + score + the canonical record (Dolly schema) that SFTDataModule reads; extra pool columns dropped
    assert set(rec) == {"id", "score", "category", "instruction", "context", "response"}
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["count"] == 10 and [m["id"] for m in meta["selected"]] == ids


def test_rule_max_uses_less_max_and_dedup_by_text(scored, tmp_path):
    table, path, pool = scored
    out = select(path, k=5, rule="max", dedup=False, pool=pool, output=str(tmp_path / "p.jsonl"))
    assert read_ids(out) == ranked(table, table.task_scores.max(axis=1))[:5]
    # ex-005 (best) and ex-006 share one text: with dedup only the higher-scored one stays
    out = select(path, k=N, dedup=True, pool=pool, output=str(tmp_path / "d.jsonl"))
    ids = read_ids(out)
    assert ids[0] == "ex-005" and "ex-006" not in ids and len(ids) == N - 3
    # without a pool: id + score rows
    out = select(path, k=3, output=str(tmp_path / "ids.jsonl"))
    rows = [json.loads(line) for line in open(out)]
    assert [r["id"] for r in rows] == ranked(table, table.scores)[:3]
    assert rows[0]["score"] == pytest.approx(float(table.scores.max()))


def test_bad_arguments(scored, tmp_path):
    _, path, pool = scored
    with pytest.raises(ValueError, match="fraction k must be in"):
        select(path, k=1.5, output=str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="count k must be"):
        select(path, k=0, output=str(tmp_path / "x.jsonl"))
    small = tmp_path / "small.jsonl"
    small.write_text(open(pool).readline())
    with pytest.raises(ValueError, match="not found in pool"):
        select(path, k=3, pool=str(small), output=str(tmp_path / "x.jsonl"))
    with pytest.raises(FileNotFoundError, match="score table not found"):
        select(str(tmp_path / "nope.parquet"), output=str(tmp_path / "x.jsonl"))


def test_selected_file_is_read_by_the_data_module(scored, tmp_path):
    sft = pytest.importorskip("iprox_lightning.data.sft")
    _, path, pool = scored
    out = select(path, k=4, pool=pool, output=str(tmp_path / "sel.jsonl"))
    dm = sft.SFTDataModule(pool=pool, validation=None, tokenizer="builtin", selected=out, train_split="selected")
    assert dm.ids("selected") == read_ids(out)
