"""bench/effect.py end to end on the built-in data (a tiny fidelity run's tables -> selections -> fine-tunes ->
held-out evaluations -> summary), checked against the product's own select and a brute-force recomputation of
every summary number; a second invocation re-runs nothing."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from lightning.pytorch.callbacks import Callback
from reference_rules import balanced_brute

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
              "--out", str(out), "--in-process"])
    return out


def test_effect_end_to_end_builtin(fidelity_dir, tmp_path):
    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "uppercase", "--priority-tasks", "addition",
            "--selectors", "target", "iprox@0.5", "length", "store+max", "store:iprox@0.5+max", "--source", f"iprox@0.5={VARIANT}",
            "--random-seeds", "0", "1", "--k", "0.2", "--epochs", "1", "--max-length", "48", "--eval-max-length", "48",
            "--builtin-per-task", "8", "--bootstrap", "200", "--threads", "1", "--in-process"]
    s = effect.main(argv)
    m = s["meta"]
    assert m["k"] == 6 and m["pool_sample"] == 30 and m["rule"] == "mean" and m["target_warmed_up"] is False
    assert {t: h["n"] for t, h in m["heldout"].items()} == {"addition": 8, "uppercase": 8}

    # selections are the product's select on the fidelity run's tables: rule 'mean' over the task's halves
    from iprox_lightning.selection.select import select

    for task in ("addition", "uppercase"):
        for sel, table in (("target", "target"), ("iprox@0.5", fv2.dir_name(VARIANT))):
            ref = select(str(fidelity_dir / "scores" / table / "scores.parquet"), k=6, rule="mean", task=task,
                         pool=str(fidelity_dir / "sample.jsonl"), output=str(tmp_path / "ref.jsonl"), quiet=True,
                         overwrite=True)  # a scratch reference, one table after the other
            got = out / "selections" / f"{fv2.dir_name(f'{task}/{sel}')}.jsonl"
            assert [json.loads(x)["id"] for x in open(got)] == [json.loads(x)["id"] for x in open(ref)]
    # the length sort: the 6 shortest scored responses (ties by id), one subset for both tasks
    t = fv2.score_arrays(fidelity_dir / "scores" / "target" / "scores.parquet")
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
    tq, pq = (fv2.score_arrays(x) for x in (out / "scores" / "store" / "scores.parquet", proxy_q))
    assert list(tq["id"]) == list(pq["id"])
    pf = m["proxy_store_fidelity"]["iprox@0.5"]
    assert pf["n"] == 30 and pf["pooled"] == pytest.approx(spearmanr(pq["score"], tq["score"])[0], abs=1e-12)
    for task in ("addition", "uppercase"):
        cols = [c for c in tq["tasks"] if c == task or c.startswith(f"{task}.")]
        assert cols and set(cols) <= set(pq["tasks"])
        for rule, agg in (("max", np.max), ("mean", np.mean)):
            a, b = (agg(np.stack([x["tasks"][c] for c in cols]), axis=0) for x in (pq, tq))
            assert pf[task][rule] == pytest.approx(spearmanr(a, b)[0], abs=1e-12)

        def balanced_top(x, k):  # the task-balanced rule's first k, brute force
            return {x["id"][j] for j in balanced_brute(x["id"], [x["tasks"][c] for c in cols], k)[0]}

        assert pf["k"] == 6 and pf[task]["balanced_overlap"] == len(balanced_top(pq, 6) & balanced_top(tq, 6)) / 6
    assert "store:iprox@0.5" in (out / "summary.md").read_text()
    # the proxy's store against the proxy's own exact table (the fidelity run's), recomputed
    pe = fv2.score_arrays(fidelity_dir / "scores" / fv2.dir_name(VARIANT) / "scores.parquet")
    pe_score = dict(zip(pe["id"], pe["score"]))
    pv = m["proxy_stores_vs_exact"]["iprox@0.5"]
    assert pv["n"] == 30 and pv["pooled"] == pytest.approx(
        spearmanr(pq["score"], [pe_score[i] for i in pq["id"]])[0], abs=1e-12)

    # the per-layer diagnosis (bench/layer_diagnosis.py) of these stores: validation stores built with the same
    # projections; its suite sums reproduce the store query's pooled score; shares sum to 1 per suite
    import layer_diagnosis

    d = layer_diagnosis.main(["--out", str(tmp_path / "diag"), "--fidelity", str(fidelity_dir), "--effect", str(out),
                              "--proxy", "iprox@0.5", "--no-health", "--threads", "1", "--in-process"])
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

    q = fv2.score_arrays(out / "scores" / "store" / "scores.parquet")
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
    assert again["meta"]["not_reported"] == [] and again["meta"]["not_listed"] == []
    # a summary rewrite runs no stage, even with the gradient stores deleted since (their records stand for them)
    import shutil

    shutil.rmtree(out / "stores")
    rewrite = effect.main([*argv, "--summary-only"])
    assert json.loads((out / "state.json").read_text())["stages"] == before and not (out / "stores").exists()
    assert rewrite["rows"] == s["rows"]
    # a command naming fewer selectors reports only those; the others' evaluations are left out as not named by it
    # (meta.not_listed), not as made with other settings (meta.not_reported)
    sel_at = argv.index("--selectors")
    few = effect.main([*argv[:sel_at], "--selectors", "length", *argv[sel_at + 6:], "--summary-only"])
    assert {r["selector"] for r in few["rows"]} == {"base", "length", "random:0", "random:1"}
    assert few["meta"]["not_reported"] == []
    assert set(few["meta"]["not_listed"]) == {f"{t}/{sel}" for t in ("addition", "uppercase")
                                              for sel in ("target", "iprox@0.5", "store+max", "store:iprox@0.5+max")}

    # the length-matched control (lenmatch:<seed>): per task, the product's length_matched_subset of the target's
    # selection over the target table's response tokens, fine-tuned like every row; the summary compares the target's
    # row with it (paired) and correlates every row's selected length with its held-out value
    from iprox_lightning.baselines.random_selection import length_matched_subset

    argv_lm = [*argv[: argv.index("--selectors")], "--selectors", "target", "lenmatch:0", *argv[argv.index("--source"):]]
    lm = effect.main(argv_lm)
    ntok = dict(zip(t["id"], t["n_tokens"]))
    category = {r["id"]: r["category"] for r in map(json.loads, open(fidelity_dir / "sample.jsonl"))}
    evals = {json.loads(p.read_text())["key"]: json.loads(p.read_text()) for p in (out / "evals").glob("*.json")}
    lrows = {(r["task"], r["selector"], r["metric"]): r for r in lm["rows"]}
    for task in ("addition", "uppercase"):
        ref = [json.loads(x)["id"] for x in open(out / "selections" / f"{fv2.dir_name(f'{task}/target')}.jsonl")]
        got = [json.loads(x)["id"] for x in open(out / "selections" / f"{fv2.dir_name(f'{task}/lenmatch:0')}.jsonl")]
        assert got == length_matched_subset(ref, ntok, 0)
        assert sorted(ntok[i] for i in got) == sorted(ntok[i] for i in ref)
        for metric, hib in (("loss", False), ("exact_match", True)):
            v, c = per_example(f"{task}/target", metric), per_example(f"{task}/lenmatch:0", metric)
            rec = lm["meta"]["length_matched"][f"{task}/{metric}"]["target"]
            assert rec["seeds"] == 1 and rec["diff"] == pytest.approx(((v - c) if hib else (c - v)).mean(), abs=1e-12)
            assert lrows[(task, "lenmatch:0", metric)]["scoring_cost_ratio"] is None
            assert lrows[(task, "target", metric)]["selected_response_tokens"] == pytest.approx(
                np.mean([ntok[i] for i in ref]), abs=1e-12)
            # the share of each subset from the held-out examples' own pool family (the demo's held-out examples are
            # fresh examples of the task's family), recomputed from the selections and the sample's categories
            assert lm["meta"]["heldout_origins"][task] == [task]
            for sel in ("target", "lenmatch:0", "random:0", "random:1"):
                path = out / "selections" / f"{fv2.dir_name(sel if sel.startswith('random:') else f'{task}/{sel}')}.jsonl"
                picked = [json.loads(x)["id"] for x in open(path)]
                assert lrows[(task, sel, metric)]["selected_heldout_origin_share"] == pytest.approx(
                    np.mean([category[i] == task for i in picked]), abs=1e-12)
            # each row field against the held-out value, across the fine-tuned rows
            for field, key in (("selected_response_tokens", "length_vs_effect"),
                               ("selected_heldout_origin_share", "heldout_origin_vs_effect")):
                xy = [(r[field], r["value"]) for r in lm["rows"]
                      if r["task"] == task and r["metric"] == metric and r["selector"] != "base"]
                x, y = np.asarray(xy).T
                if x.std() > 0 and y.std() > 0:
                    assert lm["meta"][key][f"{task}/{metric}"]["pearson"] == pytest.approx(
                        np.corrcoef(x, y)[0, 1], abs=1e-9)
            assert lrows[(task, "base", metric)]["selected_heldout_origin_share"] is None
    assert "Length-matched control" in (out / "summary.md").read_text()

    # a second training seed (--finetune-seeds 0 1): the seed-0 models are reused, each selection is fine-tuned again
    # with seed 1 (the data seed orders the batches; seed_everything too), and a row's value is its per-example mean
    # over the two runs, each run's value listed beside it
    argv_ft = [*argv[: argv.index("--selectors")], "--selectors", "length", *argv[argv.index("--source"):]]
    argv_ft[argv_ft.index("--random-seeds") + 1: argv_ft.index("--random-seeds") + 3] = ["0"]
    ft = effect.main([*argv_ft, "--finetune-seeds", "0", "1"])
    stages = json.loads((out / "state.json").read_text())["stages"]
    assert {k: stages[k] for k in before if k in stages} == before  # nothing of seed 0 re-ran
    assert {k for k in stages if k not in before} == {"finetune:random:0~ft1", "finetune:length~ft1",
                                                      "finetune:addition/lenmatch:0", "finetune:uppercase/lenmatch:0"}
    overlay = yaml.safe_load((out / "configs" / "finetune_length~ft1.yaml").read_text())
    assert overlay["seed_everything"] == 1 and overlay["data"]["init_args"]["seed"] == 1
    assert json.loads(stages["finetune:length~ft1"]["fingerprint"])["shuffle_seed"] == 1
    assert "shuffle_seed" not in json.loads(stages["finetune:length"]["fingerprint"])
    evals = {json.loads(p.read_text())["key"]: json.loads(p.read_text()) for p in (out / "evals").glob("*.json")}
    frows = {(r["task"], r["selector"], r["metric"]): r for r in ft["rows"]}
    assert ft["meta"]["finetune_seeds"] == [0, 1]
    for task in ("addition", "uppercase"):
        for metric in ("loss", "exact_match"):
            for sel in ("length", "random:0"):
                runs = [per_example(sel, metric), per_example(f"{sel}~ft1", metric)]
                r = frows[(task, sel, metric)]
                assert r["finetune_seeds"] == [0, 1]
                assert r["finetune_seed_values"] == pytest.approx([x.mean() for x in runs], abs=1e-12)
                assert r["value"] == pytest.approx(np.mean(runs, axis=0).mean(), abs=1e-12)
            spread = max(abs(np.subtract(*r["finetune_seed_values"])) for r in ft["rows"]
                         if r["task"] == task and r["metric"] == metric and len(r.get("finetune_seeds", [])) == 2)
            assert ft["meta"]["finetune_noise"][f"{task}/{metric}"]["max_spread"] == pytest.approx(spread, abs=1e-12)
    assert "Training-seed noise" in (out / "summary.md").read_text()

    # a summary with other settings never reports the old evaluations under them: with k = 0.4 every fine-tuned
    # row is stale (other selections), only the base row (the warmed target itself) is still this command's
    argv_k = [*argv[: argv.index("--k")], "--k", "0.4", *argv[argv.index("--k") + 2:], "--summary-only"]
    other = effect.main(argv_k)
    assert other["meta"]["k"] == 12 and {r["selector"] for r in other["rows"]} == {"base"}
    unnamed = {f"{t}/lenmatch:0" for t in ("addition", "uppercase")}  # evaluated above, not named by argv
    assert set(other["meta"]["not_reported"]) == set(evals) - {"base"} - unnamed
    assert set(other["meta"]["not_listed"]) == unnamed


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
    proxy re-ran its scoring) and the first run's record, the re-run going to its ``rebuilt`` list; a real change
    records the new text. The first run is the default subprocess, the
    re-runs the same command in this process (``in_process``, what the end-to-end tests use): the same table."""
    import shutil

    import pyarrow.parquet as pq

    st = ledger.Stages(tmp_path, 1, lambda msg: None)
    out = tmp_path / "r" / "scores.parquet"
    ov = {"output": str(out), "pool": "builtin", "seed": 0}
    old = {"seed": 0, "config": "trainer:\n  max_epochs: 4\n"}
    st.run("random", "random_scores", [], ov, old, out, clean=out.parent)
    recorded = st.state["stages"]["random"]["fingerprint"]
    assert recorded == json.dumps(old, sort_keys=True)
    assert "in_process" not in st.state["stages"]["random"]
    first = pq.read_table(out).to_pydict()
    shutil.rmtree(out.parent)
    st.in_process = True
    neutral = {"seed": 0, "config": "trainer:\n  max_epochs: 4\n  log_every_n_steps: 5  # presentation only\n"}
    st.run("random", "random_scores", [], ov, neutral, out, clean=out.parent)
    rec = st.state["stages"]["random"]
    assert out.exists() and rec["fingerprint"] == recorded and pq.read_table(out).to_pydict() == first
    # the record stays the first run's; the re-run is added to its rebuilt list (the host and seconds results cite)
    assert "in_process" not in rec and [r["in_process"] for r in rec["rebuilt"]] == [True]
    assert all("fingerprint" not in r and r["wall_s"] > 0 and r["host"]["cpus"] for r in rec["rebuilt"])
    assert st.ran == ["random", "random"]
    changed = {"seed": 0, "config": "trainer:\n  max_epochs: 5\n"}
    st.run("random", "random_scores", [], ov, changed, out, clean=out.parent)
    assert st.state["stages"]["random"]["fingerprint"] == json.dumps(changed, sort_keys=True)
    assert "rebuilt" not in st.state["stages"]["random"]  # another setting: a new record


