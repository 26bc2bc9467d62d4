"""bench/store.py on the built-in model: exact scoring, store builds and queries through the product's commands,
results JSON with the measured fields, resumed without re-running a stage."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ledger  # noqa: E402
import store as bench_store  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_store_bench_runs_and_resumes(tmp_path, monkeypatch):
    recs = lambda n, p, cats: [{"id": f"{p}-{j}", "category": cats[j % len(cats)],  # noqa: E731
                                "instruction": f"Reverse {'ab' * (j % 4 + 1)}", "context": "",
                                "response": "ba" * (j % 3 + 1)} for j in range(n)]
    pool, val = tmp_path / "pool.jsonl", tmp_path / "val.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in recs(12, "p", ["x"])))
    val.write_text("".join(json.dumps(r) + "\n" for r in recs(4, "v", ["mmlu.a", "bbh.b"])))
    args = ["--model", "builtin", "--pool", str(pool), "--validation", str(val), "--out", str(tmp_path / "out"),
            "--k", "100000", "--methods", "tracin", "--store-dtype", "float32", "--max-length", "48", "--in-process",
            "--new-task", "bbh"]
    res = bench_store.main([*args, "--projections", "gaussian", "pca"])
    row, pca = res["rows"]
    # pca at a k covering every dimension: identity projections, the exact scores again
    assert (row["projection"], pca["projection"]) == ("gaussian", "pca")
    assert pca["spearman"]["score"] == pytest.approx(1.0) and pca["spearman_min_task"] == pytest.approx(1.0)
    assert (tmp_path / "out" / "stores" / "target-tracin-pca-k100000" / "store.json").exists()
    assert row["spearman"]["score"] == pytest.approx(1.0) and row["spearman_min_task"] == pytest.approx(1.0)
    assert set(row["spearman"]) == {"score", "score/bbh.b", "score/mmlu.a"}
    assert row["bytes_per_example"] > 0 and row["exact_s"] > 0 and row["query_share"] > 0
    assert row["requery_share"] == pytest.approx(row["requery_s"] / row["exact_s"])
    # the new task: its validation records alone, exact scoring vs a cold query of the store (exact store: equal)
    nt = row["new_task"]
    assert nt["task"] == "bbh" and nt["n_validation"] == 2 and nt["query_share"] == nt["query_s"] / nt["exact_s"]
    assert set(nt["spearman"]) == {"score", "score/bbh.b"} and nt["spearman"]["score"] == pytest.approx(1.0)
    assert [json.loads(line)["category"] for line in open(tmp_path / "out" / "validation-bbh.jsonl")] == ["bbh.b"] * 2
    with pytest.raises(SystemExit, match="--new-task tydiqa: no validation record"):
        bench_store.main([*args[:-1], "tydiqa"])
    assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"][0]["k"] == 100000
    calls = []
    monkeypatch.setattr(ledger.Stages, "_execute", lambda self, key, *a: calls.append(key) or ("", 1.0, 1.0, 1.0))
    again = bench_store.main([*args, "--projections", "gaussian", "pca"])
    assert calls == [] and again["rows"][0]["build_s"] == row["build_s"]  # every stage reused
    state = json.loads((tmp_path / "out" / "state.json").read_text())["stages"]
    assert {"exact/target-tracin", "build/target-tracin-k100000", "query/target-tracin-k100000",
            "requery/target-tracin-k100000", "query/target-tracin-k100000-bbh"} <= set(state)
    assert row["build_s"] == state["build/target-tracin-k100000"]["wall_s"]  # the seconds the ledger recorded
    assert [r["projection"] for r in again["rows"]] == ["gaussian", "pca"]
    # an invocation measuring one of the rows keeps the other in results.json and summary.md
    one = bench_store.main([*args, "--projections", "pca"])
    assert calls == [] and [r["projection"] for r in one["rows"]] == ["gaussian", "pca"]
    assert "| pca |" in (tmp_path / "out" / "summary.md").read_text()


def test_store_bench_exact_only_compares_proxy_and_target_per_method(tmp_path, monkeypatch):
    """``--exact-only --proxy``: the exact scorings of both per method and their Spearman per column (the same model
    twice here: 1.0 for every method); TracIn's stage ignores a changed ``--kfac-examples``, K-FAC's re-runs."""
    pool, val = tmp_path / "pool.jsonl", tmp_path / "val.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{j}", "instruction": f"Say {'ab' * (j % 4 + 1)}", "context": "",
                                        "response": "b" * (j % 3 + 1)}) + "\n" for j in range(8)))
    val.write_text("".join(json.dumps({"id": f"v{j}", "category": ["mmlu.a", "bbh.b"][j % 2], "instruction": "Say a",
                                       "context": "", "response": "a" * (j + 1)}) + "\n" for j in range(4)))
    args = ["--model", "builtin", "--proxy", "builtin", "--pool", str(pool), "--validation", str(val), "--out",
            str(tmp_path / "out"), "--methods", "tracin", "kfac", "--max-length", "32", "--in-process", "--exact-only"]
    res = bench_store.main([*args, "--kfac-examples", "4"])
    assert res["rows"] == [] and not (tmp_path / "out" / "stores").exists()
    assert set(res["exact"]) == {"target-tracin", "target-kfac", "proxy-tracin", "proxy-kfac"}
    assert set(res["proxy_vs_target"]) == {"tracin-exact", "kfac-exact"}
    for v in res["proxy_vs_target"].values():
        assert set(v) == {"score", "score/bbh.b", "score/mmlu.a"} and all(x == pytest.approx(1.0) for x in v.values())
    assert "| kfac | exact | 1.000 |" in (tmp_path / "out" / "summary.md").read_text()
    calls = []
    real = ledger.Stages._execute
    monkeypatch.setattr(ledger.Stages, "_execute", lambda self, key, *a: calls.append(key) or real(self, key, *a))
    bench_store.main([*args, "--kfac-examples", "3"])
    assert calls == ["exact/target-kfac", "exact/proxy-kfac"]


def test_store_bench_rebuilds_a_store_of_earlier_settings_and_queries_it_again(tmp_path, monkeypatch):
    """A store the benchmark recorded under other settings is built again from scratch (the old one set aside by the
    ledger: the build would otherwise refuse its fingerprint, or find it complete), and its queries, recorded under
    the same other settings, are made again; a stage of the current settings is reused."""
    pool, val = tmp_path / "pool.jsonl", tmp_path / "val.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{j}", "instruction": f"Say {'ab' * (j % 4 + 1)}", "context": "",
                                        "response": "b" * (j % 3 + 1)}) + "\n" for j in range(10)))
    val.write_text("".join(json.dumps({"id": f"v{j}", "category": ["mmlu.a", "bbh.b"][j % 2], "instruction": "Say a",
                                       "context": "", "response": "a" * (j + 1)}) + "\n" for j in range(4)))
    out = tmp_path / "out"
    args = ["--model", "builtin", "--pool", str(pool), "--validation", str(val), "--out", str(out), "--methods",
            "tracin", "--k", "2", "--store-dtype", "float32", "--max-length", "32", "--in-process"]
    row = bench_store.main(args)["rows"][0]
    state = json.loads((out / "state.json").read_text())
    for key in ("build/target-tracin-k2", "query/target-tracin-k2", "requery/target-tracin-k2"):
        rec = state["stages"][key]  # recorded under a setting since dropped
        rec["fingerprint"] = json.dumps({**json.loads(rec["fingerprint"]), "norms": "exact"}, sort_keys=True)
    (out / "state.json").write_text(json.dumps(state))
    calls = []
    real = ledger.Stages._execute
    monkeypatch.setattr(ledger.Stages, "_execute", lambda self, key, *a: calls.append(key) or real(self, key, *a))
    again = bench_store.main(args)["rows"][0]
    assert calls == ["build/target-tracin-k2", "query/target-tracin-k2", "requery/target-tracin-k2"]
    assert again["spearman"] == pytest.approx(row["spearman"])  # the same store again
    assert not (out / "stores" / "target-tracin-k2.replaced").exists()  # the old store set aside, then removed
