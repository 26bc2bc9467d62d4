"""``train.py plan``'s rows for scoring with the proxy, the proxy's store build, the query and LESS / ``checkpoints``
(issues 64 and 66), against what the code holds: the target freed before the proxy's pool pass (weak references
through ``InfluenceScoringModule``), LESS's weights, Adam moments and validation gradients per checkpoint (the bytes of
the tensors the scorers hold, counted at the first scored batch). The peaks measured on the CPU are
``tests/test_plan_proxy_measured.py``'s."""
from __future__ import annotations

import gc
import json
import weakref

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from iprox_lightning.analysis import memory as M
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import InfluenceScoringModule
from test_scoring_influence import TINY, collate, make_examples, make_proxy

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]

POOL = make_examples(6, seed=11, tasks=["x", "y"])
VAL = make_examples(6, seed=12, tasks=["mmlu", "bbh", "tydiqa"])


class DM(L.LightningDataModule):
    def predict_dataloader(self):
        return DataLoader(POOL, batch_size=3, collate_fn=collate)

    def validation_dataloader(self):
        return DataLoader(VAL, batch_size=3, collate_fn=collate)


class Seen(L.Callback):
    """Whether the validation model is alive at each scored batch."""

    def __init__(self, refs):
        self.refs, self.alive = refs, []

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        gc.collect()
        self.alive.append([r() is not None for r in self.refs])


@pytest.mark.parametrize("holding", [None, {"column_groups": 2}])
def test_the_target_is_freed_before_the_proxys_pool_pass(holding):
    """``InfluenceScoringModule(model=<proxy>, validation_model=<target>)`` loads the target for the preparation only:
    no reference to it is left when the pool is scored (with column groups: after the last group's preparation), as
    ``plan``'s ``scoring with the proxy`` counts it (the pool pass holds the proxy alone)."""
    refs = []

    def load():  # the module's loader of a validation_model given by name
        with torch.inference_mode(False):  # (as load_model builds it: weights autograd can use)
            net = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
        refs.append(weakref.ref(net))
        return net

    module = InfluenceScoringModule(make_proxy("llama", seed=0), validation_model="the-target",
                                    **({"validation_gradients": holding} if holding else {}))
    module._load_validation_model = load
    seen = Seen(refs)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen])
    trainer.predict(module, datamodule=DM(), return_predictions=False)
    assert len(refs) == 1 and seen.alive == [[False], [False]]  # loaded once, gone at both batches
    assert module.n_scored == len(POOL)
    assert module.scorer.stats["validation_model"] == "other"


def _plan(model, **kw):
    run = M.RunSettings(**kw)
    sizes, acts, acts32 = M.model_counts(model, run)
    return {s.stage: s for s in M.plan_stages(sizes, None, run, acts=acts, acts32=acts32)}, sizes, run


def test_the_proxy_rows_count_the_target_only_where_the_code_holds_it():
    """The proxy's rows: its scoring holds the target in its preparation (with its activations) and not in the pool
    pass; its store build never reads the target; a proxy store's query holds both (the target's backward, the
    proxy's factors); the validation gradients are the proxy's factors' (fewer than the target's)."""
    stages, sizes, run = _plan("smollm2-135m", precision="bf16-mixed", batch_size=2)
    psizes, _ = M.proxy_model(sizes, M.model_counts("smollm2-135m", run)[1], run)
    wb = M.weight_bytes(run.precision)
    assert psizes.params < sizes.params and psizes.shape.num_layers == sizes.shape.num_layers
    assert M.tracked_weights(psizes.shape) and all(min(i, o) < sizes.shape.hidden_size
                                                  for i, o in M.tracked_weights(psizes.shape)[::2])
    score = stages[M.PROXY_SCORING]
    assert score.parts["proxy"] == psizes.params * wb
    if "target" in score.parts:  # the preparation is the peak: both models and the target's activations
        assert score.parts["target"] == sizes.params * wb and "target_activations" in score.parts
    dense_v = stages["scoring (tracin)"].parts["validation_gradients"]
    assert 0 < score.parts["validation_gradients"] < dense_v
    store = stages[M.PROXY_STORE]
    assert store.parts["weights"] == psizes.params * wb and "target" not in store.parts
    assert store.peak < stages["store build"].peak
    q = stages[M.PROXY_QUERY]
    assert q.parts["weights"] == psizes.params * wb and q.parts["target"] == sizes.params * wb
    assert stages[M.QUERY].parts["weights"] == sizes.params * wb and "target" not in stages[M.QUERY].parts