def test_a_failing_stage_in_process_fails_as_its_command_does(tmp_path):
    """``in_process``: a stage whose command fails raises the ledger's error with the exit status and the one-line
    message ``python train.py`` gives (here 2, a missing pool); the process's working directory, command line and
    environment are as before."""
    import os

    st = ledger.Stages(tmp_path, 1, lambda msg: None, in_process=True)
    out = tmp_path / "r" / "scores.parquet"
    cwd, argv, env = os.getcwd(), list(sys.argv), dict(os.environ)
    with pytest.raises(RuntimeError, match=r"stage random failed \(exit 2\).*\n.*error: SFT data file not found"):
        st.run("random", "random_scores", [], {"output": str(out), "pool": str(tmp_path / "missing.jsonl"), "seed": 0},
               {"seed": 0}, out, clean=out.parent)
    assert (os.getcwd(), sys.argv, dict(os.environ)) == (cwd, argv, env) and "random" not in st.state["stages"]


def test_lenmatch_selector_names_their_reference_selection():
    assert effect.lenmatch_reference("lenmatch:2") == ("target", 2)
    assert effect.lenmatch_reference("lenmatch-store+max:1") == ("store+max", 1)
    assert effect.lenmatch_reference("lenmatch-store:iprox@0.5+max:0") == ("store:iprox@0.5+max", 0)
    assert effect.lenmatch_reference("target") is None and effect.lenmatch_reference("random:0") is None
    for bad in ("lenmatchx:1", "lenmatch-:1", "lenmatch:x"):
        with pytest.raises(ValueError, match="lenmatch:<seed> or lenmatch-<selector>:<seed>"):
            effect.lenmatch_reference(bad)
    # a control is not a selector of its own: no scoring cost, and it never names a rule
    assert effect.split_rule("lenmatch-store+max:1", "mean") == ("lenmatch-store+max:1", "mean")


