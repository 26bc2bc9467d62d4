"""``build_store`` and ``query`` as a user runs them: the query of an identity-projection store equals exact TracIn
scoring, ``select`` reads the table (LESS max over subtasks), a killed build resumes exactly once, float16/bfloat16
storage, top-k neighbours, and stores of another model / pool / settings are refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from iprox_lightning.cli import main
from iprox_lightning.io import gradient_store as gs
from iprox_lightning.io.fingerprint import FingerprintMismatch
from iprox_lightning.io.scores import read_settings
from iprox_lightning.scoring import ScoreTable

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(n, prefix, cats):
    return [{"id": f"{prefix}-{j}", "category": cats[j % len(cats)], "instruction": f"Reverse {'ab' * (j % 4 + 1)}",
             "context": "", "response": "ba" * (j % 3 + 1)} for j in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    pool, val, other = d / "pool.jsonl", d / "val.jsonl", d / "other.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in _records(10, "p", ["x", "y"])))
    val.write_text("".join(json.dumps(r) + "\n" for r in _records(6, "v", ["mmlu.a", "mmlu.b", "bbh.c"])))
    other.write_text("".join(json.dumps(r) + "\n" for r in _records(9, "p", ["x", "y"])))
    return d, pool, val, other


def _build(store, pool, *extra):
    main(["build_store", "--model", "builtin", "--output_dir", str(store), "--pool", str(pool), "--max_length", "48",
          "--batch_size", "3", "--write_every_n_batches", "1", "--progress", "false", *extra])


def test_identity_store_query_equals_exact_tracin_and_select_reads_it(files, capsys):
    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.models.loading import load_model
    from iprox_lightning.scoring import tracin_scores

    d, pool, val, _ = files
    store, out = d / "exact", d / "q_exact"
    _build(store, pool, "--k", "100000", "--store_dtype", "float32")
    info = gs.read_info(store)
    assert info["complete"] and info["rows"] == 10 and info["fingerprint"]["pool"]["n"] == 10
    assert all(r["k_out"] == r["out"] and r["k_in"] == r["in"] for r in info["layout"])  # identity projections
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(out), "--neighbours", "2"])
    got = ScoreTable.load(str(out / "scores.parquet"))
    net, _ = load_model("builtin", tokenizer=False)
    dm = SFTDataModule(pool=str(pool), validation=str(val), tokenizer="builtin", max_length=48, batch_size=3)
    exact = tracin_scores(net, dm.dataloader("pool"), dm.validation_dataloader(), progress=False)
    assert got.task_names == exact.task_names == ["bbh.c", "mmlu.a", "mmlu.b"]
    i = [exact.ids.index(x) for x in got.ids]
    np.testing.assert_allclose(got.scores, exact.scores[i], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.task_scores, exact.task_scores[i], rtol=1e-4, atol=1e-5)
    s = read_settings(out)
    assert s["pool"]["records"]["n"] == 10 and s["scorer"]["val_counts"] == [2, 2, 2]
    # select reads it: LESS max over the subtasks of mmlu
    sel = d / "sel.jsonl"
    main(["select", "--scores_path", str(out), "--k", "3", "--rule", "max", "--task", "mmlu", "--pool", str(pool),
          "--output", str(sel), "--quiet", "true"])
    m = np.maximum(got.task_scores[:, 1], got.task_scores[:, 2])
    best = sorted(zip(m, got.ids), key=lambda r: (-r[0], r[1]))[:3]
    assert [json.loads(line)["id"] for line in open(sel)] == [b for _, b in best]
    # neighbours: the stored examples of highest cosine, best first
    rows = [json.loads(line) for line in open(out / "neighbours.jsonl")]
    assert len(rows) == 6 and all(len(r["neighbours"]) == 2 for r in rows)
    assert all(r["neighbours"][0]["cosine"] >= r["neighbours"][1]["cosine"] for r in rows)
    assert "query: 10 stored pool examples scored against 3 validation task(s)" in capsys.readouterr().out
    # another pool, another model: refused
    with pytest.raises(FingerprintMismatch, match="another pool"):
        main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "q2"),
              "--pool", str(files[3])])
    info["fingerprint"]["model"]["weights"] = "0" * 16
    gs.write_info(store, info)
    with pytest.raises(FingerprintMismatch, match="another model"):
        main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "q2")])


def test_killed_build_resumes_exactly_once_and_settings_are_fingerprinted(files):
    d, pool, val, _ = files
    store = d / "proj"
    _build(store, pool, "--k", "4", "--store_dtype", "float16")
    full = {i: v.clone() for s in gs.iter_shards(store) for i, v in zip(s["ids"], s["vectors"])}  # not the mmap
    assert len(full) == 10 and next(iter(full.values())).dtype == torch.float16
    shards = gs.shard_files(store)
    assert len(shards) == 4
    # a killed build: the last shard never written, another one truncated mid-write, store.json not complete
    import os

    os.remove(shards[-1])
    with open(shards[0], "r+b") as f:
        f.truncate(40)
    info = gs.read_info(store)
    gs.write_info(store, {**info, "complete": False})
    with pytest.raises(gs.StoreFormatError, match="has not finished"):
        main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "q_proj")])
    _build(store, pool, "--k", "4", "--store_dtype", "float16")
    again = {}
    for s in gs.iter_shards(store):
        for i, v in zip(s["ids"], s["vectors"]):
            assert i not in again
            again[i] = v
    assert set(again) == set(full)
    for i in full:  # rebuilt in other batches (other padding): equal up to float16 rounding
        scale = float(full[i].float().abs().max())
        torch.testing.assert_close(again[i].float(), full[i].float(), rtol=2e-3, atol=2e-3 * scale)
    info = gs.read_info(store)
    assert info["complete"] and info["rows"] == 10 and len(info["repairs"]) == 1
    assert (store / gs.SHARD_DIR / gs.CORRUPT_DIR).is_dir()
    # a changed setting never reuses the store
    for extra in (["--k", "5"], ["--k", "4", "--store_dtype", "bfloat16"], ["--k", "4", "--seed", "1"]):
        with pytest.raises(FingerprintMismatch, match="different inputs"):
            _build(store, pool, *extra)
    with pytest.raises(FingerprintMismatch, match="different inputs"):
        _build(store, files[3], "--k", "4", "--store_dtype", "float16")
    # bfloat16 storage with overwrite; the query is the same ranking up to storage precision
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "q16")])
    _build(store, pool, "--k", "4", "--store_dtype", "bfloat16", "--overwrite", "true")
    assert next(gs.iter_shards(store))["vectors"].dtype == torch.bfloat16
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "qbf")])
    a, b = ScoreTable.load(str(d / "q16" / "scores.parquet")), ScoreTable.load(str(d / "qbf" / "scores.parquet"))
    np.testing.assert_allclose(a.task_scores, b.task_scores, atol=2e-2)
    assert not list(store.rglob("*.pt")) and not list(store.rglob("*.pkl"))


def test_kfac_store_saves_factors_once_and_queries_with_them(files):
    d, pool, val, _ = files
    store = d / "kfac"
    _build(store, pool, "--k", "4", "--method", "ekfac", "--kfac_examples", "6", "--store_dtype", "float32")
    info = gs.read_info(store)
    assert info["factors"].startswith("ekfac-") and (store / info["factors"]).exists()
    mtime = (store / info["factors"]).stat().st_mtime_ns
    _build(store, pool, "--k", "4", "--method", "ekfac", "--kfac_examples", "6", "--store_dtype", "float32")
    assert (store / info["factors"]).stat().st_mtime_ns == mtime  # resumed: loaded, never re-fitted
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "q_ekfac")])
    t = ScoreTable.load(str(d / "q_ekfac" / "scores.parquet"))
    assert t.settings["scorer"]["method"] == "ekfac" and np.isfinite(t.task_scores).all()
