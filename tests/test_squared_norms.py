"""``engine/norms.squared_norms``: the validation gradients' squared norms (the scorer's cosine denominators, the task
terms' directions) widened to float64 a bounded piece at a time, against brute force; in one piece (the arithmetic of
before, bit for bit) when a weight is within the budget; and without a whole float64 copy of a large weight."""
from __future__ import annotations

import pytest
import torch

from iprox_lightning.engine.norms import squared_norms



@pytest.mark.parametrize("chunk_bytes", [8, 8 * 3 * 5 * 2, 1 << 25])  # a row at a time, 2 rows, whole
def test_squared_norms_equal_brute_force(chunk_bytes):
    g = torch.Generator().manual_seed(0)
    V = torch.randn(3, 7, 5, generator=g)
    per, whole = squared_norms(V, chunk_bytes=chunk_bytes)
    ref = V.double()
    torch.testing.assert_close(per, (ref ** 2).sum(dim=(1, 2)), rtol=1e-14, atol=0)  # float64 sums in other orders
    torch.testing.assert_close(whole, (ref.sum(0) ** 2).sum(), rtol=1e-14, atol=0)
    assert squared_norms(V, column_sum=False, chunk_bytes=chunk_bytes)[1] is None


def test_a_weight_within_the_budget_is_summed_as_before_bit_for_bit():
    V = torch.randn(4, 33, 17, dtype=torch.bfloat16)
    per, whole = squared_norms(V)
    assert torch.equal(per, V.double().pow(2).sum(dim=(1, 2)))
    assert torch.equal(whole, V.double().sum(0).pow(2).sum())


def test_a_large_weight_is_never_widened_whole():
    """No tensor made on the way is larger than a chunk (float64) of the input; widened whole, the input in float64
    and its square were (twice its float32 bytes each)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # (views: none)
                    largest.append(t.numel() * t.element_size())
            return out

    V = torch.randn(3, 512, 256)  # 1.5 MiB in float32
    with Sizes():
        per, whole = squared_norms(V, chunk_bytes=1 << 18)  # 256 KiB a chunk
    assert max(largest) <= 1 << 18
    ref = V.double()
    torch.testing.assert_close(per, (ref ** 2).sum(dim=(1, 2)), rtol=1e-14, atol=0)
    torch.testing.assert_close(whole, (ref.sum(0) ** 2).sum(), rtol=1e-14, atol=0)
