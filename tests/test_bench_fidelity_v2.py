"""bench/fidelity_v2.py: its pure parts against brute force, and a tiny end-to-end run through the
product's stages on the built-in data (summary contents, fingerprint skip, changed-setting re-run)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fidelity_v2 as fv2  # noqa: E402
import ledger  # noqa: E402
import variants  # noqa: E402

from iprox_lightning.analysis.retention import spearman  # noqa: E402


def test_parse_variant():
    v = variants.parse_variant("ipsvd/exact/rel1e-3/global/spare0@0.5+align")
    assert v["kind"] == "proxy" and v["align"] and v["rho"] == 0.5
    assert v["ipsvd"] == {"sparsity": 0.5, "method": "ipsvd", "mode": "exact", "damping_mode": "relative",
                          "damping": 1e-3, "allocation": "global", "keep_dense": variants.SPARE0}
    assert v["align_epochs"] is None  # --align-epochs
    assert variants.parse_variant("ipsvd/global@0.5+align5")["align_epochs"] == 5
    assert v["align_lr"] is None  # --align-lr
    v2 = variants.parse_variant("ipsvd/global@0.5+align2:1e-4")
    assert (v2["align"], v2["align_epochs"], v2["align_lr"], v2["rho"]) == (True, 2, 1e-4, 0.5)
    assert variants.parse_variant("ipsvd/global@0.5+align:3e-4")[("align_epochs")] is None
    assert variants.parse_variant("le@0.3") == {"key": "le@0.3", "kind": "le", "rho": 0.3, "align": False,
                                           "align_epochs": None, "align_lr": None, "fidelity": None,
                                           "task_align": {"model": {}, "data": {}}, "ipsvd": {}}
    f = variants.parse_variant("ipsvd/global@0.5+align2:1e-3+fid128")
    assert (f["align_epochs"], f["align_lr"], f["fidelity"], f["key"]) == (2, 1e-3, 128, "ipsvd/global@0.5+align2:1e-3+fid128")
    assert variants.parse_variant("ipsvd/global@0.5+align+fid64")["fidelity"] == 64
    assert variants.parse_variant("ipsvd/global@0.5+align")["fidelity"] is None
    assert variants.parse_variant("ipsvd/exact/global/drop2@0.3")["ipsvd"]["drop_blocks"] == 2
    assert variants.parse_variant("svd@0.7")["ipsvd"] == {"sparsity": 0.7, "method": "svd"}
    # an exact-IPSVD variant without /global pins uniform ranks, whatever the library's default allocation is
    assert variants.parse_variant("ipsvd/exact/rel1e-3@0.5")["ipsvd"]["allocation"] == "uniform"
    assert "allocation" not in variants.parse_variant("ipsvd/core@0.5")["ipsvd"]
    for bad, msg in (("ipsvd@0.5+align0", "aligns nothing"), ("ipsvd@0.5+align2:0", "> 0"), ("ipsvd@1.5", "sparsity"), ("le/exact@0.5", "no options"), ("foo@0.5", "method"),
                     ("ipsvd/zzz@0.5", "unknown option"), ("ipsvd", "RHO"),
                     ("ipsvd/drop0@0.5", "unknown option"), ("ipsvd/drop1@0.5+align", "cannot be aligned"),
                     ("ipsvd@0.5+align+fid0", "checks nothing")):
        with pytest.raises(ValueError, match=msg):
            variants.parse_variant(bad)


def test_parse_variant_issue22_levers():
    v = variants.parse_variant("ipsvd/exact/rel1e-3/global/infw/allprobe/up128@0.5")
    assert v["ipsvd"] == {"sparsity": 0.5, "method": "ipsvd", "mode": "exact", "damping_mode": "relative",
                          "damping": 1e-3, "allocation": "global", "rank_weighting": "influence",
                          "probe_labels": "all", "rank_multiple": 128, "rank_rounding": "up"}
    assert "fidelity_task" not in v and v["fidelity"] is None
    assert variants.parse_variant("ipsvd/global/infw0.5@0.5")["ipsvd"]["rank_weight_mix"] == 0.5
    assert "rank_weight_mix" not in variants.parse_variant("ipsvd/global/infw@0.5")["ipsvd"]
    assert variants.parse_variant("ipsvd/exact/up64@0.3")["ipsvd"]["allocation"] == "uniform"  # up under uniform ranks
    t = variants.parse_variant("ipsvd/global@0.5+align2:1e-3+fidtask128")
    assert (t["align_epochs"], t["align_lr"], t["fidelity"], t["fidelity_task"]) == (2, 1e-3, 128, True)
    assert t["key"] == "ipsvd/global@0.5+align2:1e-3+fidtask128" and variants.parse_variant(t["key"]) == t
    assert variants.parse_variant("ipsvd/global@0.5+align+fidtask64")["fidelity"] == 64
    assert "fidelity_task" not in variants.parse_variant("ipsvd/global@0.5+align+fid64")
    for bad, msg in (("ipsvd/exact/infw@0.5", "add /global"), ("ipsvd/global/infw2@0.5", "unknown option"),
                     ("ipsvd/global/up0@0.5", "unknown option"), ("ipsvd/global/upx@0.5", "unknown option"),
                     ("ipsvd/global@0.5+align+fidtask0", "checks nothing"), ("ipsvd/global@0.5+fidtask8", "RHO")):
        with pytest.raises(ValueError, match=msg):
            variants.parse_variant(bad)


def test_parse_variant_task_alignment_suffixes():
    """Issue 22's suffixes after +align: what each sets in the build stage's ProxyAlignModule / SFTDataModule."""
    v = variants.parse_variant("ipsvd/exact/rel1e-3/global@0.5+align2:1e-3+val+valg1+score0.5")
    assert (v["align"], v["align_epochs"], v["align_lr"], v["fidelity"], v["rho"]) == (True, 2, 1e-3, None, 0.5)
    assert v["task_align"] == {"model": {"val_grad_weight": 1.0, "score_weight": 0.5},
                               "data": {"mix_val_train": 1, "val_train_fraction": 0.5}}
    assert v["ipsvd"]["allocation"] == "global"
    v = variants.parse_variant("ipsvd@0.3+align+scorelist2e-1+worst+vt0.25+val3+fid64")
    assert v["fidelity"] == 64 and v["align_lr"] is None
    assert v["task_align"] == {"model": {"score_weight": 0.2, "score_loss": "listwise", "task_reduction": "max"},
                               "data": {"val_train_fraction": 0.25, "mix_val_train": 3}}
    assert variants.parse_variant("ipsvd@0.5+align+valg0.1")["task_align"] == {
        "model": {"val_grad_weight": 0.1}, "data": {"val_train_fraction": 0.5}}
    assert variants.parse_variant("ipsvd@0.5+align+fid8")["task_align"] == {"model": {}, "data": {}}
    # +data<N>: the alignment split's size alone (no validation share set apart)
    assert variants.parse_variant("ipsvd@0.5+align1:3e-4+data600")["task_align"] == {
        "model": {}, "data": {"align_examples": 600}}
    assert variants.parse_variant("ipsvd@0.5+align+data600+valg1")["task_align"] == {
        "model": {"val_grad_weight": 1.0}, "data": {"align_examples": 600, "val_train_fraction": 0.5}}
    for bad, msg in (("ipsvd@0.5+align+val+val", "given twice"), ("ipsvd@0.5+align+score1+scorelist1", "given twice"),
                     ("ipsvd@0.5+align+worst", "add \\+valg"), ("ipsvd@0.5+align+vt0.3", "add \\+val"),
                     ("ipsvd@0.5+align+score0", "> 0"), ("ipsvd@0.5+align+score", "> 0"),
                     ("ipsvd@0.5+align+vt1+valg1", "in \\(0, 1\\)"), ("ipsvd@0.5+align+valgx", "unknown alignment suffix"),
                     ("ipsvd@0.5+align+val0", "mixes nothing"), ("ipsvd@0.5+align+val1.5", "copies"),
                     ("ipsvd@0.5+align+worst2+valg1", "no value"), ("ipsvd@0.5+align+fid1.5", "number of examples"),
                     ("ipsvd@0.5+valg1", "RHO"), ("le@0.5+align+valg1", "no options"),
                     ("ipsvd@0.5+align+data0", "number of alignment examples"),
                     ("ipsvd@0.5+align+data1.5", "number of alignment examples"),
                     ("ipsvd@0.5+align+data", "number of alignment examples")):
        with pytest.raises(ValueError, match=msg):
            variants.parse_variant(bad)


def test_issue22_rows_reach_the_build_stage_config(tmp_path, monkeypatch, capsys):
    """The build stage's overlay of each new row (captured, nothing run) names the new options, and the shipped
    build_proxy.yaml with that overlay validates against the code's signatures (``--print_config``)."""
    from iprox_lightning.cli import main as cli

    seen = {}

    def capture(self, key, subcommand, configs, overlay, fingerprint, done, clean=None):
        seen[key] = (configs, overlay)
        self.ran.append(key)
        return {}

    monkeypatch.setattr(fv2.Stages, "run", capture)
    infw, fidtask = "ipsvd/exact/global/infw0.5/allprobe/up4@0.5", "ipsvd/exact/global@0.5+align1+fidtask8"
    fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--sample", "10", "--max-length", "48",
              "--no-warmup", "--variants", infw, fidtask, "--align-val-per-task", "2", "--out", str(tmp_path / "v2"),
              "--dry-run"])
    cb = seen[f"build:{infw}"][1]["trainer"]["callbacks"][0]["init_args"]
    assert (cb["rank_weighting"], cb["rank_weight_mix"], cb["probe_labels"], cb["rank_multiple"], cb["rank_rounding"]) \
        == ("influence", 0.5, "all", 4, "up")
    data = seen[f"build:{infw}"][1]["data"]["init_args"]
    assert data["validation"].endswith("validation.jsonl") and data["val_per_task"] == 2  # the weights' tasks
    model = seen[f"build:{fidtask}"][1]["model"]["init_args"]
    assert (model["fidelity_examples"], model["fidelity_per_task"], model["monitor"]) == (8, True,
                                                                                          "val/fidelity_worst_loss")
    for key in (f"build:{infw}", f"build:{fidtask}"):
        configs, overlay = seen[key]
        ov = tmp_path / f"{fv2.dir_name(key)}.yaml"
        ov.write_text(yaml.safe_dump(overlay))
        with pytest.raises(SystemExit) as e:
            cli(["fit", *[a for c in [*configs, ov] for a in ("--config", str(c))], "--print_config"])
        printed = capsys.readouterr().out
        assert e.value.code in (0, None), printed
        cfg = yaml.safe_load(printed)
        assert cfg["model"]["init_args"]["monitor"] == overlay["model"]["init_args"].get("monitor", "val/loss")


