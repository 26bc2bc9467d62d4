"""Issue 14: select reads every pool format, writes full records by default, and explains the selection."""
from __future__ import annotations

import json

import pytest

from iprox_lightning.io.scores import write_scores
from iprox_lightning.data import SFTDataModule
from iprox_lightning.data.pool import read_pool
from iprox_lightning.data.synthetic import generate_builtin_dataset
from iprox_lightning.selection.select import select
from iprox_lightning.selection.summary import explain_selection, format_selection


def _pool():
    cats = ["a", "a", "a", "b", "b", "c"]
    return [{"id": f"x{i}", "category": c, "instruction": f"do {i}", "response": "r" * (i + 1)} for i, c in enumerate(cats)]


def test_explain_selection_numbers():
    pool = _pool()
    rows = {r["id"]: {"score": 10 - i, "score/ta": float(i), "score/tb": float(-i), "n_tokens": i + 1}
            for i, r in enumerate(pool)}
    e = explain_selection(["x0", "x1", "x3"], read_pool(pool), rows, n_examples=1)
    share = {s["category"]: s for s in e["share_by_category"]}
    assert share["a"]["selected"] == 2 and share["a"]["selected_share"] == pytest.approx(2 / 3)
    assert share["a"]["pool_share"] == pytest.approx(0.5) and share["a"]["ratio"] == pytest.approx(4 / 3)
    assert share["c"]["selected"] == 0 and share["c"]["ratio"] == 0
    # top 3 by task ta = x5, x4, x3 (c, b, b); by tb = x0, x1, x2 (all a)
    assert e["per_task"]["ta"] == pytest.approx({"b": 2 / 3, "c": 1 / 3})
    assert e["per_task"]["tb"] == {"a": 1.0}
    assert e["length"]["unit"] == "response tokens"
    assert e["length"]["selected"]["median"] == 2 and e["length"]["pool"]["mean"] == pytest.approx(3.5)
    assert e["top"][0]["id"] == "x0" and e["top"][0]["response"] == "r" and e["top"][0]["task_scores"] == {"ta": 0.0, "tb": -0.0}
    assert e["bottom"][0]["id"] == "x3" and e["bottom"][0]["score"] == 7
    text = format_selection(e)
    assert "a" in text and "66.7%" in text and "50.0%" in text and "'do 0' " not in text and "x3 (b; score +7.000" in text


@pytest.mark.parametrize("kind", ["list", "dataset", "jsonl", "builtin"])
def test_select_reads_every_pool_format_and_prints(kind, tmp_path, capsys):
    records = generate_builtin_dataset(60, seed=0) if kind == "builtin" else _pool()
    if kind == "builtin":
        pool, default_builtin = None, True  # built-in ids: the pool defaults to builtin
    elif kind == "list":
        pool, default_builtin = records, False
    elif kind == "dataset":
        import datasets

        pool, default_builtin = datasets.Dataset.from_list(records), False
    else:
        pool, default_builtin = str(tmp_path / "pool.jsonl"), False
        (tmp_path / "pool.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    scores = {r["id"]: float(j) for j, r in enumerate(records)}
    if kind == "builtin":  # the built-in pool has 2000 examples; score only ids of the first 60
        scores = {r["id"]: float(j) for j, r in enumerate(generate_builtin_dataset(2000, seed=0)[:60])}
    path = write_scores(scores, tmp_path / "s.parquet")
    out = select(str(path), k=2, pool=pool, output=str(tmp_path / "sel.jsonl"))
    recs = [json.loads(l) for l in open(out)]
    best = sorted(scores, key=lambda i: -scores[i])[:2]
    assert [r["id"] for r in recs] == best and all(r["instruction"] and r["response"] for r in recs)
    printed = capsys.readouterr().out
    assert f"select: wrote 2 of {len(scores)} ranked examples" in printed and "records (Dolly schema" in printed
    assert "pool share" in printed and best[0] in printed
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["explanation"]["count"] == 2 and meta["pool"] and (default_builtin == (meta["pool"] == ["builtin"]))


def test_select_without_pool_says_so(tmp_path, capsys):
    path = write_scores({"u1": 1.0, "u2": 2.0}, tmp_path / "s.parquet")
    out = select(str(path), k=1, output=str(tmp_path / "sel.jsonl"))
    assert [json.loads(l) for l in open(out)] == [{"id": "u2", "score": 2.0}]
    assert "no pool given: pass --pool" in capsys.readouterr().out


def test_data_module_accepts_in_memory_pool():
    import datasets

    recs = generate_builtin_dataset(40, seed=1)
    for pool in (recs, datasets.Dataset.from_list(recs)):
        dm = SFTDataModule(pool=pool, validation="builtin", tokenizer="builtin", warmup_fraction=0.25)
        dm.setup("fit")
        assert dm.ids("pool") == [r["id"] for r in recs]
        assert len(dm.records("warmup")) == 10
    with pytest.raises(ValueError, match=r"pool\[1\]: missing field 'response'"):
        SFTDataModule(pool=[recs[0], {"instruction": "x"}], tokenizer="builtin").pool_records


def test_a_selection_by_a_task_rule_prints_the_key_it_ranks_by(tmp_path, capsys):
    """Issue 55: a store selection (rule max over task columns) printed each example's pooled ``score``, which is not
    what it was ranked by; now the rule's value comes first, labelled."""
    records = _pool()
    # pooled score says x0 is best; the task column ta ranks x5 first
    table = {"id": [r["id"] for r in records], "score": [10.0 - i for i in range(6)],
             "score/ta": [float(i) for i in range(6)], "score/ta.part": [float(i) / 2 for i in range(6)]}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table), tmp_path / "s.parquet")
    out = select(str(tmp_path / "s.parquet"), k=2, pool=records, rule="max", task="ta",
                 output=str(tmp_path / "sel.jsonl"))
    text = capsys.readouterr().out
    assert [json.loads(l)["id"] for l in open(out)] == ["x5", "x4"]
    assert "x5 (c; ranked by max value +5.000, pooled score +5.000" in text, text
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["explanation"]["top"][0]["ranked_by"] == "max value" and meta["explanation"]["top"][0]["rank_value"] == 5