def test_docs_sections_per_out_dir(tmp_path):
    """Runs at several scales splice their tables side by side on one page: bench/results/effect keeps the plain
    markers, another OUT gets its own, and re-splicing one leaves the other untouched."""
    doc = tmp_path / "B.md"
    doc.write_text("# Page\n")
    plain, big = effect.docs_markers(Path("bench/results/effect")), effect.docs_markers(Path("x/effect_gpu2048"))
    assert plain == (effect.DOCS_BEGIN, effect.DOCS_END)
    assert big == ("<!-- effect:begin effect_gpu2048 (generated by bench/effect.py --docs) -->",
                   "<!-- effect:end effect_gpu2048 -->")
    effect.splice_effect_docs(doc, "# t\nsmall table", *plain)
    effect.splice_effect_docs(doc, "# t\nbig table", *big)
    effect.splice_effect_docs(doc, "# t\nsmall table v2", *plain)
    text = doc.read_text()
    assert text.count("## Downstream effect") == 2
    assert f"{plain[0]}\nsmall table v2\n{plain[1]}" in text and f"{big[0]}\nbig table\n{big[1]}" in text
    assert "small table\n" not in text


def test_stages_record_their_host_and_summaries_report_it(fidelity_dir):
    """Each stage record carries the host it ran on; a summary reports those hosts (not the machine that rewrote
    it), each distinct host once, and says so when older records have none."""
    state = json.loads((fidelity_dir / "state.json").read_text())
    here = ledger.host_info()
    assert state["stages"] and all(rec["host"] == here for rec in state["stages"].values())
    assert ledger.recorded_hosts(state) == [here]
    gpu = {"machine": "x86_64", "cpus": 16, "accelerator": "NVIDIA H100 80GB HBM3",
           "versions": {"torch": "2.11.0", "transformers": None, "lightning": "2.6.6"}}
    mixed = {"stages": {"a": {"host": gpu}, "b": {}, "c": {"host": here}, "d": {"host": gpu}}}
    assert ledger.recorded_hosts(mixed) == [gpu, here]
    assert ledger.hosts_text([gpu]) == "NVIDIA H100 80GB HBM3 (x86_64, 16 CPUs; torch 2.11.0, lightning 2.6.6)"
    assert "not recorded" in ledger.hosts_text(ledger.recorded_hosts({"stages": {"a": {}}}))
    summary = json.loads((fidelity_dir / "summary.json").read_text())
    assert summary["meta"]["hosts"] == [here]


