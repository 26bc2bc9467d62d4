"""The validation pass's own batch (``InfluenceScoringModule(validation_batch_size=...)``, issue 64's follow-up): the
scores do not depend on it (so it is not fingerprinted), the validation model sees batches of it, ``plan`` prices the
proxy row's preparation at it and the pool pass at the scoring batch, and ``plan --fit`` chooses both and writes them
as the overlay ``predict`` (the score stage) takes."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from iprox_lightning.analysis import fit as F
from iprox_lightning.analysis import memory as M
from iprox_lightning.errors import UserInputError
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import InfluenceScoringModule, InfluenceWriter, ScoreTable
from test_scoring_influence import TINY, collate, make_examples, make_proxy

ROOT = Path(__file__).resolve().parents[1]
POOL = make_examples(7, seed=11, tasks=["x", "y"])
VAL = make_examples(7, seed=12, tasks=["mmlu", "bbh", "tydiqa"])


class DM(L.LightningDataModule):
    def predict_dataloader(self):
        return DataLoader(POOL, batch_size=4, collate_fn=collate)

    def validation_dataloader(self):
        return DataLoader(VAL, batch_size=4, collate_fn=collate)


def _score(out: Path, validation_batch_size, proxy: bool):
    """Score POOL into ``out`` (float64 tiny models): the proxy against the target's validation gradients, or the
    target alone; returns the module and the batch sizes of the target's forwards with gradients, in order."""
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    seen: list[int] = []
    target.get_input_embeddings().register_forward_hook(  # the backwards' forwards (not the head's no-grad probe)
        lambda m, i, o: seen.append(int(i[0].shape[0])) if torch.is_grad_enabled() else None)
    kw = {"validation_batch_size": validation_batch_size} if validation_batch_size is not None else {}
    module = (InfluenceScoringModule(make_proxy("llama", seed=0), validation_model=target, **kw) if proxy
              else InfluenceScoringModule(target, **kw))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[InfluenceWriter(str(out), write_every_n_batches=1)])
    trainer.predict(module, datamodule=DM(), return_predictions=False)
    return module, seen