def test_task_alignment_variant_reaches_the_build_stage(tmp_path, monkeypatch, capsys):
    """The build stage of a +align+val+valg+score row gets the options in its overlay (and the stages' fingerprints of
    a row without them do not change), and the shipped build_proxy.yaml takes that overlay. Nothing runs: the stage
    runner is replaced by a recorder."""
    ran = {}

    def record(self, key, subcommand, configs, overlay, fingerprint, done, clean=None):
        ran[key] = (configs, overlay, fingerprint)
        return {}

    monkeypatch.setattr(fv2.Stages, "run", record)
    rows = ["ipsvd@0.5+align+val2+valg1+score0.5+worst", "ipsvd@0.5+align", "ipsvd@0.5+align1+data30"]
    fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--builtin-size", "300",
              "--sample", "16", "--no-warmup", "--no-unwarmed", "--out", str(tmp_path), "--dry-run", "--variants", *rows])
    _, overlay, fp = ran["build:" + rows[0]]
    model, data = overlay["model"]["init_args"], overlay["data"]["init_args"]
    assert (model["val_grad_weight"], model["score_weight"], model["task_reduction"]) == (1.0, 0.5, "max")
    assert (data["mix_val_train"], data["val_train_fraction"]) == (2, 0.5) and data["validation"]
    assert fp["model"] == model and fp["data"] == data
    _, plain, _ = ran["build:" + rows[1]]
    keys = {"val_grad_weight", "score_weight", "task_reduction", "val_train_fraction", "mix_val_train"}
    assert not keys & (set(plain["model"]["init_args"]) | set(plain["data"]["init_args"]))
    assert "align_examples" not in plain["data"]["init_args"]
    _, more, more_fp = ran["build:" + rows[2]]
    assert more["data"]["init_args"]["align_examples"] == 30 and more_fp["data"]["align_examples"] == 30
    assert not keys & (set(more["model"]["init_args"]) | set(more["data"]["init_args"]))
    from iprox_lightning.cli import main as cli

    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay))
    with pytest.raises(SystemExit) as e:
        cli(["fit", "--config", str(fv2.ROOT / "configs" / "build_proxy.yaml"), "--config", str(path), "--print_config"])
    assert e.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["val_grad_weight"] == 1.0
    assert printed["data"]["init_args"]["mix_val_train"] == 2