def test_plan_fit_lowers_the_proxy_rows_and_prints_their_overlay(capsys, tmp_path):
    """``plan --fit`` searches the new rows: each, given a device between its peak at batch 1 and at the configs'
    batch, fits at a smaller batch (the query's batch as ``query --batch_size``); the command prints the rows."""
    from iprox_lightning.analysis import fit as F
    from iprox_lightning.cli import main

    run = M.RunSettings(precision="bf16-mixed", batch_size=8)
    sizes, acts, acts32 = M.model_counts("smollm2-135m", run)
    fns = F.stage_functions(sizes, acts, acts32, run)
    for stage in (M.PROXY_SCORING, M.PROXY_STORE, M.QUERY, M.PROXY_QUERY):
        import dataclasses

        lo, hi = fns[stage](dataclasses.replace(run, batch_size=1)).peak, fns[stage](run).peak
        assert lo < hi, stage
        (f,) = F.fit_stages(sizes, acts, acts32, run, (lo + hi) / 2, [stage])
        assert f.fits and 1 <= f.settings["batch_size"] < 8 and f.plan.peak <= (lo + hi) / 2, (stage, f.settings)
    ov = F.overlays([f], "tracin")
    assert ov["query"] == ["--batch_size", str(f.settings["batch_size"])]
    out = tmp_path / "plan.json"
    main(["plan", "--model", "smollm2-135m", "--precision", "bf16-mixed", "--device_memory", "80GB", "--fit", "true",
          "--output", str(out)])
    text = capsys.readouterr().out
    fit = {s["stage"]: s for s in json.loads(out.read_text())["fit"]["stages"]}
    for stage in (M.PROXY_SCORING, M.PROXY_STORE, M.QUERY, M.PROXY_QUERY):
        assert stage in text and fit[stage]["fits"] and not fit[stage]["settings"], (stage, fit[stage])


def test_less_is_planned_over_the_adapters_and_needs_lora(capsys):
    """``plan --method less`` needs ``--lora`` (LESS scores the adapters' gradients); with it the LESS row's Adam
    moments are the adapters' (two float32 per adapter parameter), and ``--checkpoints 4`` holds one base and four of
    every checkpoint's adapters, moments and validation gradients (dense checkpoints: four models)."""
    from iprox_lightning.cli import main

    from iprox_lightning.errors import UserInputError

    with pytest.raises(UserInputError, match="method less scores a LoRA checkpoint's adapter gradients"):
        main(["plan", "--model", "smollm2-135m", "--method", "less"])
    lora = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    one, sizes, run = _plan("smollm2-135m", lora=M.with_lora_targets(lora, "smollm2-135m"), method="less")
    four = _plan("smollm2-135m", lora=run.lora, method="less", checkpoints=4)[0]
    n = M.lora_params(sizes, run.lora)
    less = one["scoring (less)"]
    assert less.parts["adam_moments"] == 2 * 4.0 * n
    assert less.parts["weights"] == (sizes.params + n) * 4
    assert less.parts["validation_gradients"] == run.tasks * 4.0 * n
    for k in ("adam_moments", "validation_gradients"):
        assert four["scoring (less)"].parts[k] == 4 * less.parts[k]
    assert four["scoring (less)"].parts["weights"] == (sizes.params + 4 * n) * 4
    assert four["scoring (less)"].parts["activations"] == less.parts["activations"]
    assert four["scoring (tracin)"].parts["weights"] == 4 * one["scoring (tracin)"].parts["weights"]


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
LESS_DATA = {"builtin_size": 24, "max_length": 32, "batch_size": 8}


@pytest.fixture(scope="module")
def lora_warmup(tmp_path_factory):
    """A LoRA warm-up of the demo's model (``configs/warmup.yaml`` with ``lora``, 2 epochs on 24 examples): its
    directory, with an adapter and its Adam state per epoch."""
    from iprox_lightning.cli import main

    root = tmp_path_factory.mktemp("lora")
    main(["fit", "--config", str(ROOT / "configs" / "warmup.yaml"), "--config",
          str(ROOT / "configs" / "builtin" / "warmup.yaml"), "--trainer.max_epochs", "2", "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
          "--model.init_args.save_dir", str(root / "warmup"), "--model.init_args.lora", json.dumps(LORA),
          *[a for k, v in LESS_DATA.items() for a in (f"--data.init_args.{k}", str(v))]])
    return root / "warmup"


class Held(L.Callback):
    """The bytes of what the scorers hold at the first scored batch: the models' distinct parameter storages and the
    checkpoints' adapter tensors (those in place and those held aside), the metrics' Adam moments, the validation
    gradients."""

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx:
            return
        seen, weights = set(), 0
        held = [t for a in pl_module.checkpoint_adapters if a is not None for t in a.values()]
        for t in [p for _, sc in pl_module.scorers for p in sc.model.parameters()] + held:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                weights += t.untyped_storage().nbytes()
        self.shared = len({id(sc.model) for _, sc in pl_module.scorers}) == 1 and len(held) > 0
        self.held = {"weights": weights,
                     "adam_moments": sum(m.nbytes + v.nbytes for _, sc in pl_module.scorers
                                         for m, v, _ in sc.metric.moments.values()),
                     "validation_gradients": sum(V.nbytes for _, sc in pl_module.scorers for V in sc.V.values()),
                     "tasks": len(pl_module.scorer.task_names)}