def test_cost_ratio_only_between_stages_of_one_host():
    """A selector's cost ratio divides its scoring seconds by the target's only when both ran on one host: the
    target scored on a GPU and the store built on a CPU give no ratio against the exact scoring (flagged), records
    without hosts count as one; a store is then compared with the target's store on its own host, if there is one."""
    from types import SimpleNamespace

    gpu = {"machine": "x86_64", "cpus": 16, "accelerator": "NVIDIA H100 80GB HBM3", "versions": {}}
    cpu = {"machine": "x86_64", "cpus": 2, "accelerator": "cpu", "versions": {}}

    def fake(store_host, target_host):
        own = {"store:target": {"wall_s": 300.0, "host": store_host}, "query:target": {"wall_s": 100.0, "host": store_host},
               "score:rds": {"wall_s": 50.0}}
        fid = {"score:target": {"wall_s": 200.0, **({"host": target_host} if target_host else {})},
               "score:v": {"wall_s": 80.0, "host": gpu}, "build:v": {"wall_s": 120.0, "host": gpu}}
        return SimpleNamespace(args=SimpleNamespace(rule="mean"), fid_stages=fid, st=SimpleNamespace(state={"stages": own}),
                               sources={"target": "target", "iprox@0.5": "v"})

    same = effect.Effect.cost(fake(gpu, gpu), "store+max")  # the target's store against itself, not the exact scoring
    assert same["scoring_cost_ratio"] == 1.0 and same["cost_reference"] == "target store" and "hosts_differ" not in same
    no_store = fake(gpu, gpu)  # a proxy's store where the target's store has no record: the exact scoring is the reference
    for k in ("store:target", "query:target"):
        del no_store.st.state["stages"][k]
    no_store.st.state["stages"].update({"store:iprox@0.5": {"wall_s": 60.0, "host": gpu},
                                        "query:iprox@0.5": {"wall_s": 20.0, "host": gpu}})
    vs_exact = effect.Effect.cost(no_store, "store:iprox@0.5+max")
    assert vs_exact["scoring_cost_ratio"] == 0.4 and vs_exact["total_cost_ratio"] == 1.0  # 80 / 200, + 120 built
    assert vs_exact["cost_reference"] == "target scoring"
    exact_rds = effect.Effect.cost(fake(gpu, gpu), "rds")
    assert exact_rds["scoring_cost_ratio"] == 0.25 and exact_rds["cost_reference"] == "target scoring"
    other = effect.Effect.cost(fake(cpu, gpu), "rds")  # RDS+ on the CPU (no host: counts as any), target on the GPU
    assert other["scoring_cost_ratio"] == 0.25
    own_store = effect.Effect.cost(fake(cpu, gpu), "store+balanced")  # no exact scoring here: the target's store is 1
    assert own_store["scoring_cost_ratio"] == 1.0 and own_store["cost_reference"] == "target store"
    assert own_store["scoring_wall_s"] == 400.0  # the seconds are reported
    proxy = effect.Effect.cost(fake(cpu, gpu), "iprox@0.5")
    assert proxy["scoring_cost_ratio"] == 0.4 and proxy["total_cost_ratio"] == 1.0
    legacy = effect.Effect.cost(fake(cpu, None), "rds")  # no host recorded on either side
    assert legacy["scoring_cost_ratio"] == 0.25
    # a proxy's store on the CPU, its target scored on a GPU: compared with the target's store on the same CPU
    e = fake(cpu, gpu)
    e.st.state["stages"].update({"store:iprox@0.5": {"wall_s": 150.0, "host": cpu},
                                 "query:iprox@0.5@bbh-direct": {"wall_s": 50.0, "host": cpu}})
    e.fid_stages["build:v"] = {"wall_s": 200.0, "host": cpu}
    ps = effect.Effect.cost(e, "store:iprox@0.5@bbh-direct+balanced")
    assert ps["scoring_cost_ratio"] == 0.5 and ps["total_cost_ratio"] == 1.0  # (150 + 50) / (300 + 100), + 200 built
    assert ps["cost_reference"] == "target store" and "hosts_differ" not in ps
    e.fid_stages["build:v"]["host"] = gpu  # the proxy built on the GPU, stored on the CPU: no ratio at all
    no = effect.Effect.cost(e, "store:iprox@0.5@bbh-direct+balanced")
    assert no["hosts_differ"] and no["scoring_cost_ratio"] is None and no["total_cost_ratio"] is None
    assert no["scoring_wall_s"] == 200.0  # the seconds are still reported


def test_store_selectors_with_a_validation_form_query_the_same_store():
    """``store:target@bbh-direct`` queries the target's store (built once) with BBH's direct-answer exemplars: same
    store directory, its own query directory; a proxy's ``@0.5`` is a name, not a form; an unknown form is refused."""
    from types import SimpleNamespace

    assert effect.split_store_source("target@bbh-direct") == ("target", "bbh-direct")
    assert effect.split_store_source("iprox@0.5") == ("iprox@0.5", None)
    assert effect.split_store_source("iprox@0.5@bbh-direct") == ("iprox@0.5", "bbh-direct")
    with pytest.raises(ValueError, match="unknown validation form 'cot2'"):
        effect.split_store_source("target@cot2")
    fake = SimpleNamespace(out=Path("/o"), sources=dict(effect.DEFAULT_SOURCES))
    assert effect.Effect.store_paths(fake, "target") == (Path("/o/stores/target"), Path("/o/scores/store"))
    store, query = effect.Effect.store_paths(fake, "target@bbh-direct")
    assert store == Path("/o/stores/target") and query.parent == Path("/o/scores") and query.name != "store"
    assert effect.Effect.store_paths(fake, "iprox@0.5@bbh-direct")[0] == effect.Effect.store_paths(fake, "iprox@0.5")[0]


def test_validation_forms_spell_one_eval_spec_for_store_queries_and_rds():
    """A form replaces its suite in the ``eval:<dir>`` spec (the store query and ``rds@<form>`` read the same one);
    an unknown form and the built-in demo suites are refused, naming the selector."""
    from types import SimpleNamespace

    real = SimpleNamespace(args=SimpleNamespace(eval_dir="/e"))
    assert effect.Effect.form_validation(real, "bbh-direct", "rds@bbh-direct") == "eval:/e:mmlu,bbh-direct,tydiqa"
    with pytest.raises(ValueError, match="rds@cot2: unknown validation form 'cot2'"):
        effect.Effect.form_validation(real, "cot2", "rds@cot2")
    with pytest.raises(ValueError, match="store:target@bbh-direct: validation forms need the real evaluation suites"):
        effect.Effect.form_validation(SimpleNamespace(args=SimpleNamespace(eval_dir="builtin")), "bbh-direct",
                                      "store:target@bbh-direct")


def test_cost_takes_the_build_that_ran_on_the_rows_host():
    """A proxy built on a GPU and re-made on a CPU (same fingerprint: the GPU's copy stayed there) keeps both runs:
    the exact GPU scoring row costs the GPU build, the CPU store row the CPU re-build."""
    from types import SimpleNamespace

    gpu = {"machine": "x86_64", "cpus": 16, "accelerator": "NVIDIA H100 80GB HBM3", "versions": {}}
    cpu = {"machine": "x86_64", "cpus": 2, "accelerator": "cpu", "versions": {}}
    fid = {"score:target": {"wall_s": 20.0, "host": gpu}, "score:v": {"wall_s": 30.0, "host": gpu},
           "build:v": {"wall_s": 100.0, "host": gpu, "rebuilt": [{"wall_s": 1500.0, "host": cpu}]}}
    own = {"store:target": {"wall_s": 1200.0, "host": cpu}, "query:target": {"wall_s": 200.0, "host": cpu},
           "store:iprox@0.5": {"wall_s": 600.0, "host": cpu}, "query:iprox@0.5@bbh-direct": {"wall_s": 100.0, "host": cpu}}
    e = SimpleNamespace(args=SimpleNamespace(rule="mean"), fid_stages=fid, st=SimpleNamespace(state={"stages": own}),
                        sources={"target": "target", "iprox@0.5": "v"})
    exact = effect.Effect.cost(e, "iprox@0.5")
    assert exact["scoring_cost_ratio"] == 1.5 and exact["total_cost_ratio"] == 6.5 and exact["build_wall_s"] == 100.0
    # a +tval row scores the proxy built for its base variant: that build is its build
    e.sources["tval@0.5"] = "v+tval"
    fid["score:v+tval"] = {"wall_s": 40.0, "host": gpu}
    tval = effect.Effect.cost(e, "tval@0.5")
    assert tval["scoring_cost_ratio"] == 2.0 and tval["build_wall_s"] == 100.0 and tval["total_cost_ratio"] == 7.0
    store = effect.Effect.cost(e, "store:iprox@0.5@bbh-direct+balanced")
    assert store["scoring_cost_ratio"] == 0.5 and store["build_wall_s"] == 1500.0  # (600 + 100) / (1200 + 200)
    assert store["total_cost_ratio"] == pytest.approx(2200 / 1400) and store["cost_reference"] == "target store"