def test_canonical_fingerprint_ignores_comments_and_logging_only():
    cfg = "# stage\ntrainer:\n  max_epochs: 1\n  logger: false\nmodel:\n  lr: 0.001\n"
    fp = lambda text, **kw: json.dumps({"config": text, "data": {"n": 3}, **kw}, sort_keys=True)  # noqa: E731
    same = ledger.canonical_fingerprint
    edited = "# stage, now logging\ntrainer:\n  max_epochs: 1\n  logger:\n    class_path: TensorBoardLogger\n" \
             "  default_root_dir: elsewhere\nmodel:\n  lr: 0.001  # same value\n"
    assert same(fp(cfg)) == same(fp(edited))
    assert same(fp(cfg)) != same(fp(cfg.replace("max_epochs: 1", "max_epochs: 2")))
    assert same(fp(cfg)) != same(fp(cfg.replace("0.001", "0.01")))
    assert same(fp(cfg)) != same(fp(cfg, extra=1))
    nested = lambda text: json.dumps({"model": {"config": text}})  # noqa: E731
    assert same(nested(cfg)) == same(nested(edited))


def test_stratified_sample_shares_and_determinism():
    recs = [{"id": f"a{i}", "source": "a"} for i in range(60)] + [{"id": f"b{i}", "source": "b"} for i in range(30)] \
        + [{"id": f"c{i}", "source": "c"} for i in range(10)]
    s = fv2.stratified_sample(recs, 20, seed=3)
    counts = {k: sum(r["source"] == k for r in s) for k in "abc"}
    assert counts == {"a": 12, "b": 6, "c": 2}  # exact proportional shares
    assert len({r["id"] for r in s}) == 20
    assert [r["id"] for r in s] == [r["id"] for r in fv2.stratified_sample(recs, 20, seed=3)]
    # largest remainder: 7 of (60, 30, 10) -> exact 4.2, 2.1, 0.7 -> 4, 2, 1
    s7 = fv2.stratified_sample(recs, 7, seed=0)
    assert {k: sum(r["source"] == k for r in s7) for k in "abc"} == {"a": 4, "b": 2, "c": 1}
    with pytest.raises(ValueError, match="sample of 101"):
        fv2.stratified_sample(recs, 101, seed=0)


