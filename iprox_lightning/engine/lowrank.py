"""``LowRankLinear``: the factorised layer ``y = A (B x) + b`` that makes a proxy."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LowRankLinear(nn.Module):
    """Drop-in replacement of ``nn.Linear(in_features, out_features)`` with ``W ≈ A @ B``.

    ``A: [out, r]`` and ``B: [r, in]`` are trainable parameters; the bias (if any) is kept as a
    parameter that is frozen by default. Works under ``torch.no_grad``/inference mode, autocast
    (both matmuls go through ``F.linear``), DDP and FSDP (plain parameters, no custom autograd).

    The rank-``r`` activation ``z = B x`` passes through ``self.bottleneck``, an ``nn.Identity`` (no
    parameter, no state-dict key): the seam where hooks see ``z`` and ``∂L/∂z``
    (:mod:`iprox_lightning.engine.tracking`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        bias: bool = False,
        train_bias: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank must be in [1, min(in, out)={min(in_features, out_features)}], got {rank}")
        self.in_features, self.out_features, self.rank = int(in_features), int(out_features), int(rank)
        kw = dict(device=device, dtype=dtype)
        self.bottleneck = nn.Identity()
        self.A = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.B = nn.Parameter(torch.empty(rank, in_features, **kw))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **kw), requires_grad=train_bias)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.B, a=math.sqrt(5))

    @classmethod
    def from_factors(
        cls, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None = None, *, train_bias: bool = False
    ) -> "LowRankLinear":
        """Build from ``A: [out, r]``, ``B: [r, in]`` (copied, keeping their dtype/device)."""
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[0]:
            raise ValueError(f"factor shapes do not chain: A {tuple(A.shape)}, B {tuple(B.shape)}")
        layer = cls(B.shape[1], A.shape[0], A.shape[1], bias=bias is not None, train_bias=train_bias,
                    device=A.device, dtype=A.dtype)
        with torch.no_grad():
            layer.A.copy_(A)
            layer.B.copy_(B)
            if bias is not None:
                layer.bias.copy_(bias.to(A.dtype))
        return layer

    @property
    def weight(self) -> torch.Tensor:
        """The dense product ``A @ B`` (``[out, in]``), computed on demand — for inspection only."""
        return self.A @ self.B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.bottleneck(F.linear(x, self.B)), self.A, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, bias={self.bias is not None}"