@pytest.mark.parametrize("proxy", [False, True], ids=["target", "proxy_against_target"])
def test_scores_do_not_depend_on_the_validation_batch_and_it_is_not_fingerprinted(tmp_path, proxy):
    """Each validation batch size gives the default's scores and ranking; the validation model's backward runs on
    batches of it (the pool's stay the data's 4); the fingerprint is the default's, so a run with another validation
    batch resumes the default's directory (every row skipped) instead of refusing it.

    Tolerance: the models are float64, but transformers' LlamaRMSNorm computes in float32 whatever the model's dtype,
    and its reductions round differently with a batch's layout (padded length, rows): measured 2.5e-8 relative
    (2e-9 absolute) here; rtol 1e-6 / atol 1e-7 leave room for any CPU's vector width, far below a ranking change."""
    ref_module, seen = _score(tmp_path / "ref", None, proxy)
    pool_batches = [4, 3] if not proxy else []  # the target scores the pool too when it is the scored model
    assert seen == [4, 3] + pool_batches  # the default: the validation examples in the data's batches
    ref = ScoreTable.load(str(tmp_path / "ref"))
    ref_settings = json.loads((tmp_path / "ref" / "settings.json").read_text())
    for vb, batches in ((1, [1] * 7), (2, [2, 2, 2, 1]), (7, [7])):
        module, seen = _score(tmp_path / str(vb), vb, proxy)
        assert seen == batches + pool_batches, vb
        table = ScoreTable.load(str(tmp_path / str(vb)))
        assert table.ids == ref.ids and table.task_names == ref.task_names
        np.testing.assert_allclose(table.scores, ref.scores, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(table.task_scores, ref.task_scores, rtol=1e-6, atol=1e-7)
        assert np.array_equal(np.argsort(table.scores), np.argsort(ref.scores))
        assert list(module.scorer.val_counts) == list(ref_module.scorer.val_counts)
        settings = json.loads((tmp_path / str(vb) / "settings.json").read_text())
        assert settings["fingerprint"] == ref_settings["fingerprint"] and settings["config"] == ref_settings["config"]
        assert module.hparams["validation_batch_size"] == vb and "validation_batch_size" not in ref_module.hparams
    resumed, _ = _score(tmp_path / "ref", 2, proxy)
    assert resumed.n_scored == 0 and resumed.n_skipped == len(POOL)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4"])
def test_a_bad_validation_batch_is_a_user_error_naming_it(value):
    with pytest.raises(UserInputError, match=r"validation_batch_size must be an integer >= 1"):
        InfluenceScoringModule(tiny_causal_lm("llama", seed=0, **TINY), validation_batch_size=value)


def test_a_validation_loader_that_cannot_be_rebatched_is_named():
    class Iterable(DM):
        def validation_dataloader(self):
            return [collate(VAL[:3])]

    module = InfluenceScoringModule(tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY),
                                    validation_batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(UserInputError, match=r"validation_batch_size re-batches the validation examples.*got list"):
        trainer.predict(module, datamodule=Iterable(), return_predictions=False)


# ------------------------------------------------------------------------------------------------ the plan
@pytest.fixture(scope="module")
def counts():
    run = M.RunSettings(precision="bf16-mixed", batch_size=8)
    return run, M.model_counts("smollm2-135m", run)


def test_the_proxy_row_prices_the_validation_pass_at_its_batch_and_the_pool_at_the_scoring_batch(counts):
    """Scoring with the proxy at (batch 8, validation batch 2): its preparation is the preparation at batch 2, its pool
    pass the pool pass at batch 8, its peak the larger; the default (None) is the scoring batch, as before. The dense
    scoring row counts the larger of the two passes' activations."""
    run, (sizes, acts, _) = counts
    both = dataclasses.replace(run, validation_batch_size=2)
    prep, pool = M.proxy_scoring_phases(sizes, acts, both)
    assert prep == M.proxy_scoring_phases(sizes, acts, dataclasses.replace(run, batch_size=2))[0]
    assert pool == M.proxy_scoring_phases(sizes, acts, run)[1]
    assert M.proxy_scoring_phases(sizes, acts, dataclasses.replace(run, validation_batch_size=8)) == \
        M.proxy_scoring_phases(sizes, acts, run)
    row = M.proxy_scoring_plan(sizes, acts, both)
    assert row.peak == max(sum(prep.values()), sum(pool.values()))
    assert prep["target_activations"] == acts.total(sizes.shape.num_layers, 2)
    assert pool["activations"] == M.proxy_model(sizes, acts, run)[1].total(sizes.shape.num_layers, 8)
    dense = {b: M.scoring_plan(sizes, acts, dataclasses.replace(run, batch_size=b), "tracin") for b in (8, 16)}
    assert M.scoring_plan(sizes, acts, both, "tracin").parts == dense[8].parts  # the pool's pass is the larger
    wide = M.scoring_plan(sizes, acts, dataclasses.replace(run, validation_batch_size=16), "tracin")
    assert wide.parts["activations"] == dense[16].parts["activations"]
    with pytest.raises(UserInputError, match="validation_batch_size must be >= 1"):
        M.RunSettings(validation_batch_size=0)


def test_the_proxy_row_with_its_own_validation_gradients_holds_no_target(counts):
    """``proxy_validation: proxy`` (``pipeline --proxy_validation proxy``): the preparation is the proxy's own backward
    on a validation batch (its activations as the pool pass's at that batch), no target; the pool pass is the same."""
    run, (sizes, acts, _) = counts
    own = dataclasses.replace(run, proxy_validation="proxy", validation_batch_size=2)
    prep, pool = M.proxy_scoring_phases(sizes, acts, own)
    assert "target" not in prep and "target_activations" not in prep
    assert pool == M.proxy_scoring_phases(sizes, acts, run)[1]
    at2 = M.proxy_scoring_phases(sizes, acts, dataclasses.replace(run, batch_size=2))[1]
    assert prep["activations"] == at2["activations"] and prep["lm_head_chunk"] == at2["lm_head_chunk"]
    assert prep["proxy"] == pool["proxy"] and prep["validation_gradients"] == pool["validation_gradients"]
    with_target = M.proxy_scoring_phases(sizes, acts, dataclasses.replace(own, proxy_validation="target"))[0]
    assert sum(prep.values()) < sum(with_target.values())
    with pytest.raises(UserInputError, match="proxy_validation must be one of target, proxy"):
        M.RunSettings(proxy_validation="both")


def _plan(args, capsys):
    from iprox_lightning.cli import main

    try:
        main(["plan", *args])
        code, err = 0, ""
    except UserInputError as e:
        code, err = 2, str(e)
    return code, capsys.readouterr().out, err


def test_plan_fit_chooses_the_largest_pool_and_validation_batches_that_fit(counts, capsys, tmp_path):
    """A device the pool pass at the configs' batch fits and the target's preparation at that batch does not: the fit
    keeps the pool's batch and chooses the largest validation batch that fits (a brute-force search over both agrees),
    writes it in the score stage's overlay, which ``predict`` takes, and as ``plan``'s flag, with which the row fits."""
    run, (sizes, acts, acts32) = counts
    phase = {b: [sum(p.values()) for p in M.proxy_scoring_phases(sizes, acts, dataclasses.replace(run, batch_size=b))]
             for b in range(1, 9)}  # batch -> [preparation, pool pass]
    memory = (max(phase[8][1], phase[1][0]) + phase[8][0]) / 2
    assert phase[8][0] > memory >= phase[8][1]  # the preparation at the pool's batch does not fit
    (f,) = F.fit_stages(sizes, acts, acts32, run, memory, [M.PROXY_SCORING])
    best = max((b, v) for b in range(1, 9) if 8 % b == 0 for v in range(1, b + 1)
               if max(phase[v][0], phase[b][1]) <= memory)
    assert best[0] == 8 and best[1] < 8
    assert f.fits and f.settings == {"validation_batch_size": best[1]}
    assert f.plan.peak == max(phase[best[1]][0], phase[8][1])
    assert any(l.startswith(f"model.validation_batch_size {best[1]} ") for l in f.levers)
    ov = F.overlays([f], "tracin")
    assert ov["stages"] == {"score": {"model": {"init_args": {"validation_batch_size": best[1]}}}}
    assert ov["plan"] == ["--validation_batch_size", str(best[1])]
    base = ["--model", "smollm2-135m", "--precision", "bf16-mixed", "--device_memory", str(int(memory))]
    code, out, _ = _plan(base + ["--output", str(tmp_path / "p.json")], capsys)
    before = {s["stage"]: s for s in json.loads((tmp_path / "p.json").read_text())["stages"]}[M.PROXY_SCORING]
    assert before["peak"] > memory
    code, out, _ = _plan(base + ov["plan"] + ["--output", str(tmp_path / "p.json")], capsys)
    after = {s["stage"]: s for s in json.loads((tmp_path / "p.json").read_text())["stages"]}[M.PROXY_SCORING]
    assert after["peak"] == f.plan.peak <= memory and f"(validation {best[1]}, build_proxy 4)" in out
    # the overlay is what the score stage's command takes (its signature accepts it)
    from iprox_lightning.cli import main

    with pytest.raises(SystemExit) as e:
        main(["predict", "--config", str(ROOT / "configs" / "score.yaml"), "--config",
              json.dumps(ov["stages"]["score"]), "--print_config"])
    assert e.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["validation_batch_size"] == best[1]


def test_the_overlay_drops_a_validation_batch_not_below_the_stages_batch(counts):
    """The score stage's overlay is shared by the target's scoring and the proxy's: where another row lowers the
    scoring batch to the proxy row's validation batch or below, the validation batch is that batch (none written)."""
    run, (sizes, acts, acts32) = counts
    start = dataclasses.replace(run, **F.LEVERS_OFF)
    plan = M.proxy_scoring_plan(sizes, acts, start)
    proxy = F.StageFit(M.PROXY_SCORING, True, {"validation_batch_size": 2}, plan, plan, start)
    dense = F.StageFit("scoring (tracin)", True, {"batch_size": 2}, plan, plan, start)
    ov = F.overlays([dense, proxy], "tracin")
    assert ov["stages"] == {"score": {"data": {"init_args": {"batch_size": 2}}}} and ov["plan"] == ["--batch_size", "2"]
    wider = F.StageFit("scoring (tracin)", True, {"batch_size": 4}, plan, plan, start)
    ov = F.overlays([wider, proxy], "tracin")
    assert ov["stages"] == {"score": {"model": {"init_args": {"validation_batch_size": 2}},
                                      "data": {"init_args": {"batch_size": 4}}}}
    assert ov["plan"] == ["--batch_size", "4", "--validation_batch_size", "2"]
