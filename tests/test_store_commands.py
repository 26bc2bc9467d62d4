"""``build_store`` and ``query`` as a user runs them: the query of an identity-projection store equals exact TracIn
scoring, ``select`` reads the table (LESS max over subtasks), a killed build resumes exactly once, float16/bfloat16
storage, top-k neighbours, stores of another model / pool / settings are refused, a re-query reads the validation
gradients from the store's cache, the store's size is recorded, and a two-process (DDP) build equals a one-process
one."""
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



def _vectors(store) -> dict:
    """``{id: vector}`` of a store's shards, each id once."""
    out = {}
    for s in gs.iter_shards(store):
        for i, v in zip(s["ids"], s["vectors"]):
            assert i not in out
            out[i] = v.clone()
    return out

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
    printed = capsys.readouterr().out
    assert "query: 10 stored pool examples scored against 3 validation task(s)" in printed
    assert f"query: the 2 nearest stored pool examples of each of the 6 validation examples (cosine) -> {out}" in printed
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
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the resumed build's batches stored already: no warning
        warnings.simplefilter("always")
        _build(store, pool, "--k", "4", "--store_dtype", "float16")
    assert not [w for w in caught if "returned None" in str(w.message)], [str(w.message) for w in caught]
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
    # a K-FAC store of an earlier version (vectors in the factors' eigenbases, no "basis" setting) is refused
    assert info["fingerprint"]["settings"]["basis"] == "weight"
    del info["fingerprint"]["settings"]["basis"]
    gs.write_info(store, info)
    with pytest.raises(gs.StoreFormatError, match="built by an earlier version"):
        main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(d / "q_old")])


