"""bench/effect.py end to end on the built-in data (a tiny fidelity run's tables -> selections -> fine-tunes ->
held-out evaluations -> summary), checked against the product's own select and a brute-force recomputation of
every summary number; a second invocation re-runs nothing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import effect  # noqa: E402
import fidelity_v2 as fv2  # noqa: E402
import ledger  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANT = "ipsvd/exact/rel1e-3/global@0.5"


@pytest.fixture(scope="module")
def fidelity_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("effect") / "v2"
    fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--sample", "30", "--max-length", "48",
              "--no-warmup", "--no-unwarmed", "--variants", VARIANT, "--bootstrap", "20", "--threads", "1",
              "--out", str(out)])
    return out


def test_effect_end_to_end_builtin(fidelity_dir, tmp_path):
    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "uppercase", "--priority-tasks", "addition",
            "--selectors", "target", "iprox@0.5", "length", "store+max", "store:iprox@0.5+max", "--source", f"iprox@0.5={VARIANT}",
            "--random-seeds", "0", "1", "--k", "0.2", "--epochs", "1", "--max-length", "48", "--eval-max-length", "48",
            "--builtin-per-task", "8", "--bootstrap", "200", "--threads", "1"]
    s = effect.main(argv)
    m = s["meta"]
    assert m["k"] == 6 and m["pool_sample"] == 30 and m["rule"] == "mean" and m["target_warmed_up"] is False
    assert {t: h["n"] for t, h in m["heldout"].items()} == {"addition": 8, "uppercase": 8}

    # selections are the product's select on the fidelity run's tables: rule 'mean' over the task's halves
    from iprox_lightning.select import select

    for task in ("addition", "uppercase"):
        for sel, table in (("target", "target"), ("iprox@0.5", fv2.dir_name(VARIANT))):
            ref = select(str(fidelity_dir / "scores" / table / "scores.parquet"), k=6, rule="mean", task=task,
                         pool=str(fidelity_dir / "sample.jsonl"), output=str(tmp_path / "ref.jsonl"), quiet=True,
                         overwrite=True)  # a scratch reference, one table after the other
            got = out / "selections" / f"{fv2.dir_name(f'{task}/{sel}')}.jsonl"
            assert [json.loads(x)["id"] for x in open(got)] == [json.loads(x)["id"] for x in open(ref)]
    # the length sort: the 6 shortest scored responses (ties by id), one subset for both tasks
    t = fv2.read_table(fidelity_dir / "scores" / "target" / "scores.parquet")
    shortest = [i for _, i in sorted(zip(t["n_tokens"], t["id"]))[:6]]
    assert [json.loads(x)["id"] for x in open(out / "selections" / "length.jsonl")] == shortest

    # every row recomputed from the cached per-example evaluations
    evals = {json.loads(p.read_text())["key"]: json.loads(p.read_text()) for p in (out / "evals").glob("*.json")}
    assert set(evals) == {"base", "random:0", "random:1", "length", "addition/target", "uppercase/target",
                          "addition/iprox@0.5", "uppercase/iprox@0.5", "addition/store+max", "uppercase/store+max",
                          "addition/store:iprox@0.5+max", "uppercase/store:iprox@0.5+max"}
    # the store selector: the product's build_store + query, then select with the selector's own rule (max)
    for task in ("addition", "uppercase"):
        ref = select(str(out / "scores" / "store" / "scores.parquet"), k=6, rule="max", task=task,
                     pool=str(fidelity_dir / "sample.jsonl"), output=str(tmp_path / f"ref_store_{task}.jsonl"),
                     quiet=True)
        got = out / "selections" / f"{fv2.dir_name(f'{task}/store+max')}.jsonl"
        assert [json.loads(x)["id"] for x in open(got)] == [json.loads(x)["id"] for x in open(ref)]
    from scipy.stats import spearmanr

    # a proxy's store (store:<selector>): the proxy directory the fidelity run built, its own store and query
    proxy_q = out / "scores" / fv2.dir_name("store:iprox@0.5") / "scores.parquet"
    man = json.loads((out / "stores" / fv2.dir_name("iprox@0.5") / "store.json").read_text())
    assert str(fidelity_dir / "proxies" / fv2.dir_name(VARIANT)) in json.dumps(man)
    for task in ("addition", "uppercase"):
        ref = select(str(proxy_q), k=6, rule="max", task=task, pool=str(fidelity_dir / "sample.jsonl"),
                     output=str(tmp_path / f"ref_pstore_{task}.jsonl"), quiet=True)
        got = out / "selections" / f"{fv2.dir_name(f'{task}/store:iprox@0.5+max')}.jsonl"
        assert [json.loads(x)["id"] for x in open(got)] == [json.loads(x)["id"] for x in open(ref)]
    # its per-task fidelity vs the target's store under max / mean over the task's subtask columns, recomputed
    tq, pq = (fv2.read_table(x) for x in (out / "scores" / "store" / "scores.parquet", proxy_q))
    assert list(tq["id"]) == list(pq["id"])
    pf = m["proxy_store_fidelity"]["iprox@0.5"]
    assert pf["n"] == 30 and pf["pooled"] == pytest.approx(spearmanr(pq["score"], tq["score"])[0], abs=1e-12)
    for task in ("addition", "uppercase"):
        cols = [c for c in tq["tasks"] if c == task or c.startswith(f"{task}.")]
        assert cols and set(cols) <= set(pq["tasks"])
        for rule, agg in (("max", np.max), ("mean", np.mean)):
            a, b = (agg(np.stack([x["tasks"][c] for c in cols]), axis=0) for x in (pq, tq))
            assert pf[task][rule] == pytest.approx(spearmanr(a, b)[0], abs=1e-12)
    assert "store:iprox@0.5" in (out / "summary.md").read_text()

    # the per-layer diagnosis (bench/layer_diagnosis.py) of these stores: validation stores built with the same
    # projections; its suite sums reproduce the store query's pooled score; shares sum to 1 per suite
    import layer_diagnosis

    d = layer_diagnosis.main(["--out", str(tmp_path / "diag"), "--fidelity", str(fidelity_dir), "--effect", str(out),
                              "--proxy", "iprox@0.5", "--no-health", "--threads", "1"])
    assert set(d["attribution"]) == {"addition", "uppercase"}
    for suite, r in d["attribution"].items():
        for table in (r["modules"], r["by_type"], r["by_block"]):
            assert sum(v["share"] for v in table.values()) == pytest.approx(1.0, abs=1e-9)
        assert -1 <= r["proxies"]["iprox@0.5"]["spearman"] <= 1
        assert set(r["proxies"]["iprox@0.5"]["by_type"]) == set(r["by_type"])
    ids, _, X, _ = layer_diagnosis.read_store(out / "stores" / "target")
    _, vt, V, _ = layer_diagnosis.read_store(tmp_path / "diag" / "valstores" / "target")
    s_all = V.sum(0)
    mine = X @ s_all / (np.linalg.norm(X, axis=1) * np.linalg.norm(s_all))
    e = dict(zip(tq["id"], tq["score"]))
    np.testing.assert_allclose(mine, [e[i] for i in ids], atol=2e-3)  # float16 stored validation vectors
    assert (tmp_path / "diag" / "diagnosis.md").read_text().startswith("# Where the per-task ranking lives")
    assert {r["rule"] for r in s["rows"] if r["selector"] == "store+max"} == {"max"}
    assert all(r["scoring_cost_ratio"] > 0 for r in s["rows"] if r["selector"] == "store+max")
    # the store's pooled score against the exact target table's, recomputed
    from scipy.stats import spearmanr

    q = fv2.read_table(out / "scores" / "store" / "scores.parquet")
    e = dict(zip(t["id"], t["score"]))
    assert m["store_vs_exact"]["n"] == 30 and m["store_vs_exact"]["pooled"] == pytest.approx(
        spearmanr(q["score"], [e[i] for i in q["id"]])[0], abs=1e-12)
    rows = {(r["task"], r["selector"], r["metric"]): r for r in s["rows"]}
    for task in ("addition", "uppercase"):
        def per_example(key, metric):
            ex = {e["id"]: e[metric] for e in evals[key]["tasks"][task]["examples"]}
            ids = [json.loads(x)["id"] for x in open(out / "heldout" / f"{task}.jsonl")]
            return np.asarray([float(ex[i]) for i in ids])

        for metric, hib in (("loss", False), ("exact_match", True)):
            rand = (per_example("random:0", metric) + per_example("random:1", metric)) / 2
            for sel, key in (("base", "base"), ("length", "length"), ("target", f"{task}/target"),
                             ("iprox@0.5", f"{task}/iprox@0.5"), ("random:0", "random:0")):
                r, v = rows[(task, sel, metric)], per_example(key, metric)
                assert r["value"] == pytest.approx(v.mean(), abs=1e-12) and r["heldout_n"] == 8
                d = (v - rand) if hib else (rand - v)
                assert r["diff_vs_random"] == pytest.approx(d.mean(), abs=1e-12)
                assert r["ci"][0] <= r["value"] + 1e-12 and r["value"] <= r["ci"][1] + 1e-12
                assert r["higher_is_better"] is hib
            nf = m["noise_floor"][f"{task}/{metric}"]
            seeds = [per_example(f"random:{s}", metric).mean() for s in (0, 1)]
            assert nf["spread"] == pytest.approx(max(seeds) - min(seeds), abs=1e-12)
    # fine-tuning moved the model: every fine-tuned row differs from the base row on the loss
    assert all(rows[(t, s, "loss")]["value"] != rows[(t, "base", "loss")]["value"]
               for t in ("addition", "uppercase") for s in ("target", "length", "random:0"))
    assert rows[("addition", "iprox@0.5", "loss")]["scoring_cost_ratio"] > 0
    assert (out / "summary.md").read_text().startswith("# Downstream effect")

    # resume: the same command runs no stage again and gives the same summary
    before = json.loads((out / "state.json").read_text())["stages"]
    again = effect.main(argv)
    assert json.loads((out / "state.json").read_text())["stages"] == before
    assert again["rows"] == s["rows"]
    assert again["meta"]["not_reported"] == []

    # a summary with other settings never reports the old evaluations under them: with k = 0.4 every fine-tuned
    # row is stale (other selections), only the base row (the warmed target itself) is still this command's
    argv_k = [*argv[: argv.index("--k")], "--k", "0.4", *argv[argv.index("--k") + 2:], "--summary-only"]
    other = effect.main(argv_k)
    assert other["meta"]["k"] == 12 and {r["selector"] for r in other["rows"]} == {"base"}
    assert set(other["meta"]["not_reported"]) == set(evals) - {"base"}


def test_stage_fingerprints_ignore_outcome_neutral_config_lines(tmp_path):
    """Turning off Lightning's .ckpt (or progress bars) in a stage config leaves finished benchmark stages valid;
    any other edit of the config changes the fingerprint."""
    base = "trainer:\n  max_epochs: 4\n  log_every_n_steps: 10\n"
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text(base)
    b.write_text(base.replace("  log_every", "  enable_checkpointing: false  # the saved model is the artifact\n"
                              "  enable_progress_bar: false\n  log_every"))
    c.write_text(base.replace("max_epochs: 4", "max_epochs: 5"))
    assert ledger.config_text(b) == ledger.config_text(a) == base
    assert ledger.config_text(c) != ledger.config_text(a)


def test_a_remade_output_keeps_the_recorded_fingerprint(tmp_path):
    """A stage re-run only because its output is gone (a proxy whose weights were not kept), with settings equal up
    to outcome-neutral lines, keeps the recorded fingerprint text that downstream stages embed (else re-making the
    proxy re-ran its scoring); a real change records the new text."""
    import shutil

    st = ledger.Stages(tmp_path, 1, lambda msg: None)
    out = tmp_path / "r" / "scores.parquet"
    ov = {"output": str(out), "pool": "builtin", "seed": 0}
    old = {"seed": 0, "config": "trainer:\n  max_epochs: 4\n"}
    st.run("random", "random_scores", [], ov, old, out, clean=out.parent)
    recorded = st.state["stages"]["random"]["fingerprint"]
    assert recorded == json.dumps(old, sort_keys=True)
    shutil.rmtree(out.parent)
    neutral = {"seed": 0, "config": "trainer:\n  max_epochs: 4\n  log_every_n_steps: 5  # presentation only\n"}
    st.run("random", "random_scores", [], ov, neutral, out, clean=out.parent)
    assert out.exists() and st.state["stages"]["random"]["fingerprint"] == recorded
    assert st.ran == ["random", "random"]
    changed = {"seed": 0, "config": "trainer:\n  max_epochs: 5\n"}
    st.run("random", "random_scores", [], ov, changed, out, clean=out.parent)
    assert st.state["stages"]["random"]["fingerprint"] == json.dumps(changed, sort_keys=True)