def test_unwarmed_store_is_the_shipped_model_and_a_fidelity_reference(fidelity_dir, tmp_path):
    """``store:target_unwarmed`` builds a store from the model as shipped (``--model``), not the warmed target, and is
    compared with the target's store like a proxy's (the off-the-shelf reference of the per-task fidelity table).
    Without a warm-up (``--no-warmup``) the shipped model is the target: same scores, fidelity 1. ``--tables-only``
    makes the tables and the summary and fine-tunes nothing."""
    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "--selectors", "store", "store:target_unwarmed+balanced",
            "length", "--k", "0.2", "--max-length", "48", "--threads", "1", "--in-process", "--tables-only"]
    s = effect.main(argv)
    assert s["rows"] == [] and not list((out / "evals").glob("*.json")) and not (out / "selections").exists()
    man = json.loads((out / "stores" / "target_unwarmed" / "store.json").read_text())
    assert "builtin" in json.dumps(man)
    a, b = (fv2.score_arrays(out / "scores" / d / "scores.parquet")
            for d in ("store", fv2.dir_name("store:target_unwarmed")))
    assert list(a["id"]) == list(b["id"]) and np.array_equal(a["score"], b["score"])
    fid = s["meta"]["proxy_store_fidelity"]
    assert list(fid) == ["target_unwarmed"] and fid["target_unwarmed"]["pooled"] == pytest.approx(1.0)
    assert fid["target_unwarmed"]["addition"]["mean"] == pytest.approx(1.0)
    e = effect.Effect(effect.parse_args(argv))
    e.sources = dict(effect.DEFAULT_SOURCES)
    assert e.cost("store:target_unwarmed")["build_wall_s"] == 0.0


def test_headline_takes_each_task_in_its_form_and_ranks_by_the_worst_task():
    """The README's headline: one line per selector family (with and without a validation form), each task from the
    row queried in the task's form when ``--headline-forms`` names it, the worst task, a proxy store's fidelity."""
    def row(task, sel, diff, cost=None):
        return {"task": task, "selector": sel, "metric": "loss", "diff_vs_random": diff, "diff_ci": [diff - .1, diff + .1],
                "scoring_cost_ratio": cost, "total_cost_ratio": cost and 2 * cost}

    rows = [row("mmlu", "store:iprox@0.5+balanced", 0.5, 0.7), row("bbh", "store:iprox@0.5+balanced", -0.3, 0.7),
            row("bbh", "store:iprox@0.5@bbh-direct+balanced", 0.6, 0.7), row("mmlu", "store+balanced", 0.4, 1.0),
            row("bbh", "store:target@bbh-direct+balanced", 0.7, 1.0), row("bbh", "store+balanced", 0.1, 1.0),
            row("mmlu", "length", 0.45, 0.0), row("bbh", "length", 0.8, 0.0), row("mmlu", "random:0", 0.1),
            row("bbh", "random:0", -0.1), row("mmlu", "lenmatch:0", 0.2), row("bbh", "lenmatch:0", 0.2),
            row("mmlu", "rds", 0.3), {**row("bbh", "rds", 0.0), "metric": "exact_match"}]
    fid = {"iprox@0.5": {"mmlu": {"mean": 0.53}, "bbh": {"mean": 0.09}}, "iprox@0.5@bbh-direct": {"bbh": {"mean": 0.55}}}
    summary = {"meta": {"tasks": ["mmlu", "bbh"], "rule": "mean", "random_seeds": [0, 1, 2], "k": 10, "pool_sample": 200,
                        "proxy_store_fidelity": fid}, "rows": rows}
    got = {r["selector"]: r for r in effect.headline_rows(summary, ["bbh-direct"])}
    assert list(got) == ["store:iprox@0.5+balanced", "length", "store+balanced"]  # best worst task first; rds: no bbh loss
    p = got["store:iprox@0.5+balanced"]
    assert p["tasks"]["bbh"]["selector"] == "store:iprox@0.5@bbh-direct+balanced" and p["tasks"]["bbh"]["diff"] == 0.6
    assert p["worst"] == ("mmlu", 0.5) and p["cost"][:2] == (0.7, 1.4)
    assert [x["fidelity"] for x in p["tasks"].values()] == [0.53, 0.55]
    assert got["store+balanced"]["tasks"]["bbh"]["selector"] == "store:target@bbh-direct+balanced"
    assert got["store+balanced"]["tasks"]["mmlu"]["fidelity"] is None
    plain = {r["selector"]: r for r in effect.headline_rows(summary)}  # no form named: the default-form rows
    assert plain["store:iprox@0.5+balanced"]["tasks"]["bbh"]["diff"] == -0.3
    assert plain["store:iprox@0.5+balanced"]["tasks"]["bbh"]["fidelity"] == 0.09
    md = effect.headline_markdown(summary, ["bbh-direct"])
    assert "| store:iprox@0.5+balanced | +0.500 [+0.400, +0.600] | +0.600 [+0.500, +0.700]† | +0.500 (mmlu) | 0.70 (1.40 " \
           "with build) | 0.53 / 0.55 |" in md
    assert effect.selector_family("store:target@bbh-direct+max") == ("store+max", "bbh-direct")
    assert effect.selector_family("rds@bbh-direct") == ("rds", "bbh-direct")
    assert effect.selector_family("store:iprox@0.5") == ("store:iprox@0.5", None)


def test_readme_headline_is_generated_from_the_recorded_summary():
    """The README's headline table is ``headline_markdown`` of the recorded 2,048-example summary, byte for byte
    (re-made by ``bench/effect.py --summary-only --headline README.md --headline-forms bbh-direct``)."""
    root = Path(__file__).resolve().parents[1]
    out = root / "bench" / "results" / "effect_gpu2048"
    begin, end = effect.headline_markers(out)
    text = (root / "README.md").read_text()
    block = text.split(begin, 1)[1].split(end, 1)[0].strip()
    summary = json.loads((out / "summary.json").read_text())
    assert block == effect.headline_markdown(summary, ["bbh-direct"]).strip()


def test_summary_only_reads_a_recorded_proxy_store_query_without_its_proxy(tmp_path):
    """``--summary-only`` (and ``--recorded-tables``) reads the table a recorded query wrote; the proxy (whose weights are not kept) is not needed
    then, while a run that would build or query refuses a missing proxy, naming the command that re-makes it."""
    from types import SimpleNamespace

    paths = SimpleNamespace(out=tmp_path, sources={"iprox@0.5": "v"})
    store, d = effect.Effect.store_paths(paths, "iprox@0.5")
    d.mkdir(parents=True)
    (d / "scores.parquet").write_bytes(b"recorded")
    fake = SimpleNamespace(args=SimpleNamespace(summary_only=True, recorded_tables=False), out=tmp_path,
                           fid=tmp_path / "fid", fid_stages={}, sources={"iprox@0.5": "v"},
                           store_paths=lambda src: effect.Effect.store_paths(paths, src))
    assert effect.Effect.store_table(fake, "iprox@0.5") == d / "scores.parquet"
    # --recorded-tables: a run that fine-tunes and evaluates ranks from the same recorded table
    fake.args.summary_only, fake.args.recorded_tables = False, True
    assert effect.Effect.store_table(fake, "iprox@0.5") == d / "scores.parquet"
    fake.args.recorded_tables = False
    with pytest.raises(SystemExit, match="the proxy .* is gone; re-make it with"):
        effect.Effect.store_table(fake, "iprox@0.5")


