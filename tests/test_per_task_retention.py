"""Retention per validation task (issue 22): ``per_task_retention`` / ``worst_task`` against brute force on small
inputs, and the numbers the pipeline summary and ``train.py check`` report per task on the built-in demo
(validation tasks ``addition`` and ``uppercase``) against the same brute force on their own score tables."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from iprox_lightning.analysis.retention import (
    format_per_task,
    per_task_retention,
    per_task_scores,
    worst_task,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# brute force: ranks by counting, Pearson by its definition, partialling by least squares, top-k by sorting
# ------------------------------------------------------------------------------------------------
def bf_ranks(x):
    return [1 + sum(y < v for y in x) + 0.5 * (sum(y == v for y in x) - 1) for v in x]


def bf_pearson(a, b):
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def bf_spearman(a, b):
    return bf_pearson(bf_ranks(a), bf_ranks(b))


def bf_partialled(a, b, c):
    """Pearson of the rank residuals after regressing each on the control's ranks (intercept + slope)."""
    rc = np.array(bf_ranks(c), dtype=float)
    X = np.stack([np.ones(len(rc)), rc], 1)
    res = [r - X @ np.linalg.lstsq(X, r, rcond=None)[0] for r in (np.array(bf_ranks(a), float), np.array(bf_ranks(b), float))]
    return bf_pearson(list(res[0]), list(res[1]))


def bf_topk(p: dict, t: dict, frac: float) -> float:
    ids = sorted(p)
    k = max(1, int(round(frac * len(ids))))
    top = lambda s: set(sorted(ids, key=lambda i: (-s[i], i))[:k])  # noqa: E731  (highest first, ties by id)
    return len(top(p) & top(t)) / k


def bf_shortlist(ids, lengths, frac=0.10):
    """The ids as short as the round(frac·n)-th shortest (every tie at the cut kept)."""
    k = max(1, int(round(frac * len(ids))))
    cut = sorted(lengths[i] for i in ids)[k - 1]
    return [i for i in ids if lengths[i] <= cut]


def bf_top_share(t: dict, short: list, frac: float) -> float:
    """The share of the target's top-k (highest first, ties by id) that lies in ``short``."""
    ids = sorted(t)
    k = max(1, int(round(frac * len(ids))))
    return sum(i in set(short) for i in sorted(ids, key=lambda i: (-t[i], i))[:k]) / k


def brute_force(proxy, target, lengths, tasks):
    ids = sorted(set(proxy) & set(target) & set(lengths))
    short = bf_shortlist(ids, lengths)
    out = {}
    for task in tasks:
        p = {i: proxy[i][task] for i in ids}
        t = {i: target[i][task] for i in ids}
        a, b, c = [p[i] for i in ids], [t[i] for i in ids], [lengths[i] for i in ids]
        out[task] = {"n": len(ids), "spearman": bf_spearman(a, b), "spearman_length_partialled": bf_partialled(a, b, c),
                     "spearman_within_shortest": bf_spearman([p[i] for i in short], [t[i] for i in short]),
                     "shortest_n": len(short), "target_top5_in_shortest": bf_top_share(t, short, 0.05), "top5%": bf_topk(p, t, 0.05), "top10%": bf_topk(p, t, 0.10)}
    return out


def assert_matches(got, want):
    assert list(got) == list(want)
    for task, w in want.items():
        for k, v in w.items():
            assert got[task][k] == pytest.approx(v, abs=1e-10, nan_ok=True), (task, k)