def test_pca_store_fits_its_moments_once_and_queries_like_its_own_projections(files, monkeypatch):
    """``--projection pca``: the store's projections are the leading eigenvectors of the second moments fitted on
    ``kfac_examples`` pool examples (saved with the store, never re-fitted on resume); the query equals TracIn
    cosines of the vectors those projections give; the option is fingerprinted; K-FAC with it is refused."""
    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.models.loading import load_model
    from iprox_lightning.scoring.features import tracked_modules, virtual_linears
    from iprox_lightning.scoring.metrics import KFACFactors
    from iprox_lightning.scoring.projection import GradientProjector, pca_projections
    from iprox_lightning.scoring.query import query_table, task_sums
    from iprox_lightning.engine.tracking import backward_pairs

    d, pool, val, _ = files
    store, out = d / "pca", d / "q_pca"
    _build(store, pool, "--k", "4", "--projection", "pca", "--kfac_examples", "6", "--store_dtype", "float32")
    info = gs.read_info(store)
    st = info["fingerprint"]["settings"]
    assert (st["projection"], st["kfac_examples"], st["method"]) == ("pca", 6, "tracin")
    # the moments make the saved projections and are not kept (as large as K-FAC factors); a resumed build reads the
    # projections and fits nothing
    assert info["factors"] is None and not list(store.glob("*kfac-*")) and (store / gs.PROJECTION_FILE).exists()
    mtime = (store / gs.PROJECTION_FILE).stat().st_mtime_ns
    from iprox_lightning.scoring import metrics

    def no_fit(*a, **k):
        raise AssertionError("moments fitted again")

    with monkeypatch.context() as m:
        m.setattr(metrics.KFAC, "fit", no_fit)
        _build(store, pool, "--k", "4", "--projection", "pca", "--kfac_examples", "6", "--store_dtype", "float32")
        assert (store / gs.PROJECTION_FILE).stat().st_mtime_ns == mtime
    # with a shared factors_dir the moments are saved there once: another store of them (k = 3) fits nothing
    fdir = d / "shared_moments"
    _build(d / "pca4", pool, "--k", "4", "--projection", "pca", "--kfac_examples", "6", "--store_dtype", "float32",
           "--factors_dir", str(fdir))
    (moments,) = fdir.glob("kfac-*.safetensors")
    with monkeypatch.context() as m:
        m.setattr(metrics.KFAC, "fit", no_fit)
        _build(d / "pca3", pool, "--k", "3", "--projection", "pca", "--kfac_examples", "6", "--store_dtype",
               "float32", "--factors_dir", str(fdir))
    assert [p.name for p in fdir.iterdir()] == [moments.name] and not list((d / "pca3").glob("*kfac-*"))
    # the reference: moments of the first 6 pool examples (the factor loader's order), their top-4 eigenvectors
    net, _ = load_model("builtin", tokenizer=False)
    net.eval()
    dm = SFTDataModule(pool=str(pool), validation=str(val), tokenizer="builtin", max_length=48, batch_size=3)
    modules = tracked_modules(net)
    linears = virtual_linears(modules)
    fac = KFACFactors(modules)
    seen = 0
    for b in dm.dataloader("pool"):
        if seen >= 6:
            break
        backward_pairs(net, b, [fac])
        seen += len(b["id"])
    ref = pca_projections(linears, 4, fac.eigens([v.key for v in linears]))
    saved = gs.load_projections(store)
    for key, p in ref.items():
        for got, want in zip(saved[key], (p.P_out, p.P_in)):
            g, w = got.double(), want.double()
            torch.testing.assert_close(g.t() @ g, w.t() @ w, rtol=0, atol=1e-4)  # the same subspace
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(out)])
    got = ScoreTable.load(str(out / "scores.parquet"))
    proj = GradientProjector(net, projections={k: type(p)(p.key, p.out_features, p.in_features, *saved[k])
                                               for k, p in ref.items()})
    names, S, _ = task_sums(proj.project_batch(b) for b in dm.validation_dataloader())
    shards = [{"ids": r["id"], "tasks": r["task"], "vectors": r["vectors"], "n_tokens": torch.as_tensor(r["n_tokens"]),
               "zero_grad": torch.as_tensor(r["zero_grad"]), "nonfinite": torch.as_tensor(r["nonfinite"])}
              for r in (proj.project_batch(b) for b in dm.dataloader("pool"))]
    want = query_table(shards, names, S)
    assert got.task_names == want.task_names
    i = [want.ids.index(x) for x in got.ids]
    np.testing.assert_allclose(got.task_scores, want.task_scores[i], rtol=1e-4, atol=1e-5)
    with pytest.raises(FingerprintMismatch, match="different inputs"):  # a gaussian build never reuses it
        _build(store, pool, "--k", "4", "--kfac_examples", "6", "--store_dtype", "float32")
    with pytest.raises(Exception, match="use it with method='tracin'"):
        _build(d / "pca_kfac", pool, "--k", "4", "--projection", "pca", "--method", "kfac")
    with pytest.raises(Exception, match="projection must be one of"):
        _build(d / "pca_bad", pool, "--k", "4", "--projection", "sketch")


# ------------------------------------------------------------------------------------------------ the query cache
def _query(store, val, out, *extra):
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(out), *extra])
    return ScoreTable.load(str(out / "scores.parquet")), read_settings(out)["scorer"]


def _assert_same_table(a, b):
    assert a.ids == b.ids and a.task_names == b.task_names
    np.testing.assert_array_equal(a.scores, b.scores)  # bit for bit (NaN where NaN)
    np.testing.assert_array_equal(a.task_scores, b.task_scores)
    np.testing.assert_array_equal(a.zero_grad, b.zero_grad)