def test_sample_is_stratified_by_the_pools_source_and_an_out_refuses_another_draw(tmp_path):
    """Issue 21: the canonical records drop ``source``; the sample reads it beside them and shares the draw by it
    (largest remainder, brute-force counts); an OUT made from another draw (or from before the option: the uniform
    draw) refuses the run instead of re-making its stages over the old ones."""
    import argparse

    from iprox_lightning.data.sources import read_records
    from iprox_lightning.io.records import DataFormatError

    pool = tmp_path / "pool.jsonl"
    rows = [{"id": f"{s}{i}", "source": s, "instruction": "q", "response": "r"} for s, n in (("a", 30), ("b", 10))
            for i in range(n)]
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = read_records(pool)
    assert "source" not in recs[0]
    args = argparse.Namespace(stratify_by="source", pool=str(pool), sample=8, seed=0, dry_run=False)
    (tmp_path / "new").mkdir()
    st = ledger.Stages(tmp_path / "new", None, print)
    st.state["stages"]["warmup"] = {"fingerprint": "{}"}  # the warm-up does not depend on the sample
    sample = fv2.draw_sample(recs, args, False, st)
    assert [r["source"] for r in sample].count("a") == 6 and [r["source"] for r in sample].count("b") == 2
    assert json.loads((tmp_path / "new" / "state.json").read_text())["sample_strata"] == "source"
    with pytest.raises(SystemExit, match="--stratify-by source to continue"):
        fv2.draw_sample(recs, argparse.Namespace(**{**vars(args), "stratify_by": "none"}), False, st)
    # an OUT from before the option holds the uniform draw: the one-stratum draw of the canonical records
    (tmp_path / "old").mkdir()
    old = ledger.Stages(tmp_path / "old", None, print)
    old.state["stages"]["score:target"] = {"fingerprint": "{}"}
    with pytest.raises(SystemExit, match=r"--stratify-by none \(a uniform draw\)"):
        fv2.draw_sample(recs, args, False, old)
    uniform = fv2.draw_sample(recs, argparse.Namespace(**{**vars(args), "stratify_by": "none"}), False, old)
    assert [r["id"] for r in uniform] == [r["id"] for r in fv2.stratified_sample(recs, 8, 0, by="source")]
    # a pool row without the field: named
    pool.write_text(pool.read_text() + json.dumps({"id": "c0", "instruction": "q", "response": "r"}) + "\n")
    (tmp_path / "bad").mkdir()
    with pytest.raises(DataFormatError, match=r"pool.jsonl, line 41: no field 'source'"):
        fv2.draw_sample(read_records(pool), args, False, ledger.Stages(tmp_path / "bad", None, print))


def test_split_halves_alternate_within_each_task():
    recs = [{"id": str(i), "category": t} for i, t in enumerate("aabab")]
    cats = [r["category"] for r in fv2.split_halves(recs)]
    assert cats == ["a.half0", "a.half1", "b.half0", "a.half0", "b.half1"]


def test_suite_scores_average_the_two_halves():
    assert [fv2.suite_of(t) for t in ("mmlu.half0", "bbh.half1", "tydiqa", "a.b.half0", "x.half2")] == \
        ["mmlu", "bbh", "tydiqa", "a.b", "x.half2"]
    table = {"id": ["a", "b"], "tasks": {"bbh.half0": np.array([1.0, 2.0]), "bbh.half1": np.array([3.0, 0.0]),
                                         "mmlu.half0": np.array([0.5, 0.5]), "mmlu.half1": np.array([0.1, -0.5])}}
    assert fv2.suite_scores(table) == {"a": {"bbh": 2.0, "mmlu": 0.3}, "b": {"bbh": 1.0, "mmlu": 0.0}}
    assert fv2.suite_scores(table, "half1") == {"a": {"bbh": 3.0, "mmlu": 0.1}, "b": {"bbh": 0.0, "mmlu": -0.5}}


def test_headline_and_per_task_table_are_chosen_by_the_worst_task():
    def row(variant, rho, worst, pooled):
        pt = {s: {"spearman": v, "spearman_length_partialled": v - 0.1, "top5%": 0.5, "top10%": 0.5,
                  "spearman_ci": [v - 0.05, v + 0.05]} for s, v in zip(("mmlu", "bbh"), (0.6, worst))}
        return {"variant": variant, "rho": rho, "spearman": pooled, "per_task": pt,
                "worst_task": {"spearman": worst, "spearman_task": "bbh", "spearman_length_partialled": worst - 0.1,
                               "spearman_length_partialled_task": "bbh"}}
    rows = [row("target_unwarmed", None, 0.42, 0.51), row("pooled-best", 0.3, 0.17, 0.61), row("worst-best", 0.3, 0.39, 0.60)]
    summary = {"meta": {"suites": ["mmlu", "bbh"], "target_split_half_per_task": {
        "mmlu": {"spearman": 0.997}, "bbh": {"spearman": 0.91}}}, "rows": rows}
    assert fv2.headline_row(rows)["variant"] == "worst-best"  # a reference row is never the headline
    head = fv2.headline(summary)[0]
    assert head.startswith("**Headline (the worst task, not the pooled score): `worst-best`** — worst task BBH +0.39 "
                           "[+0.34, +0.44]") and "off-the-shelf target (full size, not warmed up): MMLU +0.60 / BBH +0.42" in head
    table = fv2.per_task_table(summary)
    assert table[0].startswith("| variant | ρ | MMLU Spearman | BBH Spearman | worst task |")
    assert [l.split(" | ")[0] for l in table[2:]] == ["| target_unwarmed", "| **worst-best**", "| pooled-best"]
    assert "**+0.390 (BBH)**" in table[3]


def test_row_metrics_and_paired_difference_against_brute_force():
    rng = np.random.default_rng(0)
    n = 60
    ids = [f"x{i}" for i in range(n)]
    length = rng.integers(5, 50, n).astype(float)
    target = -length + rng.normal(0, 10, n)
    proxy = target + rng.normal(0, 5, n)
    maps = [dict(zip(ids, v)) for v in (proxy, target, length)]
    m = fv2.row_metrics(*maps, None, {}, n_boot=50, seed=0)
    assert m["spearman"] == pytest.approx(spearman(proxy, target))
    # partialled = Pearson of the residuals of ranks regressed on the length ranks (least squares)
    from iprox_lightning.analysis.retention import rankdata

    rp, rt, rc = rankdata(proxy), rankdata(target), rankdata(length)
    X = np.stack([np.ones(n), rc], 1)
    res = [r - X @ np.linalg.lstsq(X, r, rcond=None)[0] for r in (rp, rt)]
    assert m["spearman_length_partialled"] == pytest.approx(np.corrcoef(*res)[0, 1], abs=1e-10)
    k = round(0.05 * n)
    top_p, top_t = set(np.argsort(-proxy)[:k]), set(np.argsort(-target)[:k])
    assert m["top5_overlap"] == pytest.approx(len(top_p & top_t) / k)
    assert m["spearman_ci"][0] <= m["spearman"] <= m["spearman_ci"][1]
    # sets given (as `select` wrote them): overlap is their intersection over the target's set
    m2 = fv2.row_metrics(*maps, {0.05: {"x1", "x2"}, 0.10: {"x1"}}, {0.05: {"x2", "x3"}, 0.10: {"x4", "x5"}}, 10, 0)
    assert (m2["top5_overlap"], m2["top10_overlap"]) == (0.5, 0.0)
    d = fv2.paired_difference(maps[0], {i: -v for i, v in maps[2].items()}, maps[1], maps[2], 50, 0)
    assert d["spearman"] == pytest.approx(spearman(proxy, target) - spearman(-length, target))