def test_less_over_checkpoints_holds_what_plan_counts(lora_warmup):
    """``method: less`` with ``checkpoints`` (two epochs' adapters over one base): the base once, every checkpoint's
    adapters, Adam moments (two float32 per adapter parameter) and validation gradients are held while the pool is
    scored: the bytes of those tensors equal ``plan``'s ``scoring (less)`` parts at ``checkpoints`` 2 (exactly: the
    same tensors counted)."""
    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.models.builtin import builtin_model

    ckpts = [{"path": str(lora_warmup / "adapters" / f"epoch_{e}")} for e in (1, 2)]
    module = InfluenceScoringModule(checkpoints=ckpts, method="less", per_task=True)
    held = Held()
    dm = SFTDataModule(tokenizer=str(lora_warmup), pool="builtin", validation="builtin", **LESS_DATA)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[held],
                        inference_mode=False)  # (as configs/score.yaml)
    first = trainer.predict(module, datamodule=dm)
    config = builtin_model().config
    run = M.RunSettings(precision="32-true", batch_size=LESS_DATA["batch_size"], max_length=LESS_DATA["max_length"],
                        method="less", tasks=held.held["tasks"], checkpoints=len(ckpts),
                        lora={**LORA, "target_modules": list(LORA["target_modules"])})
    acts, acts32 = M.run_activations(config, run)
    sizes = M.ModelSizes.from_config(config, name="builtin")
    plan = M.less_scoring_plan(sizes, acts, run)
    for k in ("weights", "adam_moments", "validation_gradients"):
        assert plan.parts[k] == held.held[k], (k, plan.parts[k], held.held[k])
    assert held.held["tasks"] > 1 and len(module.scorers) == 2 and held.shared  # one model, two adapters
    # between batches and after the run the model holds the first checkpoint's adapters: a second run scores the same
    from iprox_lightning.models.loading import load_model
    from iprox_lightning.models.lora import adapter_weights

    own = adapter_weights(load_model(ckpts[0]["path"], tokenizer=False, merge_adapters=False)[0])
    assert all(torch.equal(t, own[k]) for k, t in adapter_weights(module.net).items())
    again = trainer.predict(module, datamodule=dm)
    for a, b in zip(first, again):
        assert a["id"] == b["id"] and (a["task_scores"] == b["task_scores"]).all()


def test_less_over_checkpoints_in_turn_holds_what_plan_counts(lora_warmup, monkeypatch):
    """``checkpoints_in_turn``: while each checkpoint scores the pool (its own pass, or the live loop for the first)
    only its Adam moments and validation gradients are alive (no earlier scorer's), equal to ``plan --checkpoints_in_turn``'s
    ``scoring (less)`` parts exactly, and the scores are the batch-by-batch ones bit for bit."""
    import gc
    import weakref

    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.models.builtin import builtin_model
    from iprox_lightning.scoring.influence import InfluenceScorer

    ckpts = [{"path": str(lora_warmup / "adapters" / f"epoch_{e}")} for e in (1, 2)]
    alive, held, score = weakref.WeakSet(), [], InfluenceScorer.score_batch

    def scoring(self, batch):  # at each scorer's first batch: what every scorer alive holds
        if self not in alive:
            gc.collect()
            alive.add(self)
            held.append({"scorers": len(alive),
                         "adam_moments": sum(m.nbytes + v.nbytes for sc in alive
                                             for m, v, _ in sc.metric.moments.values()),
                         "validation_gradients": sum(V.nbytes for sc in alive for V in sc.V.values())})
        return score(self, batch)

    dm = SFTDataModule(tokenizer=str(lora_warmup), pool="builtin", validation="builtin", **LESS_DATA)

    def run(in_turn):
        module = InfluenceScoringModule(checkpoints=ckpts, method="less", per_task=True, checkpoints_in_turn=in_turn)
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, inference_mode=False)
        return trainer.predict(module, datamodule=dm)

    together = run(False)
    monkeypatch.setattr(InfluenceScorer, "score_batch", scoring)
    in_turn = run(True)
    assert [h["scorers"] for h in held] == [1, 1]  # the second checkpoint's pass, then the first's live loop
    config = builtin_model().config
    settings = dict(precision="32-true", batch_size=LESS_DATA["batch_size"], max_length=LESS_DATA["max_length"],
                    method="less", checkpoints=len(ckpts), lora={**LORA, "target_modules": list(LORA["target_modules"])})
    tasks = len(in_turn[0]["task_names"])
    acts, _ = M.run_activations(config, M.RunSettings(**settings, tasks=tasks))
    sizes = M.ModelSizes.from_config(config, name="builtin")
    plan = M.less_scoring_plan(sizes, acts, M.RunSettings(**settings, tasks=tasks, checkpoints_in_turn=True))
    for k in ("adam_moments", "validation_gradients"):
        assert all(plan.parts[k] == h[k] for h in held), (k, plan.parts[k], held)
    for a, b in zip(together, in_turn):
        assert a["id"] == b["id"] and (a["score"] == b["score"]).all() and (a["task_scores"] == b["task_scores"]).all()
