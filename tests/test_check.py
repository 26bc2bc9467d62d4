"""Issue 23.2: ``train.py check`` in minutes — a stratified, seeded validation sample; validation gradients and score
tables cached by fingerprint (a re-run, another pool sample or another method reuses them, a changed setting does
not); resume after an interrupted run; the time estimate; ``n`` an integer; the verdict on constructed numbers."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from iprox_lightning.analysis.verdict import check_verdict


# ------------------------------------------------------------------------------------------------ the verdict
def _row(name, spearman, per_task=None):
    r = {"proxy": name, "spearman": spearman}
    if per_task is not None:
        r["per_task"] = {t: {"spearman": v} for t, v in per_task.items()}
    return r


ALIGNED = {"target_model": "/m/warm", "achieved_sparsity": 0.5, "alignment": {"aligned": True, "lr": 1e-4, "steps": 90}}


def test_verdict_use_this_proxy_when_it_beats_every_baseline_on_every_task():
    rows = [_row("proxy (tracin)", 0.9, {"mmlu": 0.8, "bbh": 0.7}), _row("length sort (shortest first)", 0.5,
            {"mmlu": 0.6, "bbh": 0.69}), _row("layer extraction (ρ=0.50)", 0.4, {"mmlu": 0.3, "bbh": 0.2})]
    v = check_verdict(rows, manifest=ALIGNED, target="/m/warm")
    assert v["use"] is True and v["as_good"] == [] and v["next_step"] is None
    assert v["verdict"] == ("use this proxy: it ranks closer to the target than the length sort and Layer Extraction "
                            "(ρ=0.50) on every task (worst task bbh: Spearman 0.70 vs 0.69 for the best baseline)")


def test_verdict_names_each_task_a_free_baseline_does_as_well_on():
    # the numbers: length sort 0.75 and Layer Extraction 0.34 vs the proxy's 0.14 on mmlu; a tie counts
    rows = [_row("proxy (tracin)", 0.3, {"mmlu": 0.14, "bbh": 0.6}), _row("length sort (shortest first)", 0.7,
            {"mmlu": 0.75, "bbh": 0.6}), _row("layer extraction (ρ=0.50)", 0.3, {"mmlu": 0.34, "bbh": 0.1})]
    v = check_verdict(rows, manifest=ALIGNED, target="/m/warm")
    assert v["use"] is False
    assert [(a["baseline"][:6], a["task"]) for a in v["as_good"]] == [("length", "mmlu"), ("length", "bbh"),
                                                                      ("layer ", "mmlu")]
    assert v["verdict"] == ("do not use this proxy yet: as good or better, for free: the length sort on mmlu (0.75 vs "
                            "the proxy's 0.14); the length sort on bbh (0.60 vs the proxy's 0.60); Layer Extraction "
                            "(ρ=0.50) on mmlu (0.34 vs the proxy's 0.14); it keeps little of the target's ranking on "
                            "mmlu (Spearman 0.14 < 0.40)")
    assert v["weak"] == [{"task": "mmlu", "proxy_spearman": 0.14}] and v["passes"] == []
    # Layer Extraction does as well: keep more rank, or align longer at another lr (the recorded one named)
    assert v["next_step"] == ("keep more of each layer: rebuild with a lower --sparsity than 0.50 (e.g. 0.3), or align "
                              "longer or at another learning rate (this one: lr 0.0001, 90 steps); or select for "
                              "mmlu with the target's own gradients (python train.py build_store --model <target>, "
                              "then query)")
    # a margin lets a baseline within 0.05 of the proxy count as "as well" too: no more here
    assert len(check_verdict(rows, manifest=ALIGNED, margin=0.05)["as_good"]) == 3


def test_verdict_floor_a_task_the_proxy_keeps_little_of_fails_even_against_poor_baselines():
    # the SmolLM2 check of the rho = 0.5 proxy (README): it beat both free baselines on every task, but on BBH it kept
    # Spearman 0.28 of the target's ranking -- and its BBH selection fell below every random seed downstream
    rows = [_row("proxy (tracin)", 0.52, {"bbh": 0.279, "mmlu": 0.513, "tydiqa": 0.505}),
            _row("length sort (shortest first)", 0.46, {"bbh": -0.156, "mmlu": 0.462, "tydiqa": 0.404}),
            _row("layer extraction (ρ=0.50)", -0.08, {"bbh": 0.082, "mmlu": 0.122, "tydiqa": -0.110})]
    v = check_verdict(rows, manifest=ALIGNED, target="/m/warm")
    assert v["use"] is False and v["as_good"] == [] and v["passes"] == ["mmlu", "tydiqa"]
    assert v["weak"] == [{"task": "bbh", "proxy_spearman": 0.279}]
    assert v["verdict"] == ("do not use this proxy yet: it keeps little of the target's ranking on bbh (Spearman 0.28 "
                            "< 0.40) (it passes on mmlu, tydiqa)")
    assert v["next_step"] == ("keep more of each layer: rebuild with a lower --sparsity than 0.50 (e.g. 0.3), or align "
                              "longer or at another learning rate (this one: lr 0.0001, 90 steps); or select for bbh "
                              "with the target's own gradients (python train.py build_store --model <target>, then "
                              "query)")
    # the floor is a setting: at 0.25 (or off, -1) the same rows say "use this proxy"
    assert check_verdict(rows, manifest=ALIGNED, floor=0.25)["use"] is True
    assert check_verdict(rows, manifest=ALIGNED, floor=-1)["verdict"].startswith("use this proxy: ")


def test_verdict_a_task_kept_only_as_a_preference_for_short_responses_is_weak():
    # the rho = 0.5 proxy of the 512-example benchmark (exact tables, bench/results/fidelity_v2/summary.json.gz): MMLU
    # Spearman 0.62 over the sample but 0.02 among its 64 shortest responses; BBH 0.26 (weak as before)
    rows = [_row("proxy (tracin)", 0.6, {"mmlu": 0.62, "bbh": 0.45, "tydiqa": 0.53}),
            _row("length sort (shortest first)", 0.4, {"mmlu": 0.48, "bbh": -0.20, "tydiqa": 0.39})]
    # (value, shortest responses, share of the target's top 5% among them): tydiqa too few to judge by; and a task
    # whose top 5% is not made of short answers is not judged by them (the last rows)
    within = {"mmlu": (0.02, 64, 0.9), "bbh": (0.41, 64, 0.8), "tydiqa": (0.30, 12, 0.9)}
    for t, (v, n, share) in within.items():
        rows[0]["per_task"][t].update(spearman_within_shortest=v, shortest_n=n, target_top5_in_shortest=share)
    v = check_verdict(rows, manifest=ALIGNED, target="/m/warm")
    assert v["use"] is False and v["as_good"] == [] and v["passes"] == ["bbh", "tydiqa"]
    assert v["weak"] == [{"task": "mmlu", "proxy_spearman": 0.62, "within_shortest": 0.02, "shortest_n": 64}]
    assert v["verdict"] == ("do not use this proxy yet: it keeps little of the target's ranking on mmlu among its 64 "
                            "shortest responses (Spearman 0.02 < 0.40; 0.62 over all: a preference for short "
                            "responses, which the length sort has for free) (it passes on bbh, tydiqa)")
    assert "or select for mmlu with the target's own gradients" in v["next_step"]
    # a proxy already at 0.3 is told to go lower than that
    at03 = check_verdict(rows, manifest={**ALIGNED, "achieved_sparsity": 0.3})["next_step"]
    assert at03.startswith("keep more of each layer: rebuild with a lower --sparsity than 0.30 (e.g. 0.1)")
    rows[0]["per_task"]["mmlu"]["target_top5_in_shortest"] = 0.4
    assert check_verdict(rows, manifest=ALIGNED)["use"] is True
    rows[0]["per_task"]["mmlu"]["target_top5_in_shortest"] = 0.9
    # above the floor there (or the floor off), the whole-sample rule alone decides
    rows[0]["per_task"]["mmlu"]["spearman_within_shortest"] = 0.45
    assert check_verdict(rows, manifest=ALIGNED)["use"] is True
    assert check_verdict(rows, manifest=ALIGNED, floor=-1)["use"] is True


@pytest.mark.parametrize("manifest,target,baseline,starts", [
    ({"alignment": {"aligned": False}}, None, "length sort (shortest first)", "the proxy is not aligned"),
    (None, None, "length sort (shortest first)", "this model is not an IProX proxy"),
    (ALIGNED, "/m/base.gguf", "length sort (shortest first)", "the proxy was built from /m/warm, not from the checked "
                                                              "target /m/base.gguf: warm the target up first"),
    (ALIGNED, "/m/warm", "length sort (shortest first)", "the target's own ranking follows response length: warm"),
])
def test_verdict_next_step_follows_the_manifest(manifest, target, baseline, starts):
    rows = [_row("proxy (tracin)", 0.1, {"t": 0.1}), _row(baseline, 0.7, {"t": 0.7})]
    assert check_verdict(rows, manifest=manifest, target=target)["next_step"].startswith(starts)


def test_verdict_without_tasks_uses_the_pooled_row_and_nan_loses():
    v = check_verdict([_row("proxy (tracin)", 0.8), _row("length sort (shortest first)", 0.2)])
    assert v["use"] and v["verdict"].endswith("(pooled: Spearman 0.80 vs 0.20 for the best baseline)")
    v = check_verdict([_row("proxy (tracin)", math.nan, {"t": math.nan}), _row("length sort", 0.2, {"t": 0.2})])
    assert not v["use"] and v["as_good"][0]["task"] == "t"


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``builtin`` as the target and a saved copy of it as the 'proxy' (another identity, the same tokenizer), and a
    validation file with tasks of 30, 20 and 5 examples."""
    from iprox_lightning.data.synthetic import builtin_validation
    from iprox_lightning.models.builtin import builtin_model

    root = tmp_path_factory.mktemp("check_models")
    builtin_model(seed=1).save_pretrained(root / "proxy")
    recs = builtin_validation(30, seed=3)
    by = {}
    for r in recs:
        by.setdefault(r["category"], []).append(r)
    (fa, a), (fb, b) = list(by.items())[:2]
    rows = a[:30] + b[:20] + [{**r, "id": f"{r['id']}-c", "category": "third"} for r in a[:5]]
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, {fa: 30, fb: 20, "third": 5}