def test_requery_reads_the_validation_gradients_from_the_store_cache(files, monkeypatch, capsys):
    """A re-query of the same validation set runs no validation batch (counted at ``project_batch``, where the model
    runs) and gives bit-identical scores and neighbours; a changed validation set, batch size or store never reuses
    them; ``store.json`` records the store's size."""
    from iprox_lightning.scoring.projection import GradientProjector

    d, pool, val, _ = files
    store = d / "cached"
    _build(store, pool, "--k", "4", "--store_dtype", "float32")
    info = gs.read_info(store)
    shard_bytes = sum(f.stat().st_size for f in (store / gs.SHARD_DIR).glob("rank*.safetensors"))
    assert info["bytes"] == shard_bytes and info["bytes_per_example"] == shard_bytes / 10
    assert info["bytes_per_example"] > 4 * info["dim"]  # float32 vectors plus the flags and the shard header
    assert "KiB per example" in capsys.readouterr().out
    calls = []
    real = GradientProjector.project_batch
    monkeypatch.setattr(GradientProjector, "project_batch", lambda self, b: calls.append(len(b["id"])) or real(self, b))

    def run(out, *extra):
        calls.clear()
        table, scorer = _query(store, val, d / out, *extra)
        return table, scorer, sum(calls)

    t1, s1, n1 = run("c1")
    assert n1 == 6 and s1["validation_cache"]["action"] == "computed"
    t2, s2, n2 = run("c2")  # another output dir: reused, the model never runs
    assert n2 == 0 and s2["validation_cache"]["action"] == "reused"
    assert s2["validation_cache"]["fingerprint"] == s1["validation_cache"]["fingerprint"]
    assert s2["val_counts"] == s1["val_counts"] == [2, 2, 2] and s2["task_names"] == s1["task_names"]
    _assert_same_table(t1, t2)
    assert "validation gradients reused from the store's cache" in capsys.readouterr().out
    # neighbours need the per-example vectors, which a sums-only entry does not hold: computed once, then reused
    t3, s3, n3 = run("c3", "--neighbours", "3")
    assert n3 == 6 and s3["validation_cache"]["action"] == "computed"
    t4, s4, n4 = run("c4", "--neighbours", "3")
    assert n4 == 0 and s4["validation_cache"]["action"] == "reused"
    _assert_same_table(t1, t3)
    _assert_same_table(t1, t4)
    assert (d / "c3" / "neighbours.jsonl").read_text() == (d / "c4" / "neighbours.jsonl").read_text()
    assert run("c5")[2] == 0  # the entry with vectors serves a query without neighbours too
    # anything that changes the validation gradients misses the cache
    changed = d / "val_changed.jsonl"
    rows = [json.loads(line) for line in open(val)]
    rows[0]["response"] = "changed"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls.clear()
    _, s6 = _query(store, changed, d / "c6")
    assert sum(calls) == 6 and s6["validation_cache"]["action"] == "computed"
    for out, extra in (("c7", ["--batch_size", "2"]), ("c8", ["--val_per_task", "1"])):
        t, s, n = run(out, *extra)
        assert n > 0 and s["validation_cache"]["action"] == "computed"
    # a store rebuilt with another seed: its cache is gone, and its queries compute afresh
    _build(store, pool, "--k", "4", "--store_dtype", "float32", "--seed", "1", "--overwrite", "true")
    assert not (store / gs.CACHE_DIR).exists()
    t9, s9, n9 = run("c9")
    assert n9 == 6 and s9["validation_cache"]["action"] == "computed"
    assert not np.array_equal(t9.task_scores, t1.task_scores)
    assert not list(store.rglob("*.pt")) and not list(store.rglob("*.pkl"))


