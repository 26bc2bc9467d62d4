"""Issue 23: the stratified pool sample (``data.splits.stratified_sample``, ``train.py sample_pool``), the validation
subtask columns (``SFTDataModule(validation_subtasks=True)``) and the held-out draw of the fine-tuned effect
(``heldout_records(per_task=...)``)."""
from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

from iprox_lightning.cli import main
from iprox_lightning.data.splits import stratified_sample
from iprox_lightning.data.sources import DataFormatError

ROOT = Path(__file__).resolve().parents[1]


def synthetic_records() -> list[dict]:
    recs = [{"id": f"r{i:03d}", "source": s} for i, s in enumerate(["a"] * 23 + ["b"] * 11 + ["c"] * 5 + ["d"])]
    random.Random(1).shuffle(recs)
    return recs


def test_stratified_sample_is_the_benchmarks_algorithm():
    """Frozen outputs of ``bench/fidelity_v2.py``'s own ``stratified_sample`` before it moved into the library (its
    recorded samples depend on them): largest-remainder shares a 7, b 4, c 2, d 0 of 13, strata in sorted order,
    each drawn by one seeded permutation in input order; records without the field form stratum "None"."""
    recs = synthetic_records()
    assert [r["id"] for r in stratified_sample(recs, 13, seed=7)] == [
        "r000", "r009", "r006", "r005", "r012", "r019", "r018", "r023", "r026", "r028", "r033", "r035", "r037"]
    assert [r["id"] for r in stratified_sample(recs, 13, seed=7, by="missing")] == [
        "r037", "r023", "r003", "r039", "r025", "r034", "r038", "r030", "r035", "r029", "r027", "r026", "r015"]
    with pytest.raises(ValueError, match="sample of 41 asked from 40 records"):
        stratified_sample(recs, 41, seed=0)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import fidelity_v2
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert fidelity_v2.stratified_sample is stratified_sample  # the benchmark draws with the library's function


def test_stratified_sample_reproduces_the_recorded_benchmark_sample(shared_dir):
    """The 512 examples ``bench/fidelity_v2.py`` scored (its recorded score tables) are what the library draws from
    the same candidates (the pool minus the warm-up and construction splits, seed 0)."""
    import pyarrow.parquet as pq

    from iprox_lightning.data import SFTDataModule

    pool = shared_dir / "data" / "pool" / "instructions.jsonl"
    if not pool.exists():
        pytest.skip("../shared/data/pool not present")
    dm = SFTDataModule(pool=str(pool), validation=None, tokenizer="builtin", seed=0)
    used = set(dm.splits.warmup) | set(dm.splits.probe) | set(dm.splits.align)
    sample = stratified_sample([r for r in dm.pool_records if r["id"] not in used], 512, 0, by="source")
    recorded = pq.read_table(ROOT / "bench/results/fidelity_v2/scores/ipsvd_exact_rel1e-3-at-0.5/scores.parquet")
    assert sorted(r["id"] for r in sample) == sorted(recorded.column("id").to_pylist())