@pytest.fixture
def spy(monkeypatch):
    """Counts the validation-gradient passes and the scored batches of every InfluenceScorer."""
    from iprox_lightning.scoring.influence import InfluenceScorer

    calls = {"validation": 0, "score_batch": 0}
    collect, score = InfluenceScorer.collect_validation, InfluenceScorer.score_batch

    def counting_collect(self, *a, **kw):
        calls["validation"] += 1
        return collect(self, *a, **kw)

    def counting_score(self, *a, **kw):
        calls["score_batch"] += 1
        return score(self, *a, **kw)

    monkeypatch.setattr(InfluenceScorer, "collect_validation", counting_collect)
    monkeypatch.setattr(InfluenceScorer, "score_batch", counting_score)
    return calls


def _check(models, out, *extra):
    from iprox_lightning.cli import main

    root, _ = models
    row = main(["check", "--target", "builtin", "--proxy", str(root / "proxy"), "--validation", str(root / "val.jsonl"),
                "--sample", "24", "--batch_size", "8", "--val_per_task", "10", "--output_dir", str(out), *extra])
    return row, json.loads((out / "check.json").read_text())


def _actions(result):
    return {(e["model"], e["what"]): e["action"] for e in result["cache"]}


def test_check_stratified_sample_cached_gradients_and_estimate(models, tmp_path, spy, capsys):
    from iprox_lightning.data.splits import sample_per_task

    root, sizes = models
    row, res = _check(models, tmp_path)
    out = capsys.readouterr().out
    # stratified and seeded: exactly min(10, size) per task, the ids sample_per_task draws with seed 0, recorded
    v = res["validation"]
    assert v["counts"] == {t: min(10, n) for t, n in sizes.items()} and v["seed"] == 0 and v["val_per_task"] == 10
    recs = [json.loads(line) for line in (root / "val.jsonl").read_text().splitlines()]
    assert v["ids"] == sample_per_task([r["id"] for r in recs], [r["category"] for r in recs], 10, seed=0)
    assert spy == {"validation": 2, "score_batch": 6}  # target and proxy: 3 batches of 8 each
    assert _actions(res) == {(m, w): "computed" for m in ("target", "proxy") for w in ("validation gradients", "scores")}
    # n is an integer, in the result and in the printed table; the estimate was printed before the rest ran
    assert row["n"] == 24 and isinstance(row["n"], int) and "| proxy (tracin) | 24 | " in out
    # labelled for what it is (issue 65: on the README recipe it said 41 min and took 25)
    assert res["estimate_s"] is not None and "the rest: at most ~" in out and ", a rough upper bound (" in out
    assert out.index("the rest: at most") < out.index("check: target: validation gradients computed")
    assert f"check: wrote {tmp_path / 'check.json'}" in out and "\nverdict: " in out

    # the same check again: nothing computed
    spy.update(validation=0, score_batch=0)
    row2, res2 = _check(models, tmp_path)
    assert spy == {"validation": 0, "score_batch": 0} and set(_actions(res2).values()) == {"reused"}
    assert row2["spearman"] == row["spearman"] and row2["per_task"] == row["per_task"]
    # another pool sample and another method: the validation gradients are reused, the scores are new
    for extra in (["--seed", "0", "--sample", "16"], ["--method", "kfac"]):
        spy.update(validation=0, score_batch=0)
        _, res3 = _check(models, tmp_path, *extra)
        assert spy["validation"] == 0 and spy["score_batch"] > 0, extra
        assert _actions(res3) == {**{(m, "validation gradients"): "reused" for m in ("target", "proxy")},
                                  **{(m, "scores"): "computed" for m in ("target", "proxy")}}
    # a changed validation sample never reuses the old gradients
    spy.update(validation=0, score_batch=0)
    _, res4 = _check(models, tmp_path, "--val_per_task", "4")
    assert spy["validation"] == 2 and res4["validation"]["counts"] == {t: 4 for t in sizes}


