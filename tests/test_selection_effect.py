"""Issue 14: the held-out metrics behind the pipeline's "fine-tuned effect" lines, checked by hand."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from iprox_lightning.evaluation.heldout import heldout_metrics, heldout_records
from iprox_lightning.evaluation.effect import format_effect


class Fixed(torch.nn.Module):
    """Logits that put all mass on `pred[b, t]` (log-prob 0) except where `pred` is -1 (uniform over V)."""

    def __init__(self, pred, vocab=5):
        super().__init__()
        self.pred, self.vocab = pred, vocab

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            for t in range(T):
                if self.pred[b][t] >= 0:
                    logits[b, t, self.pred[b][t]] = 50.0
        return SimpleNamespace(logits=logits)


def test_heldout_metrics_by_hand():
    labels = torch.tensor([[-100, -100, 3, 4], [-100, 2, 1, -100]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
             "labels": labels, "task": ["a", "b"]}
    # example 0: positions 1, 2 predict labels 3, 4 exactly -> loss 0, exact; example 1: position 0 right, 1 uniform
    model = Fixed([[0, 3, 4, 0], [2, -1, 0, 0]])
    m = heldout_metrics(model, [batch])
    assert m["n"] == 2 and m["per_task"]["a"]["exact_match"] == 1.0 and m["per_task"]["b"]["exact_match"] == 0.0
    assert abs(m["per_task"]["a"]["loss"]) < 1e-6
    assert math.isclose(m["per_task"]["b"]["loss"], math.log(5) / 2, rel_tol=1e-5)  # mean of (0, log V)
    assert math.isclose(m["loss"], math.log(5) / 4, rel_tol=1e-5) and m["exact_match"] == 0.5


def test_builtin_heldout_is_fresh_and_labelled():
    from iprox_lightning.data.synthetic import builtin_validation, generate_builtin_dataset

    recs, desc = heldout_records("builtin", "builtin", n_per_task=20)
    assert len(recs) == 40 and {r["category"] for r in recs} == {"addition", "uppercase"}
    texts = lambda rs: {(r["instruction"], r["context"], r["response"]) for r in rs}
    assert not {r["id"] for r in recs} & {r["id"] for r in builtin_validation(8)}
    assert len(texts(recs) & texts(builtin_validation(8))) <= 2  # a different random stream
    assert "not in the pool" in desc and generate_builtin_dataset(10)[0]["id"].startswith("builtin-")
    lines = format_effect({"heldout": desc, "metrics": {w: {"loss": 1.0 + k, "exact_match": 0.1 * k, "per_task": {}}
                                                         for k, w in enumerate(("base", "proxy", "target", "random"))}})
    assert lines[1].endswith("base 1.000 | proxy 2.000 | target 3.000 | random 4.000")


def test_suite_heldout_records_never_overlap_the_validation_set(eval_dir):
    """Held-out MMLU questions come from the test split and BBH examples from the task files: none is a validation
    (dev / CoT-exemplar) example; per subtask counts and the gold answers are the files' own."""
    from iprox_lightning.data.eval_readers import read_bbh, read_mmlu
    from iprox_lightning.data.eval_validation import eval_validation_records
    from iprox_lightning.evaluation.heldout import suite_heldout_records

    recs = suite_heldout_records(str(eval_dir), ("mmlu", "bbh"), per_subtask=2, seed=0)
    assert recs == suite_heldout_records(str(eval_dir), ("mmlu", "bbh"), per_subtask=2, seed=0)  # reproducible
    by = {}
    for r in recs:
        by.setdefault(r["category"], {}).setdefault(r["subtask"], []).append(r)
    assert len(by["mmlu"]) == 57 and all(len(v) == 2 for v in by["mmlu"].values())
    assert len(by["bbh"]) == 27 and all(len(v) == 2 for v in by["bbh"].values())
    val = eval_validation_records(eval_dir, ("mmlu", "bbh"))
    val_text = {(v["instruction"], v["response"]) for v in val}
    assert not any((r["instruction"], r["response"]) in val_text for r in recs)
    mmlu_test = {q.question.strip(): "ABCD"[q.answer] for qs in read_mmlu(eval_dir / "mmlu", split="test").values()
                 for q in qs}
    assert all(mmlu_test[r["instruction"].split("\nA. ")[0]] == r["response"] for r in recs if r["category"] == "mmlu")
    bbh = {(ex.input.strip(), ex.target.strip()) for _, (_, exs) in read_bbh(eval_dir / "bbh").items() for ex in exs}
    assert all((r["instruction"], r["response"]) in bbh for r in recs if r["category"] == "bbh")
    assert len({r["id"] for r in recs}) == len(recs)
    with pytest.raises(ValueError, match="TyDiQA's GoldP dev file"):
        suite_heldout_records(str(eval_dir), ("tydiqa",))


def test_gains_vs_random_pairs_examples_by_task_and_id():
    """The pipeline's effect in the benchmark's terms: per task, random's loss minus the selection's, example by
    example, with a paired bootstrap CI; examples missing from either side are not paired."""
    import numpy as np

    from iprox_lightning.evaluation.bootstrap import percentile_interval
    from iprox_lightning.evaluation.effect import gains_vs_random

    ex = lambda who: [{"id": f"{t}-{i}", "task": t, "loss": loss} for t, losses in who.items()  # noqa: E731
                      for i, loss in enumerate(losses)]
    metrics = {"random": {"examples": ex({"a": [2.0, 3.0, 4.0], "b": [1.0, 1.0]})},
               "proxy": {"examples": ex({"a": [1.5, 3.0, 3.5], "b": [1.25, 0.75]})},
               "target": {"examples": ex({"a": [2.0, 2.0]})}}  # a-2 missing: paired on a-0, a-1 only
    g = gains_vs_random(metrics, seed=0, n_boot=200)
    assert set(g) == {"a", "b"} and set(g["a"]) == {"proxy", "target"} and set(g["b"]) == {"proxy"}
    d = np.array([0.5, 0.0, 0.5])
    assert g["a"]["proxy"]["n"] == 3 and math.isclose(g["a"]["proxy"]["loss_gain"], 1 / 3)
    assert g["a"]["proxy"]["loss_gain_ci"] == percentile_interval(lambda ix: float(d[ix].mean()), 3, 200, seed=0)
    assert g["a"]["target"]["n"] == 2 and math.isclose(g["a"]["target"]["loss_gain"], 0.5)
    assert math.isclose(g["b"]["proxy"]["loss_gain"], 0.0)
    assert gains_vs_random({"proxy": metrics["proxy"]}) == {}  # no random row: nothing to compare with
    unnamed = {"random": {"examples": [{"id": None, "task": "a", "loss": 1.0}] * 2}, "proxy": metrics["proxy"]}
    with pytest.raises(ValueError, match="distinct"):
        gains_vs_random(unnamed)
    lines = format_effect({"heldout": "h", "metrics": {"random": {"loss": 1.0, "exact_match": 0.0, "per_task": {}}},
                           "gain_vs_random": g})
    assert lines[-2] == "     a                   : proxy +0.333 [" + ", ".join(
        f"{x:+.3f}" for x in g["a"]["proxy"]["loss_gain_ci"]) + "] | target +0.500 [+0.000, +1.000]"