# ------------------------------------------------------------------------------------------------ DDP build
@pytest.mark.distributed
def test_two_process_build_equals_the_one_process_build_and_queries_alike(files, tmp_path):
    """``build_store --devices 2 --accelerator cpu`` (Lightning DDP, two gloo processes, each writing its own shards;
    K-FAC factors fitted on all-reduced statistics, saved once): the merged store holds every pool id once, with the
    one-process build's vectors up to float32 rounding, and a query of it gives the one-process store's scores."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    d, _, val, _ = files
    pool = tmp_path / "pool11.jsonl"  # 11 examples: the two processes get 6 and 5
    pool.write_text("".join(json.dumps(r) + "\n" for r in _records(11, "p", ["x", "y"])))
    args = ["--pool", str(pool), "--max_length", "48", "--batch_size", "3", "--write_every_n_batches", "1",
            "--progress", "false", "--k", "4", "--method", "kfac", "--kfac_examples", "7", "--store_dtype", "float32"]
    one, two = tmp_path / "one", tmp_path / "two"
    main(["build_store", "--model", "builtin", "--output_dir", str(one), *args])
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1",
           "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run([sys.executable, "train.py", "build_store", "--model", "builtin", "--output_dir", str(two),
                        "--devices", "2", "--accelerator", "cpu", *args],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("build_store: 11 pool examples") == 1  # rank 0 prints the summary
    a, b = gs.read_info(one), gs.read_info(two)
    assert b["complete"] and b["rows"] == a["rows"] == 11 and b["factors"] == a["factors"]
    assert a["fingerprint"] == b["fingerprint"] and a["layout"] == b["layout"]
    assert {Path(f).name[:7] for f in gs.shard_files(two)} == {"rank000", "rank001"}  # both processes wrote shards
    # Lightning's predict sampler (UnrepeatedDistributedSamplerWrapper) splits 11 examples 6 + 5: no example repeated
    # to even out the ranks, as DistributedSampler's padding would (the raw shards: iter_shards would hide a repeat)
    from safetensors import safe_open

    raw = {"rank000": [], "rank001": []}
    for f in gs.shard_files(two):
        with safe_open(f, "pt") as shard:
            raw[Path(f).name[:7]] += json.loads(shard.metadata()["ids"])
    assert (len(raw["rank000"]), len(raw["rank001"])) == (6, 5)
    assert sorted(raw["rank000"] + raw["rank001"]) == sorted(f"p-{j}" for j in range(11))
    assert b["bytes"] == sum(os.path.getsize(f) for f in gs.shard_files(two))
    va, vb = _vectors(one), _vectors(two)
    assert sorted(va) == sorted(vb) == sorted(f"p-{j}" for j in range(11))
    # the factors' statistics summed in another order, whitened by factors of 11 examples; float32 vectors. Measured:
    # 1.4e-5 of the largest (AVX2 kernels), 1.1e-4 under MKL_CBWR=COMPATIBLE (MKL's SSE2 path, what another x86 CPU's
    # MKL may take; at 72db7bd too): 3e-4
    for i in va:
        torch.testing.assert_close(vb[i], va[i], rtol=0, atol=3e-4 * float(va[i].abs().max()))
    qa, _ = _query(one, val, tmp_path / "qa")
    qb, _ = _query(two, val, tmp_path / "qb")
    assert qa.ids == qb.ids and qa.task_names == qb.task_names
    np.testing.assert_allclose(qb.scores, qa.scores, rtol=0, atol=1e-4)
    np.testing.assert_allclose(qb.task_scores, qa.task_scores, rtol=0, atol=1e-4)


def test_an_unknown_strategy_is_refused_before_the_build(files, tmp_path):
    from iprox_lightning.errors import UserInputError

    _, pool, _, _ = files
    with pytest.raises(UserInputError, match="--strategy must be one of ddp, fsdp, got 'deepspeed'"):
        _build(tmp_path / "s", pool, "--strategy", "deepspeed")
    assert not (tmp_path / "s").exists()


@pytest.mark.distributed
def test_fsdp_build_on_two_processes_equals_the_one_process_build(files, tmp_path):
    """``build_store --strategy fsdp --devices 2 --accelerator cpu`` (``ModelParallelStrategy``: FSDP2 over two gloo
    processes, the model sharded per decoder block as the scorer's): 7 pool examples in batches of 3 split 4 + 3, so
    rank 1 has a batch fewer and makes an idle step (each forward gathers the blocks from both ranks). The store holds
    every id once, with the one-process build's vectors, and queries alike. Resumed after losing rank 1's shard, rank
    0's batches, all stored, are idle steps too (without them the build hangs: measured), and the store is whole
    again. TracIn: K-FAC's whitening by factors of
    a few examples multiplies the vectors' float32 rounding (measured on this pool: 2.9e-5 of the largest with the
    same factors file, 1.7e-4 refitted; the DDP build 9.8e-5), which would hide a wrong vector."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    d, _, val, _ = files
    pool = tmp_path / "pool7.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in _records(7, "p", ["x", "y"])))
    args = ["--pool", str(pool), "--max_length", "48", "--batch_size", "3", "--write_every_n_batches", "1",
            "--progress", "false", "--k", "4", "--store_dtype", "float32"]
    one, two = tmp_path / "one", tmp_path / "two"
    main(["build_store", "--model", "builtin", "--output_dir", str(one), *args])
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1",
           "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    cmd = [sys.executable, "train.py", "build_store", "--model", "builtin", "--output_dir", str(two),
           "--strategy", "fsdp", "--devices", "2", "--accelerator", "cpu", *args]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("build_store: 7 pool examples") == 1
    a, b = gs.read_info(one), gs.read_info(two)
    assert b["complete"] and b["rows"] == a["rows"] == 7
    # the fingerprint holds the whole model's identity (taken before sharding), the same settings and pool
    assert a["fingerprint"] == b["fingerprint"] and a["layout"] == b["layout"]
    assert {Path(f).name[:7] for f in gs.shard_files(two)} == {"rank000", "rank001"}
    va, vb = _vectors(one), _vectors(two)
    assert sorted(va) == sorted(vb) == sorted(f"p-{j}" for j in range(7))
    for i in va:  # float32 products with FSDP2's gathered weights (views of one all-gather buffer) round otherwise:
        # measured 5.1e-7 of the largest (default and ATEN_CPU_CAPABILITY=avx2; the DDP build of the same batches:
        # bit-identical)
        torch.testing.assert_close(vb[i], va[i], rtol=0, atol=2e-6 * float(va[i].abs().max()))

    # a killed build: rank 1's shard (its batch p-1, p-3, p-5) lost; rank 0's two batches are stored already: two idle
    # steps, beside rank 1's batch and its idle step at the end
    from safetensors import safe_open

    (lost,) = [f for f in gs.shard_files(two) if Path(f).name.startswith("rank001")]
    with safe_open(lost, "pt") as shard:
        assert set(json.loads(shard.metadata()["ids"])) == {"p-1", "p-3", "p-5"}
    os.remove(lost)
    gs.write_info(two, {**gs.read_info(two), "complete": False})
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert gs.read_info(two)["complete"] and gs.read_info(two)["rows"] == 7
    vr = {i: v.clone() for s in gs.iter_shards(two) for i, v in zip(s["ids"], s["vectors"])}
    assert sorted(vr) == sorted(va)
    for i in va:
        torch.testing.assert_close(vr[i], va[i], rtol=0, atol=2e-6 * float(va[i].abs().max()))
    qa, _ = _query(one, val, tmp_path / "qa")
    qb, _ = _query(two, val, tmp_path / "qb")  # what ``query`` reads: both ranks' shards, store.json
    assert qa.ids == qb.ids and qa.task_names == qb.task_names
    np.testing.assert_allclose(qb.scores, qa.scores, rtol=0, atol=1e-5)
    np.testing.assert_allclose(qb.task_scores, qa.task_scores, rtol=0, atol=1e-5)


