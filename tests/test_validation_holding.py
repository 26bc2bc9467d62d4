"""How the exact scorer holds its validation gradients (``ScoringConfig.validation_gradients``): on the host, in
bfloat16, in column groups over several passes -- against the default holding's scores, through the function API and
the Trainer, and ``train.py plan``'s count of the bytes held against the bytes the scorer holds."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from iprox_lightning.analysis import memory as M
from iprox_lightning.analysis.retention import spearman, topk_overlap
from iprox_lightning.errors import UserInputError
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import ScoreTable, influence_scores
from iprox_lightning.scoring.config import ScoringConfig
from iprox_lightning.scoring.influence import InfluenceScorer
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import SCORES_FILE, InfluenceWriter

sys.path.insert(0, str(Path(__file__).parent))
from test_scoring_influence import TINY, batches, make_examples  # noqa: E402
from test_writer_scoring import Crash, TinyDM, assert_table_equal, make_trainer, reference  # noqa: E402
from test_writer_scoring import build_model as build_float64  # noqa: E402

TASKS = ["a", "b", "c", "d", "e"]
POOL = make_examples(40, seed=1, tasks=TASKS, zero_every=9)
VAL = make_examples(15, seed=2, tasks=TASKS)


def model32():
    return tiny_causal_lm("llama", seed=3, dtype=torch.float32, **TINY)


def scores(method="tracin", pool=POOL, **holding):
    return influence_scores(model32(), batches(pool, 4), batches(VAL, 4), method=method, progress=False,
                            validation_gradients=holding or None)


@pytest.mark.parametrize("method", ["tracin", "kfac"])
def test_host_storage_and_column_groups_equal_the_default_scores(method):
    base = scores(method)
    assert "validation_gradients" not in base.settings and "column_groups" not in base.settings
    host = scores(method, device="cpu")
    # the same operations on the same values (the host is this CPU's memory): identical scores
    np.testing.assert_array_equal(host.scores, base.scores)
    np.testing.assert_array_equal(host.task_scores, base.task_scores)
    assert host.settings["validation_gradients"] == {"dtype": "float32", "device": "cpu", "column_groups": 1}
    for groups, passes in ((2, 2), (99, len(TASKS))):  # at most one group per column
        t = scores(method, column_groups=groups)
        assert t.ids == base.ids and t.settings["column_groups"] == passes
        # each pass's inner products come from a product with fewer directions (other BLAS blocking, and the
        # ghost / materialised choice depends on the number of directions): float32 rounding of cosines <= 1,
        # measured 4e-8; the flags are the same
        np.testing.assert_allclose(t.task_scores, base.task_scores, rtol=0, atol=1e-6)
        np.testing.assert_allclose(t.scores, base.scores, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(t.zero_grad, base.zero_grad)
        assert t.zero_grad.any() and np.abs(t.task_scores).max() > 0.05


def test_bfloat16_storage_keeps_the_ranking_and_the_top_five_percent():
    pool = make_examples(200, seed=5, tasks=TASKS, zero_every=17)
    base = scores(pool=pool)
    t = scores(pool=pool, dtype="bfloat16", device="cpu", column_groups=2)
    for x, y in [(t.scores, base.scores), *zip(t.task_scores.T, base.task_scores.T)]:
        assert spearman(x, y) >= 0.999
        assert topk_overlap(x, y, 0.05) == 1.0
    assert np.abs(t.scores - base.scores).max() > 0  # bfloat16 does round: the check is not vacuous


def test_column_groups_on_the_host_through_the_trainer_resume_and_match_the_function(tmp_path):
    holding = {"column_groups": 2, "device": "cpu"}
    m1 = InfluenceScoringModule(build_float64(), validation_gradients=holding)
    w1 = InfluenceWriter(str(tmp_path), write_every_n_batches=2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer([w1, Crash(after=3)]).predict(m1, datamodule=TinyDM(), return_predictions=False)
    m2 = InfluenceScoringModule(build_float64(), validation_gradients=holding)
    make_trainer([InfluenceWriter(str(tmp_path), write_every_n_batches=2)]).predict(
        m2, datamodule=TinyDM(), return_predictions=False)
    assert m2.n_skipped == w1.rows_written > 0 and m2.scorer.earlier == {}  # the earlier pass skipped them too
    table = ScoreTable.load(str(tmp_path / SCORES_FILE))
    assert_table_equal(table, reference(), rtol=1e-12)  # float64: the passes' rounding is far below this
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["scoring"]["validation_gradients"] == {"dtype": "float32", "device": "cpu", "column_groups": 2}
    assert settings["scorer"]["column_groups"] == 2
    # another holding is another setting: an output written with one is not resumed with another
    with pytest.raises(ValueError, match="produced from different inputs"):
        make_trainer([InfluenceWriter(str(tmp_path))]).predict(InfluenceScoringModule(build_float64()),
                                                               datamodule=TinyDM(), return_predictions=False)


HOLDINGS = [None, {"dtype": "bfloat16"}, {"device": "cpu"}, {"column_groups": 2},
            {"dtype": "bfloat16", "device": "cpu", "column_groups": 3}]


@pytest.mark.parametrize("holding", HOLDINGS)
def test_plan_counts_the_validation_gradients_the_scorer_holds(tmp_path, holding):
    model = model32()
    model.config.save_pretrained(tmp_path)
    scorer = InfluenceScorer(model, ScoringConfig(validation_gradients=holding))
    held = []
    finalize = scorer.finalize

    def counted():  # the bytes held after each pass's preparation (column groups: one group's)
        finalize()
        held.append(sum(v.numel() * v.element_size() for v in scorer.V.values()))
        assert all(v.device.type == "cpu" for v in scorer.V.values())

    scorer.finalize = counted
    scorer.fit(batches(VAL, 4))
    scorer.earlier_passes(batches(POOL, 4))
    K = len(scorer.task_names)
    run = M.RunSettings(tasks=K, validation_gradients=holding, max_length=16, batch_size=4)
    sizes, acts, _ = M.model_counts(str(tmp_path), run)
    plan = M.scoring_plan(sizes, acts, run, "tracin")
    vg = M.validation_gradient_bytes([(v.in_features, v.out_features) for v in scorer.linears], K, holding)
    # the plan reads the same layers from the config alone
    assert sorted((l.in_features, l.out_features) for l in sizes.shape.linears if l.tracked) == \
        sorted((v.in_features, v.out_features) for v in scorer.linears)
    on_host = (holding or {}).get("device") == "cpu"
    assert max(held) == vg["held"] > 0
    assert plan.parts.get("validation_gradients", 0.0) == (0.0 if on_host else max(held))
    # held on the host or in bfloat16, the float32 sums are the host's (one group's columns)
    host_sums = on_host or (holding or {}).get("dtype") == "bfloat16"
    assert vg["host"] == (max(held) * (2 if (holding or {}).get("dtype") == "bfloat16" else 1) if host_sums else 0)
    assert vg["passes"] == scorer.stats.get("column_groups", 1) == len(held) - (vg["passes"] > 1)


def test_a_bad_holding_is_a_user_error_named_by_its_owner():
    with pytest.raises(UserInputError, match=r"^InfluenceScoringModule: validation_gradients.dtype must be one of"):
        InfluenceScoringModule(validation_gradients={"dtype": "float16"})
    with pytest.raises(UserInputError, match=r"validation_gradients: unknown key\(s\) \['shards'\]"):
        ScoringConfig(validation_gradients={"shards": 2})
    with pytest.raises(UserInputError, match=r"validation_gradients.column_groups must be an integer >= 1"):
        ScoringConfig(validation_gradients={"column_groups": 0})
    assert ScoringConfig(validation_gradients={"dtype": "float32"}) == ScoringConfig()  # the defaults: today's


def test_plan_says_when_the_store_is_the_better_path(tmp_path, capsys):
    from iprox_lightning.cli import main

    common = ["plan", "--model", "llama-3.2-1b", "--precision", "bf16-mixed", "--device_memory", "80GB",
              "--speed_results", "/nonexistent", "--validation_gradients", '{"dtype": "bfloat16"}']
    with pytest.raises(UserInputError, match=r"scoring \(tracin\) needs .*validation_gradients"):
        main([*common, "--tasks", "93", "--output", str(tmp_path / "many.json")])  # refused at one pass
    assert "the store is better: exact TracIn needs 4 passes over the pool" in capsys.readouterr().out
    many = json.loads((tmp_path / "many.json").read_text())["tracin_or_store"]
    assert many["better"] == "store" and many["fewest_column_groups"] == 4 and many["time_ratio"] == 4.0
    assert many["store_peak"] < 80e9 and many["dense_validation_gradients"]["bfloat16"] > 80e9
    main([*common, "--tasks", "3", "--output", str(tmp_path / "few.json")])
    few = json.loads((tmp_path / "few.json").read_text())["tracin_or_store"]
    assert few["better"] == "exact" and few["fewest_column_groups"] == 1
    assert "exact TracIn is better: one pass fits" in capsys.readouterr().out


DDP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from test_writer_scoring import TinyDM, build_model
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import InfluenceWriter

if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[InfluenceWriter({out!r}, write_every_n_batches=1)])
    module = InfluenceScoringModule(build_model(), validation_gradients={{"column_groups": 2, "device": "cpu"}})
    trainer.predict(module, datamodule=TinyDM(), return_predictions=False)
"""