def test_check_resumes_after_an_interrupted_run(models, tmp_path, spy, monkeypatch):
    import iprox_lightning.workflow.check as check_cmd

    real = check_cmd._load

    def crash_on_proxy(path):
        if path != "builtin":
            raise KeyboardInterrupt("stopped while loading the proxy")
        return real(path)

    monkeypatch.setattr(check_cmd, "_load", crash_on_proxy)
    with pytest.raises(KeyboardInterrupt):
        _check(models, tmp_path)
    assert not (tmp_path / "check.json").exists()
    saved = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != ".iprox-dir.json")
    assert len(saved) == 4  # the target's validation gradients and scores (+ their .json), written as they were done
    monkeypatch.setattr(check_cmd, "_load", real)
    spy.update(validation=0, score_batch=0)
    _, res = _check(models, tmp_path)
    # the target's finished scores are read back (its validation gradients are not even needed)
    assert _actions(res) == {("target", "scores"): "reused", ("proxy", "validation gradients"): "computed",
                             ("proxy", "scores"): "computed"}
    assert spy == {"validation": 1, "score_batch": 3}  # the proxy only


def test_check_scores_an_iprox_proxy_against_the_targets_validation_gradients(models, tmp_path, capsys):
    """A saved IProX proxy is checked as ``pipeline`` scores it by default: against the target's validation gradients
    in its factor coordinates (``--proxy_validation target``, the default for a proxy that kept every block); its
    table equals the product's ``tracin_scores(proxy, ..., validation_model=target)`` on the check's own sample;
    ``--proxy_validation proxy`` gives its own, another cache entry and another ranking; a plain model's default is
    its own."""
    import iprox_lightning.workflow.check as check_cmd
    from iprox_lightning import compress_model, save_proxy
    from iprox_lightning.models.builtin import builtin_model
    from iprox_lightning.scoring.influence import ScoreTable, tracin_scores

    root, _ = models
    target = builtin_model()
    proxy = builtin_model()
    compress_model(proxy, None, 0.5, method="svd", progress=False)
    save_proxy(proxy, None, tmp_path / "iprox", {"method": "svd", "sparsity": 0.5})
    args = ["check", "--target", "builtin", "--proxy", str(tmp_path / "iprox"), "--validation", str(root / "val.jsonl"),
            "--sample", "16", "--batch_size", "8", "--val_per_task", "6", "--layer_extraction", "false"]
    from iprox_lightning.cli import main

    main([*args, "--output_dir", str(tmp_path / "a")])
    assert "the proxy scored against the target's validation gradients" in capsys.readouterr().out
    res = json.loads((tmp_path / "a" / "check.json").read_text())
    assert res["proxy_validation"] == "target"
    path = next(e["path"] for e in res["cache"] if e["model"] == "proxy" and e["what"] == "scores")
    got = ScoreTable.load(path)
    from iprox_lightning.scoring.check_cache import CheckCache

    s = check_cmd._sample_pool(16, CheckCache(tmp_path / "ref"), pool="builtin",
                               validation=str(root / "val.jsonl"), tokenizer="builtin", max_length=256, batch_size=8,
                               seed=0, val_per_task=6)
    ref = tracin_scores(check_cmd._load(str(tmp_path / "iprox")), s.pool_loader(), s.dm.validation_dataloader(),
                        progress=False, validation_model=target)
    assert list(got.ids) == list(ref.ids)
    np.testing.assert_allclose(got.scores, ref.scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.task_scores, ref.task_scores, rtol=1e-5, atol=1e-6)

    main([*args, "--output_dir", str(tmp_path / "a"), "--proxy_validation", "proxy"])
    own = json.loads((tmp_path / "a" / "check.json").read_text())
    assert own["proxy_validation"] == "proxy"
    assert {(e["model"], e["what"]): e["action"] for e in own["cache"]} == {
        ("target", "scores"): "reused", ("proxy", "validation gradients"): "computed", ("proxy", "scores"): "computed"}
    own_path = next(e["path"] for e in own["cache"] if e["model"] == "proxy" and e["what"] == "scores")
    assert own_path != path and np.abs(ScoreTable.load(own_path).scores - got.scores).max() > 1e-3
    assert check_cmd._proxy_validation(str(root / "proxy"), None) == "proxy"  # a plain model: its own
    with pytest.raises(Exception, match="proxy_validation must be 'target' or 'proxy'"):
        check_cmd._proxy_validation(str(root / "proxy"), "both")