def test_proxy_store_queried_with_the_targets_validation_gradients_equals_exact_scoring(files, tmp_path):
    """``query --validation_model``: an identity-projection store of a proxy, queried with its target's validation
    gradients (projected into the proxy's factor space), equals exact scoring with ``validation_model``; the cache
    key and the settings hold the validation model, so the plain query of the same store is not served from it."""
    from iprox_lightning.compression.apply import compress_model
    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.io.proxy import save_proxy
    from iprox_lightning.engine.lowrank import LowRankLinear
    from iprox_lightning.models.loading import load_model
    from iprox_lightning.scoring import tracin_scores

    d, pool, val, _ = files
    proxy, tok = load_model("builtin")
    dm = SFTDataModule(pool=str(pool), validation=str(val), tokenizer="builtin", max_length=48, batch_size=3)
    compress_model(proxy, None, 0.5, method="svd", progress=False)  # in place: the builtin target, factorised
    assert any(isinstance(m, LowRankLinear) for m in proxy.modules())
    pdir = tmp_path / "proxy"
    save_proxy(proxy, tok, pdir, target_model="builtin")
    store = tmp_path / "store"
    main(["build_store", "--model", str(pdir), "--output_dir", str(store), "--pool", str(pool), "--max_length", "48",
          "--batch_size", "3", "--progress", "false", "--k", "100000", "--store_dtype", "float32"])
    got, scorer = _query(store, val, tmp_path / "q_target", "--validation_model", "builtin")
    assert scorer["validation_model"] == "builtin" and scorer["validation_cache"]["action"] == "computed"
    net, _ = load_model(str(pdir), tokenizer=False)
    exact = tracin_scores(net, dm.dataloader("pool"), dm.validation_dataloader(), progress=False,
                          validation_model=load_model("builtin", tokenizer=False)[0])
    i = [exact.ids.index(x) for x in got.ids]
    np.testing.assert_allclose(got.task_scores, exact.task_scores[i], rtol=1e-4, atol=1e-5)
    own, own_scorer = _query(store, val, tmp_path / "q_own")
    assert own_scorer["validation_model"] == "store" and own_scorer["validation_cache"]["action"] == "computed"
    assert np.abs(own.task_scores - got.task_scores).max() > 1e-3
    _, again = _query(store, val, tmp_path / "q_target2", "--validation_model", "builtin")
    assert again["validation_cache"]["action"] == "reused"