def test_tval_store_selector_queries_its_proxys_store_with_the_targets_validation(fidelity_dir, tmp_path):
    """``store:tval@0.5`` (a ``+tval`` source) reads the store of the proxy it names (``iprox@0.5``'s: built once) and
    queries it with the target's validation gradients (``query --validation_model``): its table is the product's
    query with that model, unlike the proxy's own query, and its cost is that one store + its own query + the proxy's
    build."""
    from iprox_lightning.commands.query import query

    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "--selectors", "store:iprox@0.5+max", "store:tval@0.5+max",
            "--source", f"iprox@0.5={VARIANT}", "--source", f"tval@0.5={VARIANT}+tval", "--k", "0.2",
            "--max-length", "48", "--threads", "1", "--in-process", "--tables-only"]
    effect.main(argv)
    assert sorted(p.name for p in (out / "stores").iterdir()) == [fv2.dir_name("iprox@0.5")]  # one store
    store = out / "stores" / fv2.dir_name("iprox@0.5")
    ref = query(str(store), str(fidelity_dir / "validation.jsonl"), str(tmp_path / "ref"), validation_model="builtin")
    got, own, want = (fv2.score_arrays(p) for p in (out / "scores" / fv2.dir_name("store:tval@0.5") / "scores.parquet",
                                                    out / "scores" / fv2.dir_name("store:iprox@0.5") / "scores.parquet",
                                                    Path(ref)))
    assert list(got["id"]) == list(want["id"]) and np.array_equal(got["score"], want["score"])
    assert not np.allclose(got["score"], own["score"])  # another validation side, another ranking input
    stages = json.loads((out / "state.json").read_text())["stages"]
    assert "validation_model" in stages["query:tval@0.5"]["fingerprint"]
    assert "validation_model" not in stages["query:iprox@0.5"]["fingerprint"] and "store:tval@0.5" not in stages
    e = effect.Effect(effect.parse_args(argv))
    e.sources = {**effect.DEFAULT_SOURCES, "iprox@0.5": VARIANT, "tval@0.5": VARIANT + "+tval"}
    c = e.cost("store:tval@0.5+max")
    assert c["scoring_wall_s"] == pytest.approx(stages["store:iprox@0.5"]["wall_s"] + stages["query:tval@0.5"]["wall_s"])
    assert c["build_wall_s"] == pytest.approx(json.loads((fidelity_dir / "state.json").read_text())["stages"][
        f"build:{VARIANT}"]["wall_s"])


def test_a_remade_proxy_is_not_served_by_the_earlier_ones_store(fidelity_dir, tmp_path):
    """A proxy re-made from the same settings need not be bit-identical (its directory is never kept): the store stage
    fingerprints the proxy's recorded weights digest, so a re-made proxy gets its own store and query instead of the
    earlier proxy's."""
    import shutil

    fid = tmp_path / "v2"
    shutil.copytree(fidelity_dir, fid)
    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fid), "--model", "builtin", "--pool", "builtin", "--eval-dir",
            "builtin", "--tasks", "addition", "--selectors", "store:iprox@0.5+max", "--source", f"iprox@0.5={VARIANT}",
            "--k", "0.2", "--max-length", "48", "--threads", "1", "--in-process", "--tables-only"]
    effect.main(argv)
    man = fid / "proxies" / fv2.dir_name(VARIANT) / "iprox_proxy.json"
    digest = json.loads(man.read_text())["weights"]["sha256"]
    stages = lambda: json.loads((out / "state.json").read_text())["stages"]  # noqa: E731
    assert json.loads(stages()["store:iprox@0.5"]["fingerprint"])["proxy_weights"] == digest
    runs = lambda: {k: (stages()[k]["finished"], stages()[k]["wall_s"]) for k in ("store:iprox@0.5", "query:iprox@0.5")}  # noqa: E731
    first = runs()
    effect.main(argv)  # unchanged: nothing re-made
    assert runs() == first
    # re-made with other weights (one factor entry moved), saved by the product with the same manifest otherwise
    import torch

    from iprox_lightning.io.proxy import load_proxy, save_proxy
    from iprox_lightning.engine.lowrank import LowRankLinear

    model, tok = load_proxy(man.parent)
    with torch.no_grad():
        next(m for m in model.modules() if isinstance(m, LowRankLinear)).A[0, 0] += 0.5
    old = json.loads(man.read_text())
    save_proxy(model, tok, man.parent, {k: v for k, v in old.items() if k not in ("weights", "layers")})
    new = json.loads(man.read_text())["weights"]["sha256"]
    assert new != digest
    effect.main(argv)
    assert json.loads(stages()["store:iprox@0.5"]["fingerprint"])["proxy_weights"] == new
    again = runs()
    assert all(again[k] != first[k] for k in first)  # the store and its query were made anew
    assert json.loads(stages()["query:iprox@0.5"]["fingerprint"])["store"] == stages()["store:iprox@0.5"]["fingerprint"]


def test_short_selectors_rank_within_the_shortlist_and_face_its_random_subsets(fidelity_dir, tmp_path):
    """``<selector>~short<m>`` is the product's ``select(within_shortest=m)`` on that selector's table (a random table
    gets the sample's response tokens first); its family keeps the suffix; ``shortlist_controls`` is the paired gain
    over the mean of the ``random:<seed>~short<m>`` subsets."""
    from iprox_lightning.evaluation.bootstrap import paired_gain
    from iprox_lightning.selection.select import select

    assert effect.split_shortlist("store:iprox@0.5@bbh-direct+balanced~short2") == (
        "store:iprox@0.5@bbh-direct+balanced", 2.0)
    assert effect.split_rule("store+max~short3", "mean") == ("store", "max")
    assert effect.selector_family("rds@bbh-direct~short2") == ("rds~short2", "bbh-direct")
    with pytest.raises(ValueError, match="~short<multiple of k>"):
        effect.split_shortlist("target~shortx")
    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "--selectors", "target~short2", "random:0~short2",
            "--k", "0.2", "--max-length", "48", "--threads", "1", "--in-process", "--tables-only"]
    effect.main(argv)
    e = effect.Effect(effect.parse_args(argv))
    e.sources = dict(effect.DEFAULT_SOURCES)
    got = e.selection("addition", "target~short2")
    ref = select(str(fidelity_dir / "scores" / "target" / "scores.parquet"), k=e.k, rule="mean", task="addition",
                 pool=str(fidelity_dir / "sample.jsonl"), output=str(tmp_path / "ref.jsonl"), quiet=True,
                 within_shortest=2)
    assert [json.loads(x)["id"] for x in open(got)] == [json.loads(x)["id"] for x in open(ref)]
    n_tok = e.response_tokens()
    picked = [json.loads(x)["id"] for x in open(e.selection(None, "random:0~short2"))]
    cut = sorted(n_tok.values())[2 * e.k - 1]
    assert len(picked) == e.k and all(n_tok[i] <= cut for i in picked)
    rng = np.random.default_rng(0)
    per_model = {k: {"loss": rng.normal(size=20)} for k in ("target~short2", "random:0~short2", "random:1~short2",
                                                              "target")}
    res = effect.shortlist_controls(per_model, "loss", False, 200, 0)
    e.heldout, e.heldout_origins = {"addition": [{"id": str(j)} for j in range(20)]}, {"addition": set()}
    noise: dict = {}
    per_model["random:0"] = {"loss": rng.normal(size=20)}
    rows = e.task_rows("addition", "loss", False, {}, per_model, noise)
    assert noise["addition/loss"]["seeds"] == 1  # the shortlist's random subsets are controls, not random seeds
    t_row = next(r for r in rows if r["selector"] == "target")
    assert t_row["diff_vs_random"] == pytest.approx(float(per_model["random:0"]["loss"].mean()
                                                          - per_model["target"]["loss"].mean()))
    assert list(res) == ["target~short2"]
    diff, ci, _ = paired_gain(per_model["target~short2"]["loss"],
                              [per_model[c]["loss"] for c in ("random:0~short2", "random:1~short2")], False, 200, 0)
    assert res["target~short2"]["diff"] == pytest.approx(diff) and res["target~short2"]["seeds"] == 2