@pytest.mark.distributed
def test_column_groups_on_the_host_under_two_processes_equal_one_process(tmp_path):
    import os
    import subprocess
    import textwrap

    out = tmp_path / "scores"
    script = tmp_path / "ddp_score.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    # each rank scores its share in both passes. The sampler pads 17 examples to 18 by repeating the first on rank 1,
    # in another batch: the row kept may come from that batch, whose padding changes the rounding (measured 1e-7
    # relative in float64, as without column groups; the module test's DDP check allows 1e-5)
    assert_table_equal(ScoreTable.load(str(out / SCORES_FILE)), reference(), rtol=1e-6)


def test_smollm2s_holdings_keep_the_ranking_as_recorded():
    """Each holding on SmolLM2-135M-Instruct (the shared GGUF), recorded by ``bench/validation_holding.py smollm2``
    (minutes under the machine's model lock; its command in the JSON): ``train.py predict`` with the shipped
    ``configs/score.yaml``, every score column (``score`` and a column per eval task) against the default holding's
    with Spearman >= 0.999 and the same top 5% (issue 64's bar). No model run here: the check reads the record."""
    doc = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "plan" /
                      "validation_holding_smollm2.json").read_text())
    assert "smollm2" in doc["command"]
    holdings = {k: v for k, v in doc["results"].items() if k != "default"}
    # bfloat16 on the host in 2 column groups: every lossy option at once (on a CPU the host holding alone is the
    # default's memory, bit-identical: test_host_storage_and_column_groups_equal_the_default_scores)
    assert "bfloat16_host_groups_2" in holdings
    for name, r in holdings.items():
        assert r["columns"] == len(r["per_column"]) >= 4, name  # ``score`` and the three eval tasks
        for column, c in r["per_column"].items():
            assert c["spearman"] >= 0.999 and c["top5%"] == 1.0, (name, column, c)
    assert holdings["bfloat16_host_groups_2"]["max_abs_diff"] > 0  # bfloat16 does round: the check is not vacuous
