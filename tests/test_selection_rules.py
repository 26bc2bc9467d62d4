"""Selection rules (pooled, per-task mean, LESS max over subtasks, task-balanced) against brute-force
references, and through ``select`` / the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest

from iprox_lightning.scoring import ScoreTable
from iprox_lightning.selection.select import select
from iprox_lightning.selection.rules import RULES, rule_order, task_columns
from reference_rules import balanced_brute

N = 30
TASKS = ["bbh.date", "bbh.navigate", "mmlu.anatomy", "mmlu.astronomy", "mmlu.virology", "tydiqa"]


@pytest.fixture()
def table(tmp_path):
    rng = np.random.default_rng(1)
    ids = [f"ex-{j:03d}" for j in range(N)]
    ts = rng.normal(size=(N, len(TASKS)))
    ts[:, 5] *= 10  # a task on another scale: balanced must standardise
    scores = ts.mean(axis=1)
    zero = np.zeros(N, bool)
    zero[4] = True
    t = ScoreTable(ids, scores, TASKS, ts, np.full(N, 3), zero, ["t"] * N)
    path = tmp_path / "scores.parquet"
    t.save(str(path))
    pool = tmp_path / "pool.jsonl"
    with open(pool, "w") as f:
        for i in ids:
            f.write(json.dumps({"id": i, "category": "c", "instruction": f"q {i}", "response": "r"}) + "\n")
    return ids, scores, ts, str(path), str(pool)


def brute_order(ids, values):
    return [i for _, i in sorted(zip(values, ids), key=lambda r: (-r[0], r[1]))]


def cols(scores, ts):
    return {"score": scores, **{f"score/{t}": ts[:, k] for k, t in enumerate(TASKS)}}


def test_task_columns_take_a_task_and_its_parts_only(table):
    ids, scores, ts, *_ = table
    assert list(task_columns(cols(scores, ts), "mmlu")) == ["score/mmlu.anatomy", "score/mmlu.astronomy",
                                                            "score/mmlu.virology"]
    assert list(task_columns(cols(scores, ts), "tydiqa")) == ["score/tydiqa"]
    assert len(task_columns(cols(scores, ts), None)) == len(TASKS)
    with pytest.raises(ValueError, match=r"no score column for task 'mm'.*\['bbh', 'mmlu', 'tydiqa'\]"):
        task_columns(cols(scores, ts), "mm")


def test_pooled_mean_max_equal_brute_force(table):
    ids, scores, ts, *_ = table
    c = cols(scores, ts)
    order, value = rule_order("pooled", ids, c)
    assert [ids[j] for j in order] == brute_order(ids, scores)
    np.testing.assert_array_equal(value, scores)
    for rule, agg in (("mean", np.mean), ("max", np.max)):
        for task, parts in (("mmlu", [2, 3, 4]), ("bbh", [0, 1]), (None, list(range(6)))):
            want = [agg(ts[j, parts]) for j in range(N)]
            order, value = rule_order(rule, ids, c, task)
            assert [ids[j] for j in order] == brute_order(ids, want), (rule, task)
            np.testing.assert_allclose(value, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="takes no task"):
        rule_order("pooled", ids, c, "mmlu")
    with pytest.raises(ValueError, match="unknown selection rule 'best'.*pooled, mean, max, balanced"):
        rule_order("best", ids, c)
    assert set(RULES) == {"pooled", "mean", "max", "balanced"}


def test_balanced_round_robin_over_standardised_tasks(table):
    ids, scores, ts, *_ = table
    order, value = rule_order("balanced", ids, cols(scores, ts), None)
    assert sorted(order.tolist()) == list(range(N))  # a permutation: every example exactly once
    z = (ts - ts.mean(0)) / ts.std(0)
    # brute force: task t (round-robin) takes its best remaining example by z-score
    want, picker = balanced_brute(ids, list(ts.T))
    assert order.tolist() == want
    np.testing.assert_allclose(value[want], [z[j, t] for j, t in zip(want, picker)], atol=1e-12)
    # the first len(TASKS) picks are each task's own best: the 10x-scaled task does not dominate
    assert [int(np.argmax(z[:, t])) in want[: len(TASKS)] for t in range(len(TASKS))] == [True] * len(TASKS)


def test_select_with_rule_and_task(table, tmp_path):
    ids, scores, ts, path, pool = table
    ok = [j for j in range(N) if j != 4]  # ex-004 has no gradient
    out = select(path, k=5, rule="max", task="mmlu", dedup=False, pool=pool, output=str(tmp_path / "m.jsonl"))
    got = [json.loads(line)["id"] for line in open(out)]
    assert got == brute_order([ids[j] for j in ok], [ts[j, 2:5].max() for j in ok])[:5]
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["rule"] == "max" and meta["task"] == "mmlu" and meta["count"] == 5
    assert [m["score"] for m in meta["selected"]] == pytest.approx(sorted((ts[j, 2:5].max() for j in ok),
                                                                          reverse=True)[:5])
    # per_task (0.1.0's spelling of rule="max") is gone: a clear error, not a silent other ranking
    with pytest.raises(TypeError, match="per_task"):
        select(path, k=6, per_task=True, dedup=False, pool=pool, output=str(tmp_path / "a.jsonl"))
    with pytest.raises(ValueError, match="no score column for task 'gsm8k'"):
        select(path, k=5, rule="mean", task="gsm8k", pool=pool, output=str(tmp_path / "x.jsonl"))


def test_select_cli_names_the_rule(table, tmp_path):
    from iprox_lightning.cli import main

    ids, scores, ts, path, pool = table
    out = tmp_path / "cli.jsonl"
    main(["select", "--scores_path", path, "--k", "4", "--rule", "mean", "--task", "bbh", "--dedup", "false",
          "--pool", pool, "--output", str(out), "--quiet", "true"])
    ok = [j for j in range(N) if j != 4]
    assert [json.loads(line)["id"] for line in open(out)] == brute_order(
        [ids[j] for j in ok], [ts[j, :2].mean() for j in ok])[:4]


def test_select_cli_refuses_the_removed_per_task_option(table, tmp_path, capsys):
    """0.1.0's ``--per_task true`` (read then as ``--rule max``) is removed: the command refuses it by name and writes
    nothing, instead of ranking by another column than the user meant."""
    from iprox_lightning.cli import main

    ids, scores, ts, path, pool = table
    out = tmp_path / "old.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["select", "--scores_path", path, "--k", "4", "--per_task", "true", "--dedup", "false",
              "--pool", pool, "--output", str(out), "--quiet", "true"])
    assert e.value.code != 0 and "per_task" in capsys.readouterr().err
    assert not out.exists()


def test_within_shortest_ranks_only_the_shortest_brute_force(tmp_path):
    """``within_shortest=m``: the rule ranks only the ``m·k`` shortest responses (ties at the cut kept); the balanced
    rule standardises among them. Brute force: filter by length, then the rule on the filtered table."""
    rng = np.random.default_rng(4)
    ids = [f"ex-{j:03d}" for j in range(N)]
    ts = rng.normal(size=(N, len(TASKS)))
    n_tok = rng.permutation(np.tile(np.arange(1, 7), N // 6))  # five of each length 1..6
    t = ScoreTable(ids, ts.mean(axis=1), TASKS, ts, n_tok, np.zeros(N, bool), ["t"] * N)
    path = tmp_path / "scores.parquet"
    t.save(str(path))
    k, m = 4, 2.25  # the 9 shortest, and every example as short as the 9th: lengths 1 and 2
    cut = sorted(n_tok)[8]
    short = [j for j in range(N) if n_tok[j] <= cut]
    assert cut == 2 and len(short) == 10  # the tie at the cut is kept
    out = select(str(path), k=k, rule="mean", task="mmlu", dedup=False, output=str(tmp_path / "s.jsonl"),
                 within_shortest=m)
    got = [json.loads(line)["id"] for line in open(out)]
    assert got == brute_order([ids[j] for j in short], [ts[j, 2:5].mean() for j in short])[:k]
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["shortlist"] == {"within_shortest": m, "candidates": len(short), "max_response_tokens": float(cut)}
    # balanced: the round robin over the candidates' standardised subtask columns
    out = select(str(path), k=k, rule="balanced", task="mmlu", dedup=False, output=str(tmp_path / "b.jsonl"),
                 within_shortest=m)
    sub_ids = [ids[j] for j in short]
    want, _ = balanced_brute(sub_ids, list(ts[short, 2:5].T), k)
    assert [json.loads(line)["id"] for line in open(out)] == [sub_ids[j] for j in want]
    with pytest.raises(ValueError, match="within_shortest must be a number >= 1"):
        select(str(path), k=k, output=str(tmp_path / "x.jsonl"), within_shortest=0.5)


def test_within_shortest_needs_response_tokens(table, tmp_path):
    from iprox_lightning.io.scores import write_scores

    p = write_scores({"a": 1.0, "b": 2.0}, tmp_path / "plain" / "scores.parquet")
    with pytest.raises(ValueError, match="within_shortest needs the score table's 'n_tokens' column"):
        select(str(p), k=1, output=str(tmp_path / "x.jsonl"), within_shortest=2)


def test_exclude_categories_ranks_only_the_other_candidates_brute_force(tmp_path):
    """``exclude_categories``: the candidates whose pool category matches a pattern are left out before ranking; the
    rule (balanced: standardised among the rest) and ``within_shortest`` then work on the others. Brute force: the
    rule on the table without them. Also from the command line, and its errors."""
    from iprox_lightning.cli import main

    rng = np.random.default_rng(7)
    ids = [f"ex-{j:03d}" for j in range(N)]
    ts = rng.normal(size=(N, len(TASKS)))
    n_tok = rng.permutation(np.tile(np.arange(1, 7), N // 6))
    t = ScoreTable(ids, ts.mean(axis=1), TASKS, ts, n_tok, np.zeros(N, bool), ["t"] * N)
    path = tmp_path / "scores.parquet"
    t.save(str(path))
    cats = ["xquad_ar" if j % 3 == 0 else "xquad_de" if j % 5 == 0 else "t0" for j in range(N)]
    pool = tmp_path / "pool.jsonl"
    with open(pool, "w") as f:
        for i, c in zip(ids, cats):
            f.write(json.dumps({"id": i, "category": c, "instruction": f"q {i}", "response": "r"}) + "\n")
    rest = [j for j in range(N) if not cats[j].startswith("xquad_")]
    k = 4
    out = select(str(path), k=k, rule="mean", task="mmlu", pool=str(pool), output=str(tmp_path / "m.jsonl"),
                 quiet=True, exclude_categories=["xquad_*"])
    assert [json.loads(line)["id"] for line in open(out)] == brute_order(
        [ids[j] for j in rest], [ts[j, 2:5].mean() for j in rest])[:k]
    meta = json.loads(open(out + ".meta.json").read())
    assert meta["excluded"] == {"categories": ["xquad_*"], "count": N - len(rest), "candidates": len(rest)}
    sub_ids = [ids[j] for j in rest]
    want, _ = balanced_brute(sub_ids, list(ts[rest, 2:5].T), k)
    out = select(str(path), k=k, rule="balanced", task="mmlu", pool=str(pool), output=str(tmp_path / "b.jsonl"),
                 quiet=True, exclude_categories=["xquad_*"])
    assert [json.loads(line)["id"] for line in open(out)] == [sub_ids[j] for j in want]
    # with within_shortest: the shortlist is drawn from the remaining candidates
    cut = sorted(n_tok[rest])[2 * k - 1]
    short = [j for j in rest if n_tok[j] <= cut]
    out = select(str(path), k=k, rule="mean", task="mmlu", pool=str(pool), output=str(tmp_path / "s.jsonl"),
                 quiet=True, exclude_categories=["xquad_*"], within_shortest=2)
    assert [json.loads(line)["id"] for line in open(out)] == brute_order(
        [ids[j] for j in short], [ts[j, 2:5].mean() for j in short])[:k]
    # an exact category name, from the command line
    cli_out = tmp_path / "cli.jsonl"
    main(["select", "--scores_path", str(path), "--k", "4", "--rule", "mean", "--task", "mmlu", "--pool", str(pool),
          "--output", str(cli_out), "--quiet", "true", "--exclude_categories", "[xquad_ar]"])
    rest_ar = [j for j in range(N) if cats[j] != "xquad_ar"]
    assert [json.loads(line)["id"] for line in open(cli_out)] == brute_order(
        [ids[j] for j in rest_ar], [ts[j, 2:5].mean() for j in rest_ar])[:k]
    with pytest.raises(ValueError, match="exclude_categories reads each candidate's category from the pool"):
        select(str(path), k=k, output=str(tmp_path / "x.jsonl"), exclude_categories=["xquad_*"])
    with pytest.raises(ValueError, match="leaves no candidate"):
        select(str(path), k=k, pool=str(pool), output=str(tmp_path / "y.jsonl"), exclude_categories=["*"])
    with pytest.raises(ValueError, match="must be a list of category patterns"):
        select(str(path), k=k, pool=str(pool), output=str(tmp_path / "z.jsonl"), exclude_categories="xquad_*")


def test_a_restriction_reranks_among_the_candidates_it_keeps(table):
    """The extension point of ``select``'s restrictions: a :class:`Restriction` keeps some ids, :class:`Candidates`
    re-ranks among them and records the restriction's meta with the count left; equal to ranking the kept rows by
    brute force."""
    from iprox_lightning.io.scores import read_table
    from iprox_lightning.selection.candidates import Candidates, Restriction

    ids, scores, ts, path, pool = table

    class EvenIds(Restriction):
        meta_key = "even"

        def keep(self, candidates, count):
            return {i for _, i in candidates.rows if int(i[-1]) % 2 == 0}, {"rule": "even", "candidates": None}

    src, tab = read_table(path)
    cands = Candidates.rank(src, tab, "pooled", None, dedup=False, skip_flagged=False)
    assert [i for _, i in cands.rows] == brute_order([ids[j] for j in range(N) if j != 4],
                                                     [scores[j] for j in range(N) if j != 4])
    cands.restrict(EvenIds())
    kept = [j for j in range(N) if j != 4 and int(ids[j][-1]) % 2 == 0]
    assert [i for _, i in cands.rows] == brute_order([ids[j] for j in kept], [scores[j] for j in kept])
    assert [v for v, _ in cands.rows] == pytest.approx(sorted((scores[j] for j in kept), reverse=True))
    assert cands.applied == {"even": {"rule": "even", "candidates": len(kept)}}
