"""Stage 1 at scale in one process: probes a group of layers at a time, the layers' share per rank, the proxy built
without a dense copy of the target, and Stage 1 in the run's weights (``bf16-true``).

The two-process side (each rank its share of the decompositions, bitwise one process's factors) is
``tests/test_distributed_ipsvd.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_probes import make_batches  # noqa: E402

from iprox_lightning.compression.apply import CompressionConfig, compress  # noqa: E402


def _model():
    from iprox_lightning.models.tiny import tiny_causal_lm

    return tiny_causal_lm("llama", seed=5, num_layers=3)


def _compress(settings: dict, group: int | None):
    model = _model()
    report = compress(model, make_batches(n_examples=6, batch_size=3, seed=2),
                      CompressionConfig(sparsity=0.5, num_probe_tokens=24, **settings), progress=False,
                      probe_group_layers=group)
    return model.state_dict(), report


@pytest.mark.parametrize("settings", [dict(allocation="uniform"), dict(allocation="uniform", mode="core"),
                                      dict(method="svd", allocation="global"),
                                      dict(allocation="global", drop_blocks=1, keep_dense=[r"layers\.0\.mlp"]),
                                      dict(allocation="global")])
@pytest.mark.parametrize("group", [1, 4])
def test_probes_a_group_at_a_time_give_the_single_pass_factors(settings, group):
    ref_state, ref = _compress(settings, None)
    state, rep = _compress(settings, group)
    assert set(state) == set(ref_state)
    assert rep.ranks == ref.ranks
    assert (rep.probe_tokens, rep.probe_examples, rep.params_after) == (ref.probe_tokens, ref.probe_examples,
                                                                        ref.params_after)
    exact = settings.get("allocation") == "uniform" or settings.get("method") == "svd"
    for k in ref_state:
        if exact or not k.endswith((".A", ".B")):  # the same probe columns, the same functions on them: bitwise
            assert torch.equal(state[k], ref_state[k]), k
        else:  # global IPSVD: a layer whose decomposition a group has no room to keep is decomposed again at its rank
            # (the same eigendecomposition, its vectors sliced before the products that map them back): rounding
            err = float((state[k] - ref_state[k]).norm() / ref_state[k].norm())
            assert err <= 1e-6, (k, err)
    for a, b in zip(rep.layers, ref.layers):  # each layer's objective: from the same probes and the same factors
        assert (a.name, a.rank, a.mode) == (b.name, b.rank, b.mode)
        if exact:
            assert a.objective == b.objective and a.objective_dense == b.objective_dense
        elif b.objective is not None:
            assert a.objective == pytest.approx(b.objective, rel=1e-6)


def test_a_short_probe_set_is_reported_once_whatever_the_groups(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="iprox_lightning.compression.probes"):
        compress(_model(), make_batches(n_examples=6, batch_size=3, seed=2),
                 CompressionConfig(sparsity=0.5, num_probe_tokens=10_000), progress=False, probe_group_layers=2)
    assert sum("valid tokens" in r.getMessage() for r in caplog.records) == 1


def test_layers_are_shared_largest_first_and_grouped_in_model_order():
    from iprox_lightning.compression.schedule import assign_layers, decomposition_cost, probe_groups

    shapes = {"q": (64, 64), "k": (16, 64), "up": (256, 64), "down": (64, 256), "o": (64, 64)}
    owner = assign_layers(shapes, 2)
    # brute force: the largest first, each to the least loaded rank (ties: the lower rank)
    load, want = [0, 0], {}
    for name in sorted(shapes, key=lambda n: -decomposition_cost(*shapes[n])):
        r = 0 if load[0] <= load[1] else 1
        want[name] = r
        load[r] += decomposition_cost(*shapes[name])
    assert owner == want and list(owner) == list(shapes)
    assert owner["up"] != owner["down"]  # the two largest on different ranks
    assert assign_layers(shapes, 1) == {n: 0 for n in shapes}
    assert probe_groups(["a", "b", "c"], 2) == [["a", "b"], ["c"]]
    assert probe_groups(["a", "b", "c"], None) == [["a", "b", "c"]]


def test_a_bad_probe_group_is_a_user_error_naming_the_option():
    from iprox_lightning.callbacks import IPSVDCallback
    from iprox_lightning.errors import UserInputError

    for bad in (0, -1, 1.5, True):
        with pytest.raises(UserInputError, match="probe_group_layers"):
            IPSVDCallback(sparsity=0.5, probe_group_layers=bad)


def _fit_stage_one(precision: str, **callback):
    """``ProxyAlignModule`` + ``IPSVDCallback`` on the tiny model; what the proxy and teacher were during Stage 1."""
    import lightning as L
    from torch.utils.data import DataLoader

    from iprox_lightning.callbacks import IPSVDCallback
    from iprox_lightning.modules import ProxyAlignModule

    seen: dict = {}

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(make_batches(n_examples=2, batch_size=2, seed=10), batch_size=None)

        def probe_dataloader(self):
            return make_batches(n_examples=6, batch_size=3, seed=2)

    class Watch(L.Callback):  # runs before IPSVDCallback (given first): what Stage 1 starts from
        def setup(self, trainer, pl_module, stage):
            pl_module.configure_model()
            seen["shared"] = sum(a is b for a, b in zip(pl_module.proxy.parameters(), pl_module.teacher.parameters()))
            seen["params"] = sum(1 for _ in pl_module.teacher.parameters())

    class After(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            teacher_ids = {id(p) for p in pl_module.teacher.parameters()}
            seen["shared_after"] = sum(id(p) in teacher_ids for p in pl_module.proxy.parameters())
            seen["layers"] = {lr.name: lr.rank for lr in pl_module.ipsvd_report.layers}
            seen["teacher_dtype"] = {p.dtype for p in pl_module.teacher.parameters()}
            seen["state"] = {k: v.detach().clone() for k, v in pl_module.proxy.state_dict().items()}

    module = ProxyAlignModule(target=_model(), kl_weight=0.1, lr=1e-3, log_layer_cosines=False, keep_best=False)
    stage_one = IPSVDCallback(sparsity=0.5, num_probe_tokens=24, health_batches=0, **callback)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        precision=precision, callbacks=[Watch(), stage_one, After()])
    orig = stage_one._stage_one

    def spy(trainer, pl_module, model, exchange=None):
        seen["stage1_dtype"] = {p.dtype for p in model.parameters()}
        seen["stage1_teacher_dtype"] = {p.dtype for p in pl_module.teacher.parameters()}
        return orig(trainer, pl_module, model, exchange)

    stage_one._stage_one = spy
    trainer.fit(module, datamodule=Data())
    return seen, module


def test_the_proxy_shares_the_teachers_tensors_until_compressed_then_holds_its_own():
    seen, module = _fit_stage_one("32-true")
    assert seen["shared"] == seen["params"]  # no dense copy of the target: the proxy is the teacher's tensors
    assert seen["shared_after"] == 0  # compressed: its embeddings, norms, head are its own copies (Stage 2 as before)
    ref_state, ref = _compress({}, None)  # and the factors are one process's compress of a (deep) copy
    assert seen["layers"] == ref.ranks
    for k, v in ref_state.items():
        assert torch.equal(seen["state"][k], v), k
    # a step of Stage 2 changed only the proxy's factors: the teacher's tensors are untouched
    for (k, p), t in zip(_model().named_parameters(), module.teacher.parameters()):
        assert torch.equal(p, t), k


def test_stage_one_runs_on_the_weights_of_bf16_true():
    seen, _ = _fit_stage_one("bf16-true", probe_group_layers=3)
    assert seen["stage1_dtype"] == {torch.bfloat16} and seen["stage1_teacher_dtype"] == {torch.bfloat16}
    seen32, _ = _fit_stage_one("bf16-mixed")  # mixed precision keeps float32 (master) weights
    assert seen32["stage1_dtype"] == {torch.float32} and seen32["teacher_dtype"] == {torch.float32}


def test_bf16_true_loads_the_target_in_bfloat16(monkeypatch):
    """The run converts both models to bfloat16: loading them so spares the float32 model's moment in memory."""
    import lightning as L

    import iprox_lightning.alignment.module as align_module
    from iprox_lightning.modules import ProxyAlignModule

    asked = []
    real = align_module.resolve_model
    monkeypatch.setattr(align_module, "resolve_model", lambda source, dtype: asked.append(dtype) or real(source, dtype))
    for precision, want in (("bf16-true", "bfloat16"), ("bf16-mixed", "float32")):
        module = ProxyAlignModule(target="builtin", log_layer_cosines=False)
        module.trainer = L.Trainer(accelerator="cpu", precision=precision, logger=False)
        module.configure_model()
        assert asked[-1] == want and {p.dtype for p in module.teacher.parameters()} == {getattr(torch, want)}