def test_fresh_selectors_leave_out_the_heldout_source_and_face_random_subsets_of_the_rest(fidelity_dir, tmp_path):
    """``<selector>~fresh`` is the product's ``select(exclude_categories=...)`` with the pool categories its task's
    held-out examples come from (the demo: the task's own family; TyDiQA: XQuAD); ``random:<seed>~fresh`` draws from
    the same candidates and is the control of the ``~fresh`` rows (``meta.fresh_matched``: the paired gain over their
    mean), not a random seed of the plain rows."""
    from iprox_lightning.evaluation.bootstrap import paired_gain
    from iprox_lightning.selection.select import select

    assert effect.split_fresh("store:iprox@0.5+balanced~fresh") == ("store:iprox@0.5+balanced", True)
    assert effect.split_fresh("store+balanced") == ("store+balanced", False)
    assert effect.split_rule("store+max~fresh", "mean") == ("store", "max")
    with pytest.raises(ValueError, match="without ~short"):
        effect.split_fresh("target~short2~fresh")
    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "--selectors", "target~fresh", "random:0~fresh",
            "random:1~fresh", "--random-seeds", "0", "--k", "0.2", "--max-length", "48", "--epochs", "1",
            "--bootstrap", "50", "--threads", "1", "--in-process"]
    s = effect.main(argv)
    category = {r["id"]: r["category"] for r in map(json.loads, open(fidelity_dir / "sample.jsonl"))}
    ids = lambda p: [json.loads(x)["id"] for x in open(p)]  # noqa: E731
    got = ids(out / "selections" / f"{fv2.dir_name('addition/target~fresh')}.jsonl")
    ref = select(str(fidelity_dir / "scores" / "target" / "scores.parquet"), k=6, rule="mean", task="addition",
                 pool=str(fidelity_dir / "sample.jsonl"), output=str(tmp_path / "ref.jsonl"), quiet=True,
                 exclude_categories=["addition"])
    assert got == ids(ref) and len(got) == 6 and all(category[i] != "addition" for i in got)
    for seed in (0, 1):
        picked = ids(out / "selections" / f"{fv2.dir_name(f'random:{seed}~fresh')}.jsonl")
        assert len(picked) == 6 and all(category[i] != "addition" for i in picked)
    m = s["meta"]
    assert m["noise_floor"]["addition/loss"]["seeds"] == 1  # random:0 only: the ~fresh subsets are controls
    rows = {(r["selector"], r["metric"]): r for r in s["rows"]}
    assert rows[("target~fresh", "loss")]["selected_heldout_origin_share"] == 0.0
    evals = {json.loads(p.read_text())["key"]: json.loads(p.read_text()) for p in (out / "evals").glob("*.json")}

    def per_example(key, metric):
        return np.asarray([e[metric] for e in evals[key]["tasks"]["addition"]["examples"]])

    for metric, hib in (("loss", False), ("exact_match", True)):
        rec = m["fresh_matched"][f"addition/{metric}"]["target~fresh"]
        diff, ci, _ = paired_gain(per_example("addition/target~fresh", metric),
                                  [per_example(f"random:{j}~fresh", metric) for j in (0, 1)], hib, 50, 0)
        assert rec["seeds"] == 2 and rec["diff"] == pytest.approx(diff, abs=1e-12) and rec["diff_ci"] == pytest.approx(ci)
    assert "Fresh-candidates control" in (out / "summary.md").read_text()


class StopAtEpoch(Callback):
    """Records each training epoch it sees in ``log`` and fails at the start of epoch ``stop`` (0-based) while ``flag``
    exists, removing it: an interrupted warm-up (a callback the stage's command imports by class path)."""

    def __init__(self, log: str, flag: str, stop: int) -> None:
        self.epochs_file, self.flag, self.stop = log, Path(flag), stop

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        with open(self.epochs_file, "a") as f:
            f.write(f"{trainer.current_epoch}\n")
        if trainer.current_epoch == self.stop and self.flag.exists():
            self.flag.unlink()
            raise RuntimeError("interrupted (test)")


