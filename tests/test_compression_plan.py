"""Compression as plan + apply: ``plan_compression`` leaves the model as it is and says what ``compress`` does
(blocks dropped, ranks), its ``to_dict`` is the manifest's record; ``apply_plan`` consumes a plan."""
import json

import pytest
import torch

from iprox_lightning.compression.apply import CompressionConfig, apply_plan, compress, count_parameters
from iprox_lightning.compression.plan import CompressionPlan, plan_compression
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.engine.model_modes import eval_mode, keep_eval

from test_probes import make_batches


def _model():
    return tiny_causal_lm("llama", seed=0, num_layers=4)


@pytest.mark.parametrize("drop, allocation", [(0, "uniform"), (1, "uniform"), (1, "global")])
def test_plan_leaves_the_model_and_compress_follows_it(drop, allocation):
    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    config = CompressionConfig(sparsity=0.5, num_probe_tokens=24, allocation=allocation, drop_blocks=drop)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_compression(model, config, batches, progress=False)
    assert isinstance(plan, CompressionPlan) and model.config.num_hidden_layers == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # planning touched nothing
    report = compress(model, batches, config, progress=False)
    record = json.loads(json.dumps(plan.to_dict()))  # plain JSON
    assert record["params_requested"] == report.params_requested and record["allocation"] == report.allocation
    if drop:
        assert record["block_drop"]["dropped"] == report.block_drop.dropped and len(record["block_drop"]["kept"]) == 3
    if allocation == "uniform":  # the ranks are final before any probe
        assert plan.ranks == report.ranks
    else:
        assert set(plan.ranks) == set(report.ranks)


def test_apply_plan_uses_the_ranks_it_is_given():
    config = CompressionConfig(sparsity=0.5, method="svd", allocation="uniform")
    model = _model()
    plan = plan_compression(model, config, progress=False)
    first = next(iter(plan.ranks))
    plan.ranks = {n: (2 if n == first else None) for n in plan.ranks}
    n_before = count_parameters(model)
    layers = apply_plan(model, plan, config, None, progress=False)
    assert [lr.rank for lr in layers] == list(plan.ranks.values())
    assert count_parameters(model) < n_before and layers[0].params_after == 2 * (layers[0].in_features
                                                                               + layers[0].out_features)


def test_eval_mode_restores_each_flag_also_on_error():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).eval()
    with pytest.raises(RuntimeError):
        with eval_mode(a, b):
            assert not a.training and not b.training
            raise RuntimeError
    assert a.training and not b.training


def test_keep_eval_turns_train_mode_off_and_leaves_it_off():
    a, b = torch.nn.Sequential(torch.nn.Dropout(0.5)), torch.nn.Linear(2, 2).eval()
    keep_eval(a, b)
    assert not a.training and not a[0].training and not b.training
    a.train()  # as Lightning does at an epoch start
    keep_eval(a, b)
    assert not a.training and not a[0].training