# ------------------------------------------------------------------------------------------------
# the function on small inputs
# ------------------------------------------------------------------------------------------------
def _tables(n=47, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    ids = [f"ex{i:03d}" for i in rng.permutation(n)]
    lengths = {i: float(rng.integers(1, 12)) for i in ids}  # many ties
    target, proxy = {}, {}
    for i in ids:
        base = {"mmlu": -lengths[i] + rng.normal(0, 3), "bbh": rng.normal(), "tydiqa": rng.normal()}
        target[i] = {k: (round(v) if ties else v) for k, v in base.items()}
        proxy[i] = {k: (round(v + rng.normal(0, 1)) if ties else v + rng.normal(0, 1)) for k, v in base.items()}
    return proxy, target, lengths


@pytest.mark.parametrize("ties", [False, True])
def test_per_task_retention_against_brute_force(ties):
    proxy, target, lengths = _tables(ties=ties)
    # ids not shared by every table are left out
    proxy["only-proxy"] = {"mmlu": 0.0, "bbh": 0.0, "tydiqa": 0.0}
    lengths["only-lengths"] = 3.0
    tasks = ("mmlu", "bbh", "tydiqa")
    got = per_task_retention(proxy, target, lengths, tasks=tasks)
    assert_matches(got, brute_force(proxy, target, lengths, tasks))
    assert all(m["n"] == 47 for m in got.values())
    assert got["mmlu"]["shortest_n"] >= 5  # round(0.1 · 47) = 5, and every tie at the cut
    # default tasks: every task both tables hold, sorted
    assert list(per_task_retention(proxy, target, lengths)) == ["bbh", "mmlu", "tydiqa"]
    # without lengths: no partialled entry, the same Spearman and overlaps
    plain = per_task_retention(proxy, target, tasks=tasks)
    assert "spearman_length_partialled" not in plain["mmlu"] and "spearman_within_shortest" not in plain["mmlu"]
    assert plain["bbh"]["spearman"] == got["bbh"]["spearman"] and plain["bbh"]["top10%"] == got["bbh"]["top10%"]


def test_worst_task_is_the_minimum_over_tasks():
    proxy, target, lengths = _tables(seed=1)
    got = per_task_retention(proxy, target, lengths, tasks=("mmlu", "bbh", "tydiqa"))
    want = brute_force(proxy, target, lengths, ("mmlu", "bbh", "tydiqa"))
    w = worst_task(got)
    for key in ("spearman", "spearman_length_partialled", "spearman_within_shortest"):
        task = min(want, key=lambda t: want[t][key])
        assert w[f"{key}_task"] == task and w[key] == pytest.approx(want[task][key], abs=1e-10)
    # an undefined (NaN) value is skipped; all undefined -> NaN, no task
    w2 = worst_task({"a": {"spearman": float("nan")}, "b": {"spearman": 0.3}}, metrics=("spearman",))
    assert w2 == {"spearman": 0.3, "spearman_task": "b"}
    w3 = worst_task({"a": {"spearman": float("nan")}}, metrics=("spearman",))
    assert math.isnan(w3["spearman"]) and w3["spearman_task"] is None
    lines = format_per_task(got)
    assert lines[0].startswith("   on mmlu") and "top-5% overlap" in lines[0]
    assert lines[-1].startswith("   worst task     : Spearman") and f"({w['spearman_task']})" in lines[-1]


def test_per_task_retention_interval_and_length_control():
    proxy, target, lengths = _tables(seed=2)
    calls = []

    def interval(stat, n):
        calls.append(n)
        full = stat(np.arange(n))
        rng = np.random.default_rng(0)
        vals = [stat(rng.integers(0, n, n)) for _ in range(20)]
        finite = [v for v in vals + [full] if not math.isnan(v)]
        return [min(finite), max(finite)] if finite else [float("nan")] * 2

    got = per_task_retention(proxy, target, lengths, tasks=("bbh",), interval=interval)["bbh"]
    assert calls == [47] * 5  # Spearman, partialled, among the shortest, top-5%, top-10%
    for k in ("spearman", "spearman_length_partialled", "spearman_within_shortest", "top5%", "top10%"):
        lo, hi = got[f"{k}_ci"]
        assert lo <= got[k] <= hi
    # a proxy that is the length ranking has no partialled retention (NaN), also on resampled ids
    by_length = {i: {"bbh": -lengths[i]} for i in proxy}
    m = per_task_retention(by_length, target, lengths, tasks=("bbh",), interval=interval)["bbh"]
    assert math.isnan(m["spearman_length_partialled"])
    assert m["spearman"] == pytest.approx(bf_spearman([-lengths[i] for i in sorted(proxy)],
                                                      [target[i]["bbh"] for i in sorted(proxy)]), abs=1e-10)


def test_per_task_retention_refuses_bad_tables():
    proxy, target, lengths = _tables(n=5)
    with pytest.raises(ValueError, match="share no id"):
        per_task_retention({"x": {"a": 1.0}}, target)
    bad = {i: dict(v) for i, v in proxy.items()}
    bad[sorted(bad)[0]]["bbh"] = float("nan")
    with pytest.raises(ValueError, match="on task 'bbh' is not finite"):
        per_task_retention(bad, target, tasks=("bbh",))
    with pytest.raises(ValueError, match="no score for task 'nope'"):
        per_task_retention(proxy, target, tasks=("nope",))


def test_per_task_scores_of_a_score_table_and_its_file(tmp_path):
    from iprox_lightning.scoring.influence import ScoreTable

    table = ScoreTable(["b", "a"], [0.5, 0.1], ["addition", "uppercase"], [[0.9, 0.1], [0.2, 0.0]], [3, 4], [False, False])
    want = {"b": {"addition": 0.9, "uppercase": 0.1}, "a": {"addition": 0.2, "uppercase": 0.0}}
    assert per_task_scores(table) == want
    table.save(str(tmp_path / "scores.parquet"))
    assert per_task_scores(tmp_path / "scores.parquet") == want and per_task_scores(tmp_path) == want


# ------------------------------------------------------------------------------------------------
# the built-in demo: pipeline summary and `train.py check`
# ------------------------------------------------------------------------------------------------
def _read(path):
    import pyarrow.parquet as pq

    t = pq.read_table(path).to_pylist()
    tasks = {i: {k[len("score/"):]: r[k] for k in r if k.startswith("score/")} for i, r in ((r["id"], r) for r in t)}
    return tasks, {r["id"]: float(r["n_tokens"]) for r in t}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from iprox_lightning.commands.pipeline import pipeline

    wd = tmp_path_factory.mktemp("pipeline_per_task")
    summary = pipeline(workdir=str(wd))  # the defaults: README's quick start
    return wd, summary


def test_pipeline_summary_reports_each_validation_task(demo, capsys):
    from iprox_lightning.workflow.summary import _format_summary

    wd, s = demo
    target, lengths = _read(wd / "scores" / "target" / "scores.parquet")
    proxy, _ = _read(wd / "scores" / "proxy" / "scores.parquet")
    per_task = s["retention_proxy_vs_target_per_task"]
    assert list(per_task) == ["addition", "uppercase"]
    want = brute_force(proxy, target, lengths, ["addition", "uppercase"])
    assert_matches(per_task, want)
    assert all(m["n"] == 2000 for m in per_task.values())
    w = s["retention_proxy_vs_target_worst_task"]
    assert w["spearman"] == pytest.approx(min(m["spearman"] for m in want.values()), abs=1e-10)
    # printed under the pooled line, which is unchanged
    text = _format_summary(s)
    pooled = text.index("proxy vs target   : Spearman ")
    assert text.index("   on addition    : Spearman ") > pooled and "   on uppercase   : Spearman " in text
    assert f"   worst task     : Spearman {w['spearman']:.3f} ({w['spearman_task']})" in text
    assert json.loads((wd / "summary.json").read_text())["retention_proxy_vs_target_per_task"] == json.loads(
        json.dumps(per_task))
    # the default: the proxy scored against the warmed target's validation gradients (its factor-space projection)
    from iprox_lightning.io.scores import read_settings

    st = read_settings(wd / "scores" / "proxy")
    assert st["config"]["validation_model"] == str(wd / "warmup" / "model") and st["scorer"]["validation_model"] == "other"
    assert "validation_model" not in read_settings(wd / "scores" / "target")["config"]
    assert s["proxy_validation"] == "target" and "proxy validation  : the target's validation gradients" in text


def test_check_reports_each_validation_task(demo, tmp_path, capsys):
    from iprox_lightning.cli import main
    from iprox_lightning.scoring import ScoreTable

    wd, _ = demo
    row = main(["check", "--target", str(wd / "warmup" / "model"), "--proxy", str(wd / "proxy" / "model"),
                "--sample", "60", "--output", str(tmp_path / "check.json")])
    result = json.loads((tmp_path / "check.json").read_text())
    # every score table check computed, saved as it was done: target, proxy, layer extraction
    paths = {e["model"]: e["path"] for e in result["cache"] if e["what"] == "scores"}
    tables = [ScoreTable.load(paths[who]) for who in ("target", "proxy", "layer_extraction")]
    rows = result["rows"]
    assert [r["proxy"] for r in rows][:2] == ["proxy (tracin)", "length sort (shortest first)"] and len(rows) == 3
    target = per_task_scores(tables[0])
    lengths = {i: float(n) for i, n in zip(tables[0].ids, tables[0].n_tokens)}  # response tokens, like check's
    tasks = ["addition", "uppercase"]
    for r, scores in zip(rows, [per_task_scores(tables[1]), {i: dict.fromkeys(tasks, -lengths[i]) for i in lengths},
                                per_task_scores(tables[2])]):
        want = brute_force(scores, target, lengths, tasks)
        if r["proxy"].startswith("length sort"):  # the control itself: partialled undefined
            assert all(r["per_task"][t]["spearman_length_partialled"] is None
                       or math.isnan(r["per_task"][t]["spearman_length_partialled"]) for t in tasks)
            for t in tasks:
                want[t].pop("spearman_length_partialled")
        assert_matches({t: {k: v for k, v in r["per_task"][t].items()} for t in tasks}, want)
        assert r["worst_task"]["spearman"] == pytest.approx(min(want[t]["spearman"] for t in tasks), abs=1e-10)
        assert all(m["n"] == 60 for m in r["per_task"].values())
    assert row["per_task"].keys() == {"addition", "uppercase"}
    out = capsys.readouterr().out
    assert "per validation task" in out and "   on uppercase   : Spearman" in out


def test_pipeline_default_rule_selects_once_per_task(demo):
    """The default rule (``balanced``, measured best on every task of the downstream benchmark) selects one subset per
    validation task for the target and the proxy: on the demo each task has one score column, so a task's subset is
    the top 5% by that column (ties by id), computed here from the score table by brute force."""
    wd, s = demo
    assert s["selection_rule"] == {"rule": "balanced", "k": 0.05, "tasks": ["addition", "uppercase"]}
    for who in ("target", "proxy"):
        per_task, _ = _read(wd / "scores" / who / "scores.parquet")
        for task in ("addition", "uppercase"):
            ids = [json.loads(line)["id"] for line in open(wd / "selected" / f"{who}.{task}.jsonl")]
            want = sorted(per_task, key=lambda i: (-per_task[i][task], i))[:100]
            assert ids == want, (who, task)
    assert not (wd / "selected" / "proxy.jsonl").exists()  # no pooled subset beside the per-task ones
    # each task's subset fine-tuned once and evaluated on that task's held-out examples
    effect = s["selection_effect"]["metrics"]
    for who in ("target", "proxy"):
        assert set(effect[who]["models"]) == {"addition", "uppercase"}
        assert all((wd / "finetune" / f"{who}.{t}" / "model" / "config.json").exists() for t in ("addition", "uppercase"))
    assert set(effect) == {"base", "proxy", "target", "random"} and all(m["n"] == 100 for m in effect.values())


def test_report_reads_a_pipeline_run_with_per_task_selections(demo, tmp_path, capsys):
    """Issue 65: ``report --workdir`` on the README's pipeline run (one selection per task for target and proxy, one
    for random) finds every score table and model, and writes each per-task selection's oracle share and explanation
    (it raised KeyError 'target_selection' on these)."""
    from iprox_lightning.cli import main

    wd, s = demo
    rows = main(["report", "--workdir", str(wd), "--output_dir", str(tmp_path / "report"), "--max_examples", "200",
                 "--plots", "false"])
    by = {r["proxy"]: r for r in rows}
    assert {"proxy", "random", "target"} <= set(by)
    assert by["proxy"]["spearman"] == pytest.approx(s["retention_proxy_vs_target"]["spearman"])
    md = (tmp_path / "report" / "report.md").read_text()
    o = s["oracle"]
    for who in ("target.addition", "target.uppercase", "proxy.addition", "proxy.uppercase", "random"):
        fam = ", ".join(f"{f} {v:.3f}" for f, v in o["per_family"][who].items())
        assert f"- {who}: {o[who + '_selection']:.3f} ({fam})\n" in md, who
        assert f"## Selection `{who}` explained" in md, who
    assert "## Fine-tuned effect" in md
    capsys.readouterr()


def test_seconds_per_stage_file_holds_every_stage_the_summary_shows(demo):
    """Issue 65: ``seconds_per_stage.json`` left out ``evaluate`` (the last stage: the file was written only when the
    next stage ended), though the summary shows it."""
    wd, s = demo
    on_disk = json.loads((wd / "seconds_per_stage.json").read_text())
    assert {"select", "evaluate"} <= set(on_disk) and set(on_disk) == set(s["seconds_per_stage"])
    assert all(round(on_disk[k], 2) == v for k, v in s["seconds_per_stage"].items())