def test_end_to_end_builtin_resume_and_changed_setting(tmp_path):
    out = tmp_path / "v2"
    argv = ["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--sample", "30", "--max-length", "48",
            "--no-warmup", "--variants", "ipsvd/exact/rel1e-3/global@0.5", "le@0.5", "--bootstrap", "50",
            "--threads", "1", "--out", str(out), "--in-process"]
    s = fv2.main(argv)
    rows = {r["variant"]: r for r in s["rows"]}
    assert set(rows) == {"length_sort", "random", "ipsvd/exact/rel1e-3/global@0.5", "le@0.5"}
    assert s["meta"]["n_scored"] == 30 and s["meta"]["target_warmed_up"] is False
    assert s["meta"]["n_validation"] == 12
    # the summary's Spearman is recomputed from the product's own score tables
    t = fv2.score_arrays(out / "scores" / "target" / "scores.parquet")
    p = fv2.score_arrays(out / "scores" / fv2.dir_name("ipsvd/exact/rel1e-3/global@0.5") / "scores.parquet")
    tm, pm = fv2.as_map(t), fv2.as_map(p)
    ids = sorted(tm)
    assert rows["ipsvd/exact/rel1e-3/global@0.5"]["spearman"] == pytest.approx(
        spearman(np.array([pm[i] for i in ids]), np.array([tm[i] for i in ids])))
    # per task: each suite's score is the mean of its two halves; Spearman by scipy, the rest by the library function
    from scipy.stats import spearmanr

    from iprox_lightning.analysis.retention import per_task_retention, worst_task

    suites = s["meta"]["suites"]
    assert suites == list(s["meta"]["validation_counts"]) and len(suites) == 2
    ts, ps, length = fv2.suite_scores(t), fv2.suite_scores(p), dict(zip(t["id"], t["n_tokens"]))
    row = rows["ipsvd/exact/rel1e-3/global@0.5"]
    for suite in suites:
        half = lambda tab, i, h: float(tab["tasks"][f"{suite}.{h}"][tab["id"].index(i)])  # noqa: E731
        assert row["per_task"][suite]["spearman"] == pytest.approx(spearmanr(
            [(half(p, i, "half0") + half(p, i, "half1")) / 2 for i in ids],
            [(half(t, i, "half0") + half(t, i, "half1")) / 2 for i in ids]).statistic, abs=1e-12)
        lo, hi = row["per_task"][suite]["spearman_ci"]
        assert lo <= row["per_task"][suite]["spearman"] <= hi
        assert set(row["per_task"][suite]) >= {"spearman_length_partialled", "top5%", "top10%", "top5%_ci", "top10%_ci",
                                               "spearman_length_partialled_ci"}
    want = per_task_retention(ps, ts, length, tasks=suites)
    assert {k: {m: v[m] for m in want[k]} for k, v in row["per_task"].items()} == want
    assert row["worst_task"] == worst_task(row["per_task"])
    # the length sort ranks every suite by length; the split-half ceiling per suite compares the target's halves
    assert rows["length_sort"]["per_task"][suites[0]]["spearman"] == pytest.approx(
        spearmanr([-length[i] for i in ids], [ts[i][suites[0]] for i in ids]).statistic, abs=1e-12)
    assert s["meta"]["target_split_half_per_task"][suites[1]]["spearman"] == pytest.approx(spearmanr(
        [fv2.suite_scores(t, "half0")[i][suites[1]] for i in ids],
        [fv2.suite_scores(t, "half1")[i][suites[1]] for i in ids]).statistic, abs=1e-12)
    md = (out / "summary.md").read_text()
    assert md.split("\n")[2].startswith(f"**Headline (the worst task, not the pooled score): `{fv2.headline_row(s['rows'])['variant']}`")
    assert "| variant | ρ | " + " | ".join(f"{x} Spearman" for x in suites) + " | worst task |" in md
    assert rows["ipsvd/exact/rel1e-3/global@0.5"]["params"] <= 1.02 * rows["le@0.5"]["params"]
    assert rows["ipsvd/exact/rel1e-3/global@0.5"]["allocation"] == "global"
    # the time column: each row's scoring-stage CPU seconds over the target's, from the ledger's records
    stages = json.loads((out / "state.json").read_text())["stages"]
    for k in ("ipsvd/exact/rel1e-3/global@0.5", "le@0.5"):
        assert rows[k]["scoring_time_ratio"] == pytest.approx(stages[f"score:{k}"]["cpu_s"] / stages["score:target"]["cpu_s"])
    assert json.loads((out / "summary.json").read_text())["rows"] == json.loads(json.dumps(s["rows"]))
    assert (out / "summary.md").read_text().count("\n| ") >= 5
    state = json.loads((out / "state.json").read_text())
    assert set(state["stages"]) == {"score:target", "build:ipsvd/exact/rel1e-3/global@0.5",
                                    "score:ipsvd/exact/rel1e-3/global@0.5", "build:le@0.5", "score:le@0.5"}
    # same command again: nothing re-runs
    assert fv2.main(argv + ["--dry-run"])["would_run"] == []
    # a changed setting re-runs what depends on it (here everything: the scored examples changed)
    changed = fv2.main([a if a != "48" else "40" for a in argv] + ["--dry-run"])["would_run"]
    assert set(changed) == set(state["stages"])
    # a later invocation listing other variants keeps the earlier rows; with the proxy directory gone, the row's
    # build facts come from the previous summary (same build fingerprint), never from another setting
    shutil.rmtree(out / "proxies" / fv2.dir_name("ipsvd/exact/rel1e-3/global@0.5"))
    later = argv[:argv.index("--variants")] + ["--variants", "le@0.5"] + argv[argv.index("--bootstrap"):]
    s2 = fv2.main(later + ["--summary-only"])
    rows2 = {r["variant"]: r for r in s2["rows"]}
    assert set(rows2) == set(rows)
    kept = rows2["ipsvd/exact/rel1e-3/global@0.5"]
    assert kept["params"] == rows["ipsvd/exact/rel1e-3/global@0.5"]["params"]
    assert kept["allocation"] == "global" and kept["spearman"] == rows["ipsvd/exact/rel1e-3/global@0.5"]["spearman"]
    assert kept["built_commit"] == state["stages"]["build:ipsvd/exact/rel1e-3/global@0.5"]["commit"]
    prev = json.loads((out / "summary.json").read_text())
    prev["stages"]["build:ipsvd/exact/rel1e-3/global@0.5"]["fingerprint"] = "another setting"
    (out / "summary.json").write_text(json.dumps(prev))
    s3 = fv2.main(later + ["--summary-only"])
    assert {r["variant"]: r for r in s3["rows"]}["ipsvd/exact/rel1e-3/global@0.5"]["params"] is None
    # --build-only: the proxy alone (what a gradient store needs), no score table, so no row; the references are kept
    only = later[:later.index("--variants")] + ["--variants", "le@0.3"] + later[later.index("--bootstrap"):]
    assert fv2.main(only + ["--build-only"]) == {"built": ["le@0.3"]}
    stages = json.loads((out / "state.json").read_text())["stages"]
    assert "build:le@0.3" in stages and "score:le@0.3" not in stages
    assert stages["score:target"] == state["stages"]["score:target"]  # not re-run
    assert (out / "proxies" / fv2.dir_name("le@0.3") / "config.json").exists()
    assert fv2.main(only + ["--build-only", "--dry-run"])["would_run"] == []