def test_store_reuses_a_scoring_runs_saved_factors_and_keeps_its_own_copy(files, tmp_path, monkeypatch):
    """``build_store --factors_dir D``: EK-FAC factors a ``predict`` scoring run fitted in ``D`` on the same model and
    pool are loaded, not fitted again (the file in ``D`` is untouched and the only one); the store keeps a
    byte-identical copy and is queried from it alone (``D`` deleted); a store of other factor settings fits its own."""
    import yaml

    d, pool, val, _ = files
    fdir = tmp_path / "factors"
    cfg = {"trainer": {"logger": False, "enable_progress_bar": False, "default_root_dir": str(tmp_path), "callbacks": [
        {"class_path": "iprox_lightning.scoring.InfluenceWriter", "init_args": {"output_dir": str(tmp_path / "exact")}}]},
        "model": {"init_args": {"model": "builtin", "method": "ekfac", "kfac_examples": 6, "factors_dir": str(fdir)}},
        "data": {"init_args": {"pool": str(pool), "validation": str(val), "tokenizer": "builtin", "max_length": 48,
                               "batch_size": 3}}}
    (tmp_path / "score.yaml").write_text(yaml.safe_dump(cfg))
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    main(["predict", "--config", str(root / "configs" / "score.yaml"), "--config", str(tmp_path / "score.yaml")])
    (fitted,) = fdir.glob("ekfac-*")  # beside it the K-FAC factors it corrects, for a K-FAC run
    assert [p.name.split("-")[0] for p in sorted(fdir.iterdir())] == ["ekfac", "kfac"]
    shared = sorted(p.name for p in fdir.iterdir())
    mtime, data = fitted.stat().st_mtime_ns, fitted.read_bytes()
    store = tmp_path / "store"
    _build(store, pool, "--k", "4", "--method", "ekfac", "--kfac_examples", "6", "--store_dtype", "float32",
           "--factors_dir", str(fdir))
    assert sorted(p.name for p in fdir.iterdir()) == shared and fitted.stat().st_mtime_ns == mtime
    info = gs.read_info(store)
    assert info["factors"] == fitted.name and (store / fitted.name).read_bytes() == data
    import shutil

    shutil.rmtree(fdir)
    main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(tmp_path / "q")])
    assert np.isfinite(ScoreTable.load(str(tmp_path / "q" / "scores.parquet")).task_scores).all()
    # the store resumed with the shared directory gone: its own copy serves (loaded under the same fingerprint),
    # nothing re-fitted
    own_mtime = (store / fitted.name).stat().st_mtime_ns
    from iprox_lightning.scoring import metrics

    def no_fit(*a, **k):
        raise AssertionError("factors fitted again")

    monkeypatch.setattr(metrics.EKFAC, "fit", no_fit)
    _build(store, pool, "--k", "4", "--method", "ekfac", "--kfac_examples", "6", "--store_dtype", "float32",
           "--factors_dir", str(fdir))
    assert (fdir / fitted.name).read_bytes() == data and (store / fitted.name).stat().st_mtime_ns == own_mtime
    shutil.rmtree(fdir)
    monkeypatch.undo()
    # other factor data (5 examples): fitted anew into the shared directory, not the earlier file
    _build(tmp_path / "store5", pool, "--k", "4", "--method", "ekfac", "--kfac_examples", "5", "--store_dtype",
           "float32", "--factors_dir", str(fdir))
    (other,) = fdir.glob("ekfac-*")
    assert other.name != fitted.name and gs.read_info(tmp_path / "store5")["factors"] == other.name