def test_an_edited_or_cut_cache_entry_is_computed_again(models, tmp_path, spy):
    """Issue 57: an edited cached score table was reused (and the verdict followed it); a cut cache file stopped the
    check instead of being recomputed. Both entries record a digest of their content; a changed or unreadable one is
    computed again and the check's verdict is the first run's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, first = _check(models, tmp_path)
    tables = sorted((tmp_path / "cache" / "scores").glob("*.parquet"))
    grads = sorted((tmp_path / "cache").rglob("validation/*.safetensors"))
    assert tables and grads
    t = pq.read_table(tables[0])
    pq.write_table(t.set_column(t.column_names.index("score"), "score",
                                pa.array([-x for x in t.column("score").to_pylist()])), tables[0])  # edited
    grads[0].write_bytes(grads[0].read_bytes()[:100])  # cut
    spy.update(validation=0, score_batch=0)
    _, again = _check(models, tmp_path)
    acts = {(e["model"], e["what"]): e["action"] for e in again["cache"]}
    assert "computed" in acts.values() and spy["score_batch"] > 0
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
    assert again["verdict"] == first["verdict"] and untimed(again["rows"]) == untimed(first["rows"])


def test_check_can_drop_its_validation_cache_and_cache_lists_and_clears(models, tmp_path, monkeypatch, capsys):
    """Issue 55: check's cache (2.4 GB on SmolLM2) is mostly validation gradient sums; ``--keep_validation_cache
    false`` deletes them after the run and keeps the small score tables (the same check again still reuses them);
    ``train.py cache`` lists every cache with its size and clears them."""
    from iprox_lightning.cli import main

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "ipx_cache"))
    from iprox_lightning.io.ownership import make_owned_dir

    gguf = tmp_path / "ipx_cache" / "gguf" / "m-0123"
    make_owned_dir(gguf, "gguf copy")  # as the GGUF loader marks its float copies (issue 61: only marked entries go)
    (gguf / "model.safetensors").write_bytes(b"\0" * 3000)
    out = tmp_path / "check"
    _, res = _check(models, out, "--keep_validation_cache", "false")
    printed = capsys.readouterr().out
    assert not (out / "cache" / "validation").exists() and "deleted the validation gradient cache" in printed
    assert sorted(p.suffix for p in (out / "cache" / "scores").iterdir()) == [".json", ".json", ".parquet", ".parquet"]
    _, res2 = _check(models, out)
    assert set(_actions(res2).values()) == {"reused"}
    capsys.readouterr()
    listed = main(["cache", "--under", str(out)])
    text = capsys.readouterr().out
    assert listed == [str(gguf), str(out / "cache")]
    import re

    assert re.search(r"gguf copy\s+3\.\d KB", text) and "check cache" in text and "total " in text  # 3000 B + marker
    main(["cache", "--clear", "true", "--under", str(out)])
    assert not gguf.exists() and not (out / "cache").exists() and (out / "check.json").exists()
    assert main(["cache"]) == [] and "(empty)" in capsys.readouterr().out