def test_less_selector_warms_up_with_lora_scores_the_checkpoints_and_selects_by_max(fidelity_dir, tmp_path,
                                                                                   monkeypatch):
    """Selector ``less+max`` (issue 66): its own LoRA warm-up (``configs/less/warmup.yaml``, a checkpoint per epoch),
    ``method: less`` over the 4 checkpoints (``configs/less/score.yaml``), then the product's select with LESS's max;
    a second invocation re-runs nothing. The warm-up is interrupted at the start of its third epoch: the next
    invocation keeps the two epochs' adapters (same bytes) and goes on from the last Lightning checkpoint (epochs 2
    and 3 only), the record listing both starts; the checkpoint is removed once the warm-up is done."""
    from iprox_lightning.selection.select import select

    out = tmp_path / "effect"
    argv = ["--out", str(out), "--fidelity", str(fidelity_dir), "--model", "builtin", "--pool", "builtin",
            "--eval-dir", "builtin", "--tasks", "addition", "--priority-tasks", "addition", "--selectors", "less+max",
            "--random-seeds", "0", "--k", "0.2", "--epochs", "1", "--max-length", "48", "--eval-max-length", "48",
            "--builtin-per-task", "8", "--bootstrap", "50", "--threads", "1", "--in-process"]
    epochs, flag = tmp_path / "epochs.txt", tmp_path / "interrupt"
    flag.touch()
    execute = ledger.Stages._execute

    def with_stop(self, key, subcommand, configs, overlay, done):
        if key == "less:warmup":
            stop = {"class_path": "test_bench_effect.StopAtEpoch",
                    "init_args": {"log": str(epochs), "flag": str(flag), "stop": 2}}
            overlay = {**overlay, "trainer": {**overlay["trainer"],
                                              "callbacks": [*overlay["trainer"]["callbacks"], stop]}}
        return execute(self, key, subcommand, configs, overlay, done)

    monkeypatch.setattr(ledger.Stages, "_execute", with_stop)
    monkeypatch.setenv("IPROX_ALLOW_IMPORTS", "test_bench_effect")
    effect.main(argv)  # (a selector that fails is reported, the others go on)
    state = json.loads((out / "state.json").read_text())
    assert "less:warmup" not in state["stages"] and len(state["pending"]["less:warmup"]["attempts"]) == 1
    warm = out / "less" / "warmup" / "adapters"
    assert sorted(p.name for p in warm.iterdir()) == ["epoch_1", "epoch_2"]
    first = {p: p.read_bytes() for p in sorted(warm.rglob("*.safetensors"))}
    assert (out / "less" / "warmup" / "resume" / "last.ckpt").exists()
    effect.main(argv)
    assert epochs.read_text().split() == ["0", "1", "2", "2", "3"]  # the resumption starts at the third epoch
    assert sorted(p.name for p in warm.iterdir()) == ["epoch_1", "epoch_2", "epoch_3", "epoch_4", "final"]
    assert all(p.read_bytes() == b for p, b in first.items())
    assert not (out / "less" / "warmup" / "resume").exists()
    record = json.loads((out / "state.json").read_text())
    assert len(record["stages"]["less:warmup"]["resumed"]) == 2 and not record["pending"]
    # a fine-tune recorded under a config text that differs by a comment (the shipped config edited since) stands:
    # its weights are gone (not kept), its evaluations carry the recorded text, and nothing is fine-tuned again
    ft = record["stages"]["finetune:random:0"]
    fp = json.loads(ft["fingerprint"])
    ft["fingerprint"] = json.dumps({**fp, "config": "# an older comment\n" + fp["config"]}, sort_keys=True)
    evals = out / "evals" / f"{fv2.dir_name('random:0')}.json"
    e = json.loads(evals.read_text())
    for t in e["tasks"].values():  # (as they were made: from the recorded text)
        t["fingerprint"] = effect.json_digest([ft["fingerprint"], t["heldout_digest"], 48])
    evals.write_text(json.dumps(e, indent=1))
    (out / "state.json").write_text(json.dumps(record, indent=1))
    effect.main(argv)
    assert json.loads((out / "state.json").read_text())["stages"] == record["stages"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["not_reported"] == []  # and its evaluations are reported
    # LESS's cost: its 4-checkpoint scoring, its LoRA warm-up as its build, over the target's (exact, as the demo
    # has no target store) scoring on the same host
    rows = [r for r in summary["rows"] if r["selector"] == "less+max"]  # (a row per metric)
    stages, target = record["stages"], json.loads((fidelity_dir / "state.json").read_text())["stages"]["score:target"]
    # the interrupted warm-up's seconds were recorded and its resumed record counts both attempts'
    walls = stages["less:warmup"]["attempt_walls_s"]
    assert len(walls) == 2 and walls[0] > 0 and walls[1] == stages["less:warmup"]["wall_s"]
    score_s, warm_s = stages["score:less"]["wall_s"], sum(walls)
    assert rows and score_s > 0 and warm_s > 0 and not any(r.get("cost_lower_bound") for r in rows)
    for row in rows:
        assert (row["scoring_wall_s"], row["build_wall_s"], row["cost_reference"]) == (score_s, warm_s,
                                                                                       "target scoring")
        assert row["scoring_cost_ratio"] == pytest.approx(score_s / target["wall_s"], rel=1e-12)
        assert row["total_cost_ratio"] == pytest.approx((score_s + warm_s) / target["wall_s"], rel=1e-12)
    table = out / "scores" / "less" / "scores.parquet"
    settings = json.loads((table.parent / "settings.json").read_text())["fingerprint"]["settings"]
    assert settings["method"] == "less" and len(settings["checkpoint_weights"]) == 4
    ref = select(str(table), k=6, rule="max", task="addition", pool=str(fidelity_dir / "sample.jsonl"),
                 output=str(tmp_path / "ref.jsonl"), quiet=True)
    got = out / "selections" / f"{fv2.dir_name('addition/less+max')}.jsonl"
    assert [json.loads(x)["id"] for x in open(got)] == [json.loads(x)["id"] for x in open(ref)]
    state = json.loads((out / "state.json").read_text())["stages"]
    assert {"less:warmup", "score:less"} <= set(state)
    effect.main(argv)
    assert json.loads((out / "state.json").read_text())["stages"] == state
    # a checkout without the warm-up's adapters (never kept): --recorded-tables takes the table recorded with these
    # settings and runs no stage ...
    shutil.rmtree(out / "less")
    kept_table = table.read_bytes()
    effect.main([*argv, "--recorded-tables", "--tables-only"])
    assert not (out / "less").exists() and table.read_bytes() == kept_table
    assert json.loads((out / "state.json").read_text())["stages"] == state
    # a resumed record without its earlier attempts' seconds (an attempt killed outright, or recorded before the
    # attempts were timed): the cost counts the last attempt's and says it is a lower bound
    whole = json.loads((out / "state.json").read_text())
    untimed = {**state, "less:warmup": {k: v for k, v in state["less:warmup"].items() if k != "attempt_walls_s"}}
    (out / "state.json").write_text(json.dumps({**whole, "stages": untimed}))
    effect.main([*argv, "--summary-only"])
    rows = [r for r in json.loads((out / "summary.json").read_text())["rows"] if r["selector"] == "less+max"]
    assert rows and all(r["cost_lower_bound"] and r["build_wall_s"] == state["less:warmup"]["wall_s"] for r in rows)
    head = (out / "headline.md").read_text()
    assert f"≥{rows[0]['scoring_cost_ratio']:.2f} (≥{rows[0]['total_cost_ratio']:.2f} with build)" in head
    assert "≥: a lower bound" in head
    (out / "state.json").write_text(json.dumps(whole))

    class Ran(Exception):
        pass

    def refuse(self, key, *a, **k):
        raise Ran(key)

    # ... but not one recorded under other settings: the warm-up runs again
    monkeypatch.setattr(ledger.Stages, "_execute", refuse)
    changed = {**state, "score:less": {**state["score:less"], "fingerprint": json.dumps(
        {**json.loads(state["score:less"]["fingerprint"]), "settings": {"max_length": 40, "batch_size": 8}})}}
    (out / "state.json").write_text(json.dumps({**json.loads((out / "state.json").read_text()), "stages": changed}))
    with pytest.raises(Ran, match="less:warmup"):
        effect.main([*argv, "--recorded-tables", "--tables-only"])