def test_a_query_refuses_a_store_whose_files_are_not_the_ones_its_build_recorded(files, tmp_path):
    """Issue 57: a shard deleted, another store's shard copied in, a shard or the projections replaced: each was read
    as if whole (a query on 192 of 200 rows; scores from another store's projections). The build records its contents
    (every shard's rows and SHA-256, the projection file's); the query refuses a store that differs, naming the file."""
    import shutil
    from pathlib import Path

    d, pool, val, _ = files
    store, other = tmp_path / "s", tmp_path / "other"
    _build(store, pool, "--k", "8", "--batch_size", "2")
    _build(other, pool, "--k", "8", "--batch_size", "2", "--seed", "1")
    info = gs.read_info(store)
    shards = sorted(Path(f).name for f in gs.shard_files(store))
    assert len(shards) > 1 and sorted(info["contents"]["shards"]) == shards
    assert sum(s["rows"] for s in info["contents"]["shards"].values()) == info["rows"] == 10
    _query(store, val, tmp_path / "ok")  # the store as built: queried

    def refused(match):
        with pytest.raises(gs.StoreFormatError, match=match):
            _query(store, val, tmp_path / "q")
        assert not (tmp_path / "q" / "scores.parquet").exists()

    first = Path(gs.shard_files(store)[0])
    saved = first.read_bytes()
    first.unlink()  # deleted
    refused("missing: " + first.name)
    first.write_bytes(saved)
    foreign = Path(gs.shard_files(other)[0])
    shutil.copy(foreign, store / "shards" / ("rank009-" + foreign.name.split("-", 1)[1]))  # another store's shard
    refused("not from this build: rank009-")
    (store / "shards" / ("rank009-" + foreign.name.split("-", 1)[1])).unlink()
    first.write_bytes(Path(gs.shard_files(other)[0]).read_bytes())  # replaced under its own name
    refused(f"{first.name}: changed since the build")
    first.write_bytes(saved)
    proj = store / gs.PROJECTION_FILE
    kept = proj.read_bytes()
    proj.write_bytes((other / gs.PROJECTION_FILE).read_bytes())  # another store's projections
    refused(f"{gs.PROJECTION_FILE}: not the file the build recorded")
    proj.write_bytes(kept)
    _query(store, val, tmp_path / "ok2")  # restored: queried again
    old = dict(info)
    del old["contents"]
    gs.write_info(store, old)  # a store built before the contents were recorded
    refused("no 'contents' record")


def test_a_query_refuses_an_exact_scoring_directory_unless_overwrite(files, tmp_path):
    """Issue 57: ``query --output_dir`` at an exact-scoring directory replaced its table and settings and left its
    shards beside them."""
    from iprox_lightning.errors import OutputExistsError
    from iprox_lightning.io.ownership import make_owned_dir
    from iprox_lightning.io.score_dir import SHARD_DIR

    d, pool, val, _ = files
    store = tmp_path / "s"
    _build(store, pool, "--k", "8")
    exact = tmp_path / "exact"
    make_owned_dir(exact, "scores")  # as the exact scoring run marks the directory it creates (issue 61)
    (exact / SHARD_DIR).mkdir(parents=True)
    (exact / SHARD_DIR / "rank000-x-00000.parquet").write_bytes(b"old")
    (exact / "settings.json").write_text(json.dumps({"method": "tracin"}))
    with pytest.raises(OutputExistsError, match="holds another run's scores"):
        _query(store, val, exact)
    assert (exact / SHARD_DIR / "rank000-x-00000.parquet").exists()
    table, _ = _query(store, val, exact, "--overwrite", "true")
    assert not (exact / SHARD_DIR).exists() and len(table) == 10
    again, _ = _query(store, val, exact)  # its own query directory: re-written
    assert again.ids == table.ids