def test_splice_docs_replaces_only_the_generated_section(tmp_path):
    begin, end = fv2.docs_markers(tmp_path / "fidelity_v2")
    doc = tmp_path / "B.md"
    doc.write_text(f"# Page\nintro\n{begin}\nold table\n{end}\nreading\n")
    ledger.splice_docs(doc, "# Proxy fidelity v2\n| a | b |\n", begin, end)
    assert doc.read_text() == f"# Page\nintro\n{begin}\n| a | b |\n{end}\nreading\n"
    (tmp_path / "C.md").write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        ledger.splice_docs(tmp_path / "C.md", "x", begin, end)


def test_end_to_end_builtin_block_drop_and_fidelity_monitor_rows(tmp_path):
    """The two lever rows go through the product's stages: a block-dropping IPSVD proxy (the manifest's block_drop
    reaches the row, parameters match the requested budget) and an aligned proxy whose keep_best monitors the
    ranking fidelity on held-out pool examples (the row carries that check's history and its overlap with the
    scored sample)."""
    out = tmp_path / "v2"
    # the built-in model has 2 blocks: dropping one leaves room for IPSVD only at a high sparsity
    drop, fid = "ipsvd/exact/rel1e-3/global/drop1@0.8", "ipsvd/exact/rel1e-3/global@0.5+align1+fid8"
    s = fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--sample", "30",
                  "--max-length", "48", "--no-warmup", "--variants", drop, fid, "--bootstrap", "20",
                  "--align-val-per-task", "2", "--threads", "1", "--out", str(out), "--in-process"])
    rows = {r["variant"]: r for r in s["rows"]}
    man = json.loads((out / "proxies" / fv2.dir_name(drop) / "iprox_proxy.json").read_text())
    assert rows[drop]["block_drop"]["dropped"] == man["block_drop"]["dropped"] and len(man["block_drop"]["dropped"]) == 1
    assert rows[drop]["params"] == man["params_after"]
    assert 0.98 * man["params_requested"] <= rows[drop]["params"] <= man["params_requested"]
    man = json.loads((out / "proxies" / fv2.dir_name(fid) / "iprox_proxy.json").read_text())
    al = man["alignment"]
    assert (al["fidelity_examples"], al["monitor"]) == (8, "val/fidelity_loss")
    f = rows[fid]["alignment_fidelity"]
    assert f["history"] == al["fidelity"]["history"] and f["history"][0]["step"] == 0
    sample = {json.loads(line)["id"] for line in (out / "sample.jsonl").read_text().splitlines()}
    assert f["overlap_with_sample"] == len(sample & set(al["fidelity"]["ids"]))
    best = min(al["validation_history"], key=lambda h: h["val/fidelity_loss"])
    assert al["best"]["step"] == best["step"] and rows[fid]["align_monitor"] == "val/fidelity_loss"