def write_pool(path: Path, n_per_source: dict[str, int]) -> list[dict]:
    rows, k = [], 0
    for source, n in n_per_source.items():
        for _ in range(n):
            rows.append({"source": source, "instruction": f"question {k}?", "response": f"answer {k}", "extra": k})
            k += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_sample_pool_command(tmp_path, capsys):
    pool = tmp_path / "my_pool.jsonl"
    write_pool(pool, {"x": 60, "y": 30, "z": 10})
    out = tmp_path / "sample.jsonl"
    main(["sample_pool", "--pool", str(pool), "--n", "20", "--by", "source", "--seed", "3", "--output", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert Counter(r["source"] for r in rows) == {"x": 12, "y": 6, "z": 2}  # shares of 20 from (60, 30, 10)
    # every field kept; ids and categories as the pool reader names them (<file stem>-<row>, the file stem)
    assert all(r["id"] == f"my_pool-{r['extra']:06d}" and r["category"] == "my_pool" for r in rows)
    assert "sample_pool: 20 of 100 records" in capsys.readouterr().out
    from iprox_lightning.data.pool import read_pool

    by_id = {r["id"]: r for r in read_pool(str(pool))}
    assert all(by_id[r["id"]] == rec for r, rec in zip(rows, read_pool(str(out))))  # the pool's records, unchanged

    main(["sample_pool", "--pool", str(pool), "--n", "20", "--seed", "3", "--output", str(out)])  # the same sample
    assert "(already there, unchanged)" in capsys.readouterr().out
    with pytest.raises(FileExistsError, match="--overwrite true"):  # another sample is not written over it
        main(["sample_pool", "--pool", str(pool), "--n", "21", "--seed", "3", "--output", str(out)])
    main(["sample_pool", "--pool", str(pool), "--n", "21", "--seed", "3", "--output", str(out), "--overwrite", "true"])
    assert len(out.read_text().splitlines()) == 21


def test_sample_pool_errors_name_the_file_and_field(tmp_path):
    from iprox_lightning.commands.sample_pool import sample_pool

    pool = tmp_path / "pool.jsonl"
    write_pool(pool, {"x": 3})
    with pytest.raises(ValueError, match=f"--n 4 is more than the 3 records of {pool}"):
        sample_pool(str(pool), 4, str(tmp_path / "s.jsonl"))
    with pytest.raises(DataFormatError, match=rf"{pool}, line 1: no field 'origin' to stratify by \(--by origin\)"):
        sample_pool(str(pool), 2, str(tmp_path / "s.jsonl"), by="origin")
    with pytest.raises(ValueError, match="would replace the pool"):
        sample_pool(str(pool), 2, str(pool))
    with pytest.raises(ValueError, match="name a .jsonl file"):
        sample_pool(str(pool), 2, str(tmp_path / "s.json"))
    with pytest.raises(ValueError, match="--n must be >= 1"):
        sample_pool(str(pool), 0, str(tmp_path / "s.jsonl"))
    assert not (tmp_path / "s.jsonl").exists()


def test_validation_subtasks_name_one_column_per_subtask(eval_dir):
    from iprox_lightning.data import SFTDataModule

    dm = SFTDataModule(pool="builtin", validation=f"eval:{eval_dir}", val_per_task=4, builtin_size=60,
                       validation_subtasks=True)
    plain = SFTDataModule(pool="builtin", validation=f"eval:{eval_dir}", val_per_task=4, builtin_size=60)
    # the same sample (val_per_task counts per suite), each record named <suite>.<subtask>
    assert [r["id"] for r in dm.validation_records] == [r["id"] for r in plain.validation_records]
    assert [r["category"] for r in dm.validation_records] == [f"{r['category']}.{r['subtask']}"
                                                             for r in plain.validation_records]
    assert Counter(t.split(".")[0] for t in (r["category"] for r in dm.validation_records)) == {
        "mmlu": 4, "bbh": 4, "tydiqa": 4}
    with pytest.raises(ValueError, match="no validation record of \\['builtin'\\] names a subtask"):
        SFTDataModule(pool="builtin", validation="builtin", validation_subtasks=True).validation_records


def test_heldout_records_prefer_what_did_not_steer_the_selection():
    from iprox_lightning.evaluation.heldout import heldout_records

    recs = [{"id": f"{t}{i}", "category": t} for t, n in (("a", 5), ("b", 2)) for i in range(n)]
    steered = {"a0", "a1", "b0"}
    out, desc = heldout_records("pool.jsonl", "val.jsonl", validation_records=recs, per_task=3, steered=steered)
    ids = [r["id"] for r in out]
    assert sorted(i for i in ids if i.startswith("a")) == ["a2", "a3", "a4"]  # the 3 fresh ones
    assert sorted(i for i in ids if i.startswith("b")) == ["b0", "b1"]  # b1 fresh, topped up with b0
    assert desc == "5 validation examples, at most 3 per task (1 of them also steered the selection: partly in-sample)"
    _, desc = heldout_records("p", "v", validation_records=recs, per_task=1, steered=steered)
    assert desc.endswith("(none of them among those that steered the selection)")
    _, desc = heldout_records("p", "v", validation_records=recs, per_task=1)  # no sample: every example steered
    assert desc.endswith("(they also steered the selection: an in-sample check)")
    assert heldout_records("p", "v", validation_records=recs)[0] == recs  # without per_task: all of them, as before
