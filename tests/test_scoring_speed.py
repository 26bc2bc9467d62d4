"""The scoring pass's reuse and batching (issue 56): each against the plain computation it replaces."""
from __future__ import annotations

import torch

from iprox_lightning.scoring.features import ValidationGradientTracker, row_sq_norms
from iprox_lightning.scoring.metrics import RotatedInputs, eigenbasis_gradients, share_equal


def test_row_sq_norms_equal_the_sum_of_squares():
    X = torch.randn(5, 37, dtype=torch.float64)
    assert torch.allclose(row_sq_norms(X), X.pow(2).sum(1), rtol=1e-12, atol=0)


def test_rotated_inputs_are_reused_only_for_the_same_input_and_basis():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 6, 4, generator=g)
    Q = torch.linalg.qr(torch.randn(4, 4, generator=g))[0]
    Q2 = Q.clone()
    rot = RotatedInputs()
    first = rot(h, Q)
    assert rot(h, Q) is first  # same input, same basis object: reused
    assert rot(h.clone(), Q) is not first  # other memory: computed
    assert rot(h, Q2) is not first  # an equal basis that is another object: computed (share_equal makes them one)
    h.add_(1.0)  # changed in place: never the stale product
    assert torch.equal(rot(h, Q), h @ Q)
    d = torch.randn(2, 6, 3, generator=g)
    Qd = torch.linalg.qr(torch.randn(3, 3, generator=g))[0]
    assert torch.equal(eigenbasis_gradients(h, d, Q, Qd, rot), eigenbasis_gradients(h, d, Q, Qd))
    rot.clear()
    assert rot.entries == []


def test_share_equal_makes_equal_tensors_one_object():
    a, b, c = torch.eye(3), torch.eye(3), 2 * torch.eye(3)
    out = share_equal({"q": a, "k": b, "o": c})
    assert out["q"] is a and out["k"] is a and out["o"] is c


def test_validation_sums_one_example_per_task_equal_the_grouped_sums():
    g = torch.Generator().manual_seed(1)
    h, d = torch.randn(3, 5, 4, generator=g), torch.randn(3, 5, 2, generator=g)
    batch = {"attention_mask": torch.ones(3, 5), "input_ids": torch.zeros(3, 5, dtype=torch.long)}
    for groups in (["a", "b", "c"], ["a", "b", "a"]):
        t = ValidationGradientTracker({}, ["w"], lambda b, groups=groups: groups, torch.float64)
        t.start_step(batch)
        t.on_weight("w", h.double(), d.double())
        t.on_weight("w", h.double(), d.double())  # a second batch adds
        for name in set(groups):
            rows = [j for j, x in enumerate(groups) if x == name]
            want = 2 * sum(d[j].double().t() @ h[j].double() for j in rows)
            assert torch.allclose(t.sums["w"][name], want, rtol=1e-12, atol=1e-12)