def test_stage_with_changed_settings_keeps_old_output_until_it_succeeds(tmp_path):
    """A stage re-run for changed settings moves the old output aside; when the new run fails (here: a config file
    that does not exist, as a wrong default path would) the old output comes back whole and nothing is left over."""
    out = tmp_path / "out"
    out.mkdir()
    warmed = out / "warmed"
    warmed.mkdir()
    (warmed / "config.json").write_text('{"old": 1}')
    st = ledger.Stages(out, None, lambda m: None, in_process=True)
    st.state["stages"]["warmup"] = {"fingerprint": json.dumps({"model": "a"})}
    with pytest.raises(RuntimeError, match="stage warmup failed"):
        st.run("warmup", "fit", [tmp_path / "missing.yaml"], {}, {"model": "b"}, warmed / "config.json", clean=warmed)
    assert json.loads((warmed / "config.json").read_text()) == {"old": 1}
    assert not (out / "warmed.replaced").exists()
    assert json.loads(st.state["stages"]["warmup"]["fingerprint"]) == {"model": "a"}  # the record is unchanged


def test_fingerprint_paths_compare_by_the_file_they_reach(tmp_path):
    real = tmp_path / "model.gguf"
    real.write_text("x")
    link = tmp_path / "link.gguf"
    link.symlink_to(real)
    a = json.dumps({"model": str(real), "seed": 0})
    assert ledger.canonical_fingerprint(a) == ledger.canonical_fingerprint(json.dumps({"model": str(link), "seed": 0}))
    assert ledger.canonical_fingerprint(a) != ledger.canonical_fingerprint(json.dumps({"model": str(real), "seed": 1}))
    other = tmp_path / "other.gguf"
    other.write_text("x")
    assert ledger.canonical_fingerprint(a) != ledger.canonical_fingerprint(json.dumps({"model": str(other), "seed": 0}))


@pytest.mark.parametrize("option", ["--model", "--pool", "--eval-dir"])
def test_a_missing_local_input_is_refused_before_any_stage(tmp_path, option, capsys):
    import effect

    # the other two inputs exist, so the error names this one wherever the checkout is (the defaults are ../shared)
    present = {"--model": tmp_path / "m.gguf", "--pool": tmp_path / "p.jsonl", "--eval-dir": tmp_path / "eval"}
    present["--model"].write_text("x")
    present["--pool"].write_text("{}\n")
    present["--eval-dir"].mkdir()
    others = [a for o, p in present.items() if o != option for a in (o, str(p))]
    for parse in (fv2.parse_args, effect.parse_args):
        with pytest.raises(SystemExit):
            parse(["--out", str(tmp_path / "out"), *others, option, str(tmp_path / "nowhere" / "x.gguf")])
        assert f"{option} {tmp_path / 'nowhere' / 'x.gguf'}: no such file or directory" in capsys.readouterr().err
    # a hub id and the built-in demo are not paths
    assert fv2.parse_args(["--out", str(tmp_path), "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--pool",
                           "builtin", "--eval-dir", "builtin"]).model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_kl_suffix_sets_only_the_kl_weight():
    v = variants.parse_variant("ipsvd/exact/rel1e-3/global@0.5+align2:3e-4+kl0")
    assert v["task_align"] == {"model": {"kl_weight": 0.0}, "data": {}}  # no validation split: not a task term
    assert variants.parse_variant("ipsvd/global@0.5+align+kl0.01+fidtask64")["task_align"]["model"] == {"kl_weight": 0.01}
    with pytest.raises(ValueError, match=r"\+kl needs a weight >= 0"):
        variants.parse_variant("ipsvd/global@0.5+align+kl")
    with pytest.raises(ValueError, match=r"\+vt sets the validation share"):
        variants.parse_variant("ipsvd/global@0.5+align+kl0+vt0.3")


def test_tv_suffix_scores_stage_2_against_the_targets_validation_gradients():
    """``+tv``: ``proxy_validation: target`` for Stage 2's score term and fidelity check (no validation split of its
    own); it needs one of them; with ``+tval`` the proxy built with it is also scored that way."""
    v = variants.parse_variant("ipsvd/global@0.5+align+score1+tv+fidtask64+tval")
    assert v["task_align"] == {"model": {"score_weight": 1.0, "proxy_validation": "target"},
                               "data": {"val_train_fraction": 0.5}}
    assert v["build_key"] == "ipsvd/global@0.5+align+score1+tv+fidtask64" and v["fidelity"] == 64
    assert variants.parse_variant("ipsvd/global@0.5+align+tv+fid32")["task_align"] == {
        "model": {"proxy_validation": "target"}, "data": {}}
    for bad, msg in (("ipsvd/global@0.5+align+tv", r"add \+score<W> or \+fid"), ("ipsvd/global@0.5+align+tv2+fid8",
                                                                                   "takes no value")):
        with pytest.raises(ValueError, match=msg):
            variants.parse_variant(bad)


