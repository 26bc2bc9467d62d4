"""``pipeline --devices/--num_nodes/--strategy/--precision``: every stage's overlay carries them, the held-out evaluation
runs in the precision, bad values are refused up front, and a 2-process gloo DDP pipeline runs on the built-in demo
(each Lightning stage in its own processes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from iprox_lightning.commands import pipeline as pipeline_command
from iprox_lightning.workflow import pipeline as workflow, settings as workflow_settings, stages as workflow_stages
from iprox_lightning.errors import UserInputError

HARDWARE = dict(accelerator="cpu", devices=1, num_nodes=1, strategy="ddp", precision="bf16-mixed")


class _Stop(Exception):
    pass


def test_every_stage_overlay_gets_the_trainer_hardware_and_evaluation_its_device_and_precision(tmp_path, monkeypatch):
    """Each stage helper writes its overlay, then runs it: a runner that stops at once leaves the overlay to read."""
    ran = []

    def stop(args):
        ran.append(args)
        raise _Stop

    hardware = workflow_settings.trainer_hardware(**HARDWARE)
    stages = workflow_stages._stage_runner(tmp_path, None, True, False, {"target": "builtin", "pool": "builtin",
                                                                          "validation": "builtin"}, hardware, stop)
    data = {"pool": "builtin", "validation": "builtin", "seed": 0}
    warm, proxy = tmp_path / "warmup" / "model", tmp_path / "proxy" / "model"
    steps = {
        "warmup": lambda: workflow._warm_up(stages, "builtin", data, 0),
        "build_proxy": lambda: workflow._build_proxy(stages, warm, data, 0, 0.5, None),
        "score_target": lambda: workflow._score_pool(stages, warm, proxy, data, 0, "tracin"),
        "finetune_random": lambda: workflow._finetune_and_evaluate(
            stages, warm, {"random": tmp_path / "random.jsonl"}, [], "builtin", "builtin", data, 0, None),
    }
    for name, step in steps.items():
        with pytest.raises(_Stop):
            step()
        overlay = yaml.safe_load((tmp_path / "configs" / f"{name}.yaml").read_text())
        assert {k: overlay["trainer"][k] for k in HARDWARE} == HARDWARE, name
        assert ran[-1][-1] == str(tmp_path / "configs" / f"{name}.yaml")  # the overlay is the last config
    # the held-out evaluation (not a Trainer: one process) gets the accelerator's device and the precision
    seen = {}
    monkeypatch.setattr(workflow_stages._StageRunner, "run", lambda self, *a, **k: None)
    monkeypatch.setattr("iprox_lightning.evaluation.effect.selection_effect",
                        lambda *a, **k: seen.update(k) or {"metrics": {}})
    workflow._finetune_and_evaluate(stages, warm, {"random": tmp_path / "random.jsonl"}, [], "builtin",
                                            "builtin", data, 0, None)
    assert (seen["device"], seen["precision"]) == ("cpu", "bf16-mixed")
    # not given: the stage configs' own values (no key in the overlay)
    assert workflow_settings.trainer_hardware("cpu", 1, None, None, None) == {"accelerator": "cpu", "devices": 1}
    assert workflow_settings.trainer_hardware("gpu", 2, None, "lightning.pytorch.strategies.ModelParallelStrategy",
                                             "bf16-true")["strategy"] == {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}


@pytest.mark.parametrize("bad, option", [(dict(devices=0), "devices"), (dict(num_nodes=True), "num_nodes"),
                                         (dict(strategy="dpp"), "strategy"), (dict(precision="bf16-half"), "precision")])
def test_bad_hardware_is_refused_before_any_stage_naming_the_option(tmp_path, bad, option):
    with pytest.raises(UserInputError, match=f"^(pipeline: )?{option}"):
        pipeline_command.pipeline(workdir=str(tmp_path / "w"), **bad)
    assert not (tmp_path / "w").exists()


def test_heldout_evaluation_runs_in_the_given_precision(tmp_path):
    """bf16-true evaluates the bf16-cast weights, bf16-mixed the float32 weights under autocast: each equals
    ``heldout_metrics`` run that way by hand, and both differ from float32 by bf16 rounding only."""
    from contextlib import nullcontext

    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.data.synthetic import builtin_validation
    from iprox_lightning.evaluation.heldout import evaluate_heldout, heldout_metrics
    from iprox_lightning.models.builtin import builtin_model

    torch.set_num_threads(1)
    builtin_model(seed=3).save_pretrained(tmp_path / "m")
    records = builtin_validation(6, seed=0)
    loader = SFTDataModule(pool=list(records), validation=None, tokenizer="builtin",
                           max_length=64).records_dataloader(records, batch_size=32)
    got = {p: evaluate_heldout(str(tmp_path / "m"), records, "builtin", max_length=64, device="cpu", precision=p)
           for p in (None, "32-true", "bf16-true", "bf16-mixed")}
    for p, (cast, context) in {"bf16-true": (torch.bfloat16, nullcontext()),
                               "bf16-mixed": (None, torch.autocast("cpu", dtype=torch.bfloat16))}.items():
        model = builtin_model(seed=3)
        with context:
            ref = heldout_metrics(model.to(cast) if cast else model, loader)
        assert got[p]["loss"] == pytest.approx(ref["loss"], rel=1e-6), p
        assert got[p]["loss"] != got[None]["loss"] and got[p]["loss"] == pytest.approx(got[None]["loss"], rel=2e-2)
    assert got["32-true"] == got[None]
    with pytest.raises(UserInputError, match="precision 'transformer-engine'"):
        evaluate_heldout(str(tmp_path / "m"), records, "builtin", device="cpu", precision="transformer-engine")


@pytest.mark.distributed
def test_two_process_ddp_pipeline_runs_every_stage_in_its_own_gloo_processes(tmp_path):
    """``pipeline --devices 2 --strategy ddp`` on a 300-example built-in pool, without fine-tuning: warm-up,
    build_proxy, both scorings run as 2-process gloo DDP stages (their logs say so), every pool example is scored once
    by each model, and the selections are made."""
    import pyarrow.parquet as pq

    wd = tmp_path / "w"
    summary = pipeline_command.pipeline(workdir=str(wd), devices=2, strategy="ddp", finetune=False,
                                        data_args={"builtin_size": 300})
    stages = ("warmup", "build_proxy", "score_target", "score_proxy")
    for stage in stages:
        log = (wd / "logs" / f"{stage}.out").read_text()
        assert "Starting with 2 processes" in log and "distributed_backend=gloo" in log, stage
        overlay = yaml.safe_load((wd / "configs" / f"{stage}.yaml").read_text())
        assert (overlay["trainer"]["devices"], overlay["trainer"]["strategy"]) == (2, "ddp")
    assert "IPSVDCallback: ipsvd/exact at sparsity 0.5" in (wd / "logs" / "build_proxy.out").read_text()
    for who in ("target", "proxy"):
        ids = pq.read_table(wd / "scores" / who / "scores.parquet", columns=["id"]).column("id").to_pylist()
        assert len(ids) == len(set(ids)) == 300
    assert summary["retention_proxy_vs_target"]["n"] == 300 and summary["retention_proxy_vs_target"]["spearman"] > 0.5
    assert list(json.loads((wd / "summary.json").read_text())["stages"]) == [
        "warmup", "build_proxy", "score:target", "score:proxy"]
