"""Issue 62: a metric and a rule are one class each, declared in this file and nowhere else; by name they run through
``plan``, ``predict`` (the pipeline's scoring stage), ``build_store``, ``query``, ``select`` and ``pipeline`` (the demo's
builtin model). ARCHITECTURE.md's "Where to add" entries name exactly these extension points.

``Scaled`` is ``M = s·I`` with its own option ``s`` (``scale``): a cosine in it is TracIn's cosine (the scale cancels;
a power of two scales every product exactly, so the scores are TracIn's to rounding), which is what the numbers are
checked against. ``WorstTask`` ranks by the minimum over the task columns, one subset for all tasks."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from iprox_lightning.cli import main
from iprox_lightning.io.scores import read_table
from iprox_lightning.scoring.metrics import InfluenceMetric
from iprox_lightning.selection.rules import RULES, SelectionRule, task_columns
from iprox_lightning.selection.topk import topk_order

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def extension():
    """The two classes, defined here and nowhere else; registered while this module's tests run and taken out of the
    registries after them (other test modules count the built-in metrics and rules)."""
    class Scaled(InfluenceMetric, name="scaled_for_test"):
        """``M G = scale · G``: its own option, its own memory part, nothing to fit."""

        options = {"scale": 0.5}
        memory_levers = {"scaled_copy": "method tracin (the test metric's copy)"}

        @classmethod
        def memory_parts(cls, linears):
            return {"scaled_copy": 4.0 * sum(i * o for i, o in linears)}

        def fit(self, model, modules, keys, batches, *, dtype, shard=(0, 1), reduce=None, progress=False):
            return {}

        def matrix(self, key, G):
            return self.own_options["scale"] * G

        def tokens(self, key, h, delta):
            return self.own_options["scale"] * h, delta

    class WorstTask(SelectionRule, name="worst_task_for_test"):
        """The minimum over the task columns: one subset for all tasks."""

        per_task = False

        def __call__(self, ids, columns, task=None):
            values = np.min(np.stack(list(task_columns(columns, task).values())), axis=0)
            return topk_order(values, ids), values

    yield Scaled, WorstTask
    InfluenceMetric.registry.pop("scaled_for_test")
    RULES.pop("worst_task_for_test")


def _columns(path):
    _, table = read_table(path)
    return {c: np.asarray(table.column(c).to_pylist(), np.float64) for c in table.column_names if c.startswith("score")}


def test_the_classes_registered_themselves(extension):
    Scaled, WorstTask = extension
    assert InfluenceMetric.registry["scaled_for_test"] is Scaled and isinstance(RULES["worst_task_for_test"], WorstTask)


def test_plan_reads_the_metric_class(tmp_path):
    out = tmp_path / "plan.json"
    main(["plan", "--model", "smollm2-135m", "--method", "scaled_for_test", "--output", str(out)])
    stages = {s["stage"]: s for s in json.loads(out.read_text())["stages"]}
    ours, tracin = stages["scoring (scaled_for_test)"], stages["scoring (tracin)"]
    tracked = ours["parts"]["validation_gradients"] / (4.0 * 3)  # 3 tasks, one float32 gradient each
    assert ours["parts"]["scaled_copy"] == 4.0 * tracked  # its memory_parts, float32 per tracked parameter
    assert ours["peak"] == tracin["peak"] + ours["parts"]["scaled_copy"] and ours["flops"] == tracin["flops"]


def test_store_query_select_by_name(tmp_path):
    common = ["--model", "builtin", "--builtin_size", "48", "--batch_size", "8", "--k", "4", "--progress", "false",
              "--accelerator", "cpu", "--store_dtype", "float32"]
    main(["build_store", "--output_dir", str(tmp_path / "store"), "--method", "scaled_for_test",
          "--options", '{"scale": 0.25}', *common])
    main(["build_store", "--output_dir", str(tmp_path / "tracin"), *common])
    info = json.loads((tmp_path / "store" / "store.json").read_text())
    assert info["fingerprint"]["settings"]["method"] == "scaled_for_test"
    assert info["fingerprint"]["settings"]["scale"] == 0.25  # its own option, in the store's fingerprint
    for store in ("store", "tracin"):
        main(["query", "--store", str(tmp_path / store), "--validation", "builtin", "--output_dir",
              str(tmp_path / f"q_{store}")])
    settings = json.loads((tmp_path / "q_store" / "settings.json").read_text())
    assert settings["scorer"]["method"] == "scaled_for_test" and settings["scorer"]["scale"] == 0.25
    ours, tracin = _columns(tmp_path / "q_store" / "scores.parquet"), _columns(tmp_path / "q_tracin" / "scores.parquet")
    assert set(ours) == set(tracin) and len(ours) > 2
    for c in ours:  # the cosine in s·I is TracIn's (float32 vectors; the scale 1/4 is exact): rounding only
        np.testing.assert_allclose(ours[c], tracin[c], rtol=0, atol=1e-6)
    out = tmp_path / "sel.jsonl"
    main(["select", "--scores_path", str(tmp_path / "q_store" / "scores.parquet"), "--k", "0.25", "--rule",
          "worst_task_for_test", "--pool", "builtin", "--builtin_size", "48", "--output", str(out)])
    cols = {c: v for c, v in ours.items() if c.startswith("score/")}
    _, table = read_table(tmp_path / "q_store" / "scores.parquet")
    ids = [str(i) for i in table.column("id").to_pylist()]
    worst = np.min(np.stack(list(cols.values())), axis=0)
    want = [ids[j] for j in np.lexsort((np.asarray(ids), -worst))[:12]]  # best first, ties by id
    got = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert got == want


def test_pipeline_scores_with_the_metric_and_selects_with_the_rule(tmp_path):
    wd = tmp_path / "wd"
    main(["pipeline", "--workdir", str(wd), "--method", "scaled_for_test", "--select_rule", "worst_task_for_test",
          "--finetune", "false"])
    settings = json.loads((wd / "scores" / "target" / "settings.json").read_text())
    assert settings["scoring"]["method"] == "scaled_for_test" and settings["scorer"]["scale"] == 0.5
    # the rule declares per_task = False: one subset per selector, none per task
    assert sorted(p.name for p in (wd / "selected").glob("*.jsonl")) == ["proxy.jsonl", "random.jsonl", "target.jsonl"]
    cols = {c: v for c, v in _columns(wd / "scores" / "target" / "scores.parquet").items() if c.startswith("score/")}
    assert len(cols) >= 2 and all(np.isfinite(v).all() for v in cols.values())


def test_architecture_where_to_add_names_these_extension_points():
    """The "Where to add" entries of ARCHITECTURE.md say what this file does: one class each, declaring its options,
    memory and factor passes (a metric) or whether it selects per task (a rule), and a model family as one loader."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    where = text[text.index("## Where to add"):text.index("## Conventions")]
    entries = {m.group(1): m.group(2) for m in re.finditer(r"^\* \*\*(.+?)\*\* — (.*?)(?=^\* \*\*|\Z)", where,
                                                              flags=re.M | re.S)}
    metric, rule, family = entries["An influence metric"], entries["A selection rule"], entries["A model family"]
    for name in ("InfluenceMetric", "options", "memory_parts", "factor_passes", "uses", "tests/test_extension_points.py"):
        assert name in metric, name
    for name in ("SelectionRule", "per_task", "tests/test_extension_points.py"):
        assert name in rule, name
    assert "PER_TASK_RULES" not in text
    assert "register_loader" in family
    import iprox_lightning.models.loading as loading

    assert callable(loading.register_loader) and len(loading.LOADERS) >= 4
    for name in ("options", "uses", "conventions", "factor_passes", "memory_parts", "memory_levers", "from_config"):
        assert hasattr(InfluenceMetric, name), name
    assert hasattr(SelectionRule, "per_task") and hasattr(SelectionRule, "columns")