def test_tval_row_scores_the_shared_proxy_against_the_targets_validation_gradients(tmp_path):
    """``+tval``: the proxy is built once (the row without the suffix) and scored a second time with the target's
    validation gradients (``InfluenceScoringModule(validation_model=...)``); the suffix is refused where the proxy's
    layers are not the target's."""
    base = "ipsvd/exact/rel1e-3/global@0.5"
    v = variants.parse_variant(base + "+tval")
    assert v["build_key"] == base and v["target_validation"] and v["key"] == base + "+tval"
    assert {k: x for k, x in v.items() if k not in ("key", "build_key", "target_validation")} == \
        {k: x for k, x in variants.parse_variant(base).items() if k != "key"}
    for bad in ("le@0.5+tval", "ipsvd/exact/global/drop1@0.5+tval"):
        with pytest.raises(ValueError, match=r"\+tval needs the target's layers"):
            variants.parse_variant(bad)
    out = tmp_path / "v2"
    s = fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--sample", "30",
                  "--max-length", "48", "--no-warmup", "--variants", base, base + "+tval", "--bootstrap", "20",
                  "--threads", "1", "--out", str(out), "--in-process"])
    stages = json.loads((out / "state.json").read_text())["stages"]
    assert set(stages) == {"score:target", f"build:{base}", f"score:{base}", f"score:{base}+tval"}
    settings = json.loads((out / "scores" / fv2.dir_name(base + "+tval") / "settings.json").read_text())
    assert settings["scorer"]["validation_model"] == "other" and settings["config"]["validation_model"] == "builtin"
    own = json.loads((out / "scores" / fv2.dir_name(base) / "settings.json").read_text())
    assert own["scorer"]["validation_model"] == "scored" and "validation_model" not in own["config"]
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows[base + "+tval"]["validation_gradients"] == "target" and rows[base]["validation_gradients"] == "proxy"
    assert rows[base + "+tval"]["params"] == rows[base]["params"]
    assert rows[base + "+tval"]["spearman"] != rows[base]["spearman"]
    # per task, the +tval row minus the row of the same proxy, with a paired bootstrap CI
    (d,) = s["paired_per_task"]
    assert (d["a"], d["b"]) == (base + "+tval", base)
    for suite in s["meta"]["suites"]:
        want = rows[base + "+tval"]["per_task"][suite]["spearman"] - rows[base]["per_task"][suite]["spearman"]
        assert d[suite]["spearman"] == pytest.approx(want, abs=1e-12)
        lo, hi = d[suite]["spearman_ci"]
        assert lo <= hi
    assert "| row | − row | " in (out / "summary.md").read_text()


def test_last_suffix_builds_without_keep_best(tmp_path, monkeypatch):
    """``+last``: the factors of the last step (``keep_best: false``), so a task term trains for a fixed number of steps
    without a fidelity monitor; refused with ``+fid<N>`` (which would choose other factors) and with a value."""
    v = variants.parse_variant("ipsvd/global@0.5+align2:3e-4+valg1+last")
    assert v["task_align"] == {"model": {"val_grad_weight": 1.0, "keep_best": False},
                               "data": {"val_train_fraction": 0.5}} and v["fidelity"] is None
    assert variants.parse_variant("ipsvd/global@0.5+align+last")["task_align"] == {"model": {"keep_best": False},
                                                                                   "data": {}}
    for bad, msg in (("ipsvd/global@0.5+align+valg1+last+fidtask64", "would choose others"),
                     ("ipsvd/global@0.5+align+last2", "takes no value")):
        with pytest.raises(ValueError, match=msg):
            variants.parse_variant(bad)
    ran = {}
    monkeypatch.setattr(fv2.Stages, "run", lambda self, key, sub, configs, overlay, fp, done, clean=None:
                        ran.setdefault(key, (overlay, fp)) and {})
    row = "ipsvd@0.5+align+valg1+last"
    fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--builtin-size", "300",
              "--sample", "16", "--no-warmup", "--no-unwarmed", "--out", str(tmp_path), "--dry-run", "--variants", row])
    overlay, fp = ran["build:" + row]
    assert overlay["model"]["init_args"]["keep_best"] is False and fp["model"]["keep_best"] is False
    assert overlay["model"]["init_args"]["val_grad_weight"] == 1.0
    from iprox_lightning.alignment.module import AlignConfig

    assert AlignConfig(**{k: overlay["model"]["init_args"][k] for k in ("keep_best", "val_grad_weight")}).task_terms


def test_lever_rows_are_paired_per_task_with_the_row_they_change(tmp_path):
    """``lever_base``: a key without its suffixes after ``+align...`` (``+tval`` kept); the summary's
    ``paired_levers`` holds each lever row minus that row, per task, with a paired bootstrap CI."""
    assert variants.lever_base("ipsvd/exact/rel1e-3/global@0.5+align2:3e-4+valg1+last+tval") == \
        "ipsvd/exact/rel1e-3/global@0.5+align2:3e-4+tval"
    assert variants.lever_base("ipsvd@0.5+align+fid64") == "ipsvd@0.5+align"
    for plain in ("ipsvd@0.5+align2:3e-4", "ipsvd@0.5+align+tval", "ipsvd/exact/global@0.5", "le@0.5"):
        assert variants.lever_base(plain) is None
    base, lever = "ipsvd/exact/rel1e-3/global@0.5+align1", "ipsvd/exact/rel1e-3/global@0.5+align1+kl0"
    out = tmp_path / "v2"
    s = fv2.main(["--model", "builtin", "--pool", "builtin", "--eval-dir", "builtin", "--sample", "30",
                  "--max-length", "48", "--no-warmup", "--no-unwarmed", "--variants", base, lever, "--bootstrap", "20",
                  "--threads", "1", "--out", str(out), "--in-process"])
    rows = {r["variant"]: r for r in s["rows"]}
    (d,) = s["paired_levers"]
    assert (d["a"], d["b"]) == (lever, base)
    for suite in s["meta"]["suites"]:
        want = rows[lever]["per_task"][suite]["spearman"] - rows[base]["per_task"][suite]["spearman"]
        assert d[suite]["spearman"] == pytest.approx(want, abs=1e-12)
        lo, hi = d[suite]["spearman_ci"]
        assert lo <= hi
    assert "a Stage-2 lever row minus the row it changes" in (out / "summary.md").read_text()
