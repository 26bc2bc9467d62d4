"""Scoring LoRA gradients (issue 66): TracIn, K-FAC, EK-FAC and the gradient store over a peft model's adapter
gradients alone (its ``lora_A`` / ``lora_B`` weights; the base frozen), against brute-force autograd references on a
tiny float64 model; an adapter directory scored through the predict loop records that it scored adapters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from iprox_lightning.engine.target_layers import find_target_linears
from iprox_lightning.models.lora import LoraSettings, add_adapters
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import influence_scores
from iprox_lightning.scoring.projection import GradientProjector

from test_ekfac import FACTOR, KERNEL_ATOL, dense_ekfac_inverse, dense_scores
from test_scoring_influence import (BATCHING_ATOL, TINY, TRAIN, VAL, assert_close_scores, batches, ref_example,
                                    ref_scores)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread

ADAPTERS = LoraSettings(r=2, alpha=4, target_modules=("q_proj", "v_proj", "down_proj"))


def adapted_model(seed=0):
    """A tiny float64 Llama with LoRA adapters on q, v and down; ``lora_B`` drawn at random (peft starts it at zero,
    where every ``lora_A`` gradient would be zero)."""
    model = add_adapters(tiny_causal_lm("llama", seed=seed, dtype=torch.float64, **TINY), ADAPTERS)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def test_a_peft_model_tracks_its_adapters_alone():
    """Without patterns, the tracked weights of a peft model are exactly the parameters peft trains."""
    model = adapted_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 3 * TINY["num_layers"]
    assert [f"{n}.weight" for n in find_target_linears(model)] == trainable
    base = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)  # a dense model: its projections, as before
    assert all(n.endswith("_proj") for n in find_target_linears(base))


@pytest.mark.parametrize("method", ["tracin", "kfac"])
def test_adapter_gradient_scores_equal_the_autograd_reference(method):
    model = adapted_model()
    kw = dict(factor_examples=FACTOR, damping=1e-2) if method == "kfac" else {}
    ref, per_task, tasks = ref_scores(model, TRAIN, VAL, method=method, **kw)
    extra = dict(damping=1e-2, kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, 5)) \
        if method == "kfac" else {}
    table = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), method=method, progress=False, **extra)
    # the adapters alone: as many tracked parameters as peft trains
    assert table.settings["tracked_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # float64; batched and padded (4 rows) against one example at a time: the batching spread of ATen's AVX2 kernels
    # (test_scoring_influence.BATCHING_ATOL, of the largest |score|)
    assert_close_scores(table, ref, per_task, tasks, rtol=BATCHING_ATOL)
    assert all(p.grad is None for p in model.parameters())


def test_adapter_gradient_ekfac_scores_equal_the_dense_reference():
    model = adapted_model()
    want, want_t = dense_scores(model, dense_ekfac_inverse(model, FACTOR, 1e-2), TRAIN, VAL)
    table = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), method="ekfac", damping=1e-2,
                             kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, 5), progress=False)
    np.testing.assert_allclose(table.scores, want, rtol=0, atol=KERNEL_ATOL)
    np.testing.assert_allclose(table.task_scores, want_t, rtol=0, atol=KERNEL_ATOL)


def test_store_vectors_are_the_adapter_gradients():
    """Unprojected (k above every side), a store row is the example's adapter gradient, flattened in model order:
    the autograd gradient of the parameters peft trains."""
    model = adapted_model()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    proj = GradientProjector(model, k=10_000)
    got = torch.cat([proj.project_batch(b)["vectors"] for b in batches(TRAIN, 4)])
    want = torch.stack([torch.cat([ref_example(model, e)[0][n].reshape(-1) for n in names]) for e in TRAIN])
    # float64, batched and padded against one example at a time: the batching spread (BATCHING_ATOL; 1e-7 measured)
    torch.testing.assert_close(got, want, rtol=0, atol=BATCHING_ATOL * float(want.abs().max()))
