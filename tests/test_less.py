"""LESS (issue 66): the Adam-preconditioned training gradient from a checkpoint's saved optimiser state against a real
``torch.optim.AdamW`` step and a hand-computed update, SGD validation gradients, and its optimiser-state file."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from iprox_lightning.engine.batch import per_example_loss
from iprox_lightning.errors import InputNotFoundError, UserInputError
from iprox_lightning.io.optimizer_state import adam_state_of, read_adam_state, save_adam_state
from iprox_lightning.scoring import influence_scores
from iprox_lightning.scoring.config import ScoringConfig

from test_lora_scoring import adapted_model
from test_scoring_influence import BATCHING_ATOL, TRAIN, VAL, batches, collate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread

BETAS, EPS = (0.9, 0.99), 1e-6  # not AdamW's defaults: the file's must be the ones used


def trained(steps=3, seed=0):
    """A LoRA-adapted tiny float64 model after ``steps`` AdamW steps on the training examples, and its optimiser."""
    model = adapted_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.0)
    for s in range(steps):
        b = collate(TRAIN[3 * s:3 * s + 3])
        loss, _ = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                   b["labels"])
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model.eval(), opt


def example_grad(model, ex) -> dict[str, torch.Tensor]:
    """The autograd gradient of ``L(z)`` over the trained (adapter) parameters, by name."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    ids = ex["input_ids"][None]
    loss, _ = per_example_loss(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ex["labels"][None])
    return dict(zip(names, torch.autograd.grad(loss.sum(), params)))


def adamw_step_direction(model, opt, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``-(θ' − θ) / lr`` of one real AdamW step (weight decay 0) from a copy of the checkpoint's optimiser state with
    the example's gradient: Adam's own update direction ``m̂ / (√v̂ + ε)``."""
    named = dict(model.named_parameters())
    params = {n: named[n].detach().clone().requires_grad_(True) for n in grads}
    step = torch.optim.AdamW(list(params.values()), lr=1.0, betas=BETAS, eps=EPS, weight_decay=0.0)
    for n, p in params.items():
        st = copy.deepcopy(opt.state[named[n]])
        step.state[p] = st
        p.grad = grads[n].clone()
    before = {n: p.detach().clone() for n, p in params.items()}
    step.step()
    return {n: before[n] - p.detach() for n, p in params.items()}


def less_repo_direction(model, opt, grads):
    """princeton-nlp/LESS's ``obtain_gradients_with_adam``, written out: ``m' / √(v' + ε)``, no bias correction."""
    named = dict(model.named_parameters())
    out = {}
    for n, g in grads.items():
        st = opt.state[named[n]]
        m1 = BETAS[0] * st["exp_avg"] + (1 - BETAS[0]) * g
        v1 = BETAS[1] * st["exp_avg_sq"] + (1 - BETAS[1]) * g * g
        out[n] = m1 / torch.sqrt(v1 + EPS)
    return out


def reference(model, opt, direction):
    """LESS scores by brute force: cos(Γ(g(z)), ḡ_T) per validation task T, and against the mean of every task."""
    flat = lambda d: torch.cat([t.reshape(-1) for t in d.values()])  # noqa: E731
    train = [flat(direction(model, opt, example_grad(model, e))) if (e["labels"][1:] != -100).any() else None
             for e in TRAIN]
    val = [flat(example_grad(model, e)) for e in VAL]
    tasks = sorted({e["task"] for e in VAL})
    vt = {t: sum(v for v, e in zip(val, VAL) if e["task"] == t) for t in tasks}
    vall = sum(val)
    cos = lambda a, b: 0.0 if a is None else float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    return np.array([cos(g, vall) for g in train]), np.array([[cos(g, vt[t]) for t in tasks] for g in train])


@pytest.mark.parametrize("adam", ["paper", "less_repo"])
def test_less_scores_equal_the_adam_update_from_the_saved_moments(tmp_path, adam):
    model, opt = trained()
    path = save_adam_state(tmp_path / "optimizer_state.safetensors",
                           adam_state_of(dict(model.named_parameters()), opt))
    state = read_adam_state(tmp_path)
    assert state.betas == BETAS and state.eps == EPS and set(state.step.values()) == {3}
    metric = ScoringConfig(method="less", options={"adam": adam}).build_metric().use_optimizer_state(state)
    table = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric=metric, progress=False)
    want, want_t = reference(model, opt, adamw_step_direction if adam == "paper" else less_repo_direction)
    # float64; batched and padded against one example at a time (BATCHING_ATOL, of the largest |score|)
    np.testing.assert_allclose(table.scores, want, rtol=0, atol=BATCHING_ATOL)
    np.testing.assert_allclose(table.task_scores, want_t, rtol=0, atol=BATCHING_ATOL)
    assert table.settings["method"] == "less" and table.settings["adam"] == adam
    # not TracIn: the preconditioning changes the scores
    sgd = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), progress=False)
    assert np.abs(sgd.scores - table.scores).max() > 1e-2
    assert path.name == "optimizer_state.safetensors"


def test_a_missing_or_foreign_optimizer_state_is_refused(tmp_path):
    model, opt = trained(steps=1)
    with pytest.raises(InputNotFoundError, match="no Adam optimizer state"):
        read_adam_state(tmp_path)
    with pytest.raises(UserInputError, match="method less needs the checkpoint's Adam optimizer state"):
        influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), method="less", progress=False)
    state = adam_state_of({f"other.{n}": p for n, p in model.named_parameters()}, opt)
    metric = ScoringConfig(method="less").build_metric().use_optimizer_state(state)
    with pytest.raises(UserInputError, match="holds no Adam moments for 'base_model"):
        influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric=metric, progress=False)
    with pytest.raises(UserInputError, match="options.adam of method less must be one of"):
        ScoringConfig(method="less", options={"adam": "sgd"}).build_metric()
