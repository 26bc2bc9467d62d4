"""Analytic FLOPs per IProX stage.

Conventions (one multiply-add = 2 FLOPs, as ``torch.utils.flop_counter`` counts):

* a linear layer ``[out, in]`` on ``T`` tokens costs ``2·T·in·out`` forward; a low-rank layer
  ``A [out, r] · B [r, in]`` costs ``2·T·r·(in + out)``;
* attention scores and mixing cost ``4·T²·H·d_head`` per sequence of length ``T`` and layer
  (``QKᵀ`` and ``softmax·V`` over all ``T²`` pairs, as the eager kernel computes them;
  ``attention="causal"`` counts only the ``T(T+1)/2`` unmasked pairs);
* a backward pass costs the input gradients (1× the forward of every matmul) plus the weight
  gradients (1× the forward of each layer whose weight gradient is formed — by autograd or from
  the hooked ``(h, δ)`` pairs); attention matmuls always cost 2× (both operands carry gradient);
  the LM head and embeddings are frozen (the paper excludes them), so the head costs 1×;
* the LM head runs on the response tokens only (:func:`iprox_lightning.engine.batch.scored_logits`): ``head_share`` is
  their share of the tokens (1 = every token, a model run without that);
* elementwise work (norms, activations, softmax, rotary) is ignored.

Stages (paper Fig. 5 / Table 5):

* **probe** (Stage 1, IPSVD): target forward + backward over the probe sequences, then per layer
  two skinny SVDs of the probe matrices ``H [in, N]``, ``Δ [out, N]``, the core matrix
  ``U_Δᵀ W U_H`` and its SVD, and the factors ``A``, ``B`` (Appendix "Efficient implementation").
  An SVD of a tall ``m × k`` matrix (``m ≥ k``) is charged ``6·m·k² + 20·k³`` FLOPs (Golub & Van
  Loan's R-SVD count for ``U₁, Σ, V``) — an estimate, LAPACK's real count varies.
* **alignment** (Stage 2): teacher forward + input-gradient backward (to get ``h`` and ``δ``);
  projecting ``∇_W L`` onto ``A``/``B`` from ``(h, δ)`` (``4·T·r·(in + out)`` per layer); proxy
  forward and a backward with ``create_graph=True``; then the backward of ``L_GA + λ L_KL``
  through that first-order graph, charged ``double_backward_factor ×`` the cost of building it
  (default 2, the usual "backward ≈ 2× forward" rule applied to the graph of forward+backward).
* **scoring**: forward + backward (with per-example weight gradients of the tracked layers) of
  every training and validation example, and one ``d``-dimensional inner product per training
  example with the (mean) validation gradient (``d`` = tracked parameters).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from ..engine.lowrank import LowRankLinear
from ..engine.target_layers import BLOCK_RE, find_target_linears, is_linear_like, linear_shape

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearShape:
    """One linear-like layer: ``name``, ``out``, ``in``, ``rank`` (``None`` = dense), ``tracked``."""

    name: str
    out_features: int
    in_features: int
    rank: int | None = None
    tracked: bool = True

    @property
    def params(self) -> int:
        if self.rank is None:
            return self.out_features * self.in_features
        return self.rank * (self.out_features + self.in_features)

    def forward_flops(self, n_tokens: float) -> float:
        return 2.0 * n_tokens * self.params


@dataclass
class ModelShape:
    """What FLOP counting needs to know about a decoder-only LM.

    ``linears``: every linear-like layer inside the decoder blocks (``tracked`` marks the ones
    IProX compresses / scores); ``lm_head``: ``(vocab, hidden)``; attention geometry per layer.
    """

    linears: list[LinearShape]
    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    lm_head: tuple[int, int] | None = None
    name: str = ""

    # construction --------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model: nn.Module, *, name: str = "") -> "ModelShape":
        """Read the shapes of a (possibly meta-device, possibly low-rank) HF causal LM."""
        tracked = set(find_target_linears(model))
        linears = []
        for mname, m in model.named_modules():
            if not mname or not is_linear_like(m) or not BLOCK_RE.search(mname + "."):
                continue
            out_f, in_f = linear_shape(m)
            rank = m.rank if isinstance(m, LowRankLinear) else None
            linears.append(LinearShape(mname, out_f, in_f, rank, mname in tracked))
        cfg = model.config
        out_emb = model.get_output_embeddings()
        lm_head = None
        if out_emb is not None:
            w = out_emb.weight
            lm_head = (int(w.shape[0]), int(w.shape[1]))
        return cls(
            linears=linears,
            num_layers=int(cfg.num_hidden_layers),
            num_heads=int(cfg.num_attention_heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(cfg.vocab_size),
            lm_head=lm_head,
            name=name or getattr(cfg, "_name_or_path", "") or type(model).__name__,
        )

    @classmethod
    def from_config(cls, config: Any, *, ranks: Mapping[str, int] | None = None, name: str = "") -> "ModelShape":
        """Shapes of the model a HF config describes (built on the meta device: no memory, no weights).

        ``config`` is a ``PretrainedConfig``, a dict, or a local directory / hub id readable by
        ``AutoConfig``. ``ranks`` (layer name -> rank) turns it into a proxy's shape.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

        if isinstance(config, (str, os.PathLike)):
            config = AutoConfig.from_pretrained(config)
        elif isinstance(config, dict):
            d = dict(config)
            config = AutoConfig.for_model(d.pop("model_type"), **d)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a PretrainedConfig, dict or path, got {type(config).__name__}")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shape = cls.from_model(model, name=name)
        return shape.with_ranks(ranks) if ranks else shape

    def with_ranks(self, ranks: Mapping[str, int]) -> "ModelShape":
        """The same model with the named layers factorised at the given ranks (a proxy's shape)."""
        names = {l.name for l in self.linears}
        unknown = sorted(set(ranks) - names)
        if unknown:
            raise KeyError(f"ranks name layer(s) not in {self.name or 'the model'}: {unknown[:5]}")
        lin = [dataclasses.replace(l, rank=int(ranks[l.name])) if l.name in ranks else l for l in self.linears]
        return dataclasses.replace(self, linears=lin)

    # sizes ---------------------------------------------------------------------------------
    @property
    def tracked_params(self) -> int:
        """Parameters of the tracked layers = the dimension of an example's gradient vector."""
        return sum(l.params for l in self.linears if l.tracked)

    @property
    def block_linear_params(self) -> int:
        return sum(l.params for l in self.linears)

    # FLOPs ---------------------------------------------------------------------------------
    def forward_flops(self, batch_size: int, seq_len: int, *, attention: str = "full",
                      head_share: float = 1.0) -> dict[str, float]:
        """Forward FLOPs of ``batch_size`` sequences of ``seq_len`` tokens: ``{linear, attention, lm_head, total}``;
        the LM head on ``head_share`` of the tokens."""
        T = float(batch_size) * seq_len
        lin = sum(l.forward_flops(T) for l in self.linears)
        att = self._attention_flops(batch_size, seq_len, attention)
        head = self._head_flops(T, head_share)
        return {"linear": lin, "attention": att, "lm_head": head, "total": lin + att + head}

    def backward_flops(
        self, batch_size: int, seq_len: int, *, weight_grads: str = "tracked", attention: str = "full",
        head_share: float = 1.0,
    ) -> dict[str, float]:
        """Backward FLOPs (see module docstring); ``weight_grads``: ``"all"`` block linears, ``"tracked"``, or ``"none"``."""
        if weight_grads not in ("all", "tracked", "none"):
            raise ValueError(f"weight_grads must be 'all', 'tracked' or 'none', got {weight_grads!r}")
        T = float(batch_size) * seq_len
        lin = 0.0
        for l in self.linears:
            f = l.forward_flops(T)
            wg = weight_grads == "all" or (weight_grads == "tracked" and l.tracked)
            lin += f * (2.0 if wg else 1.0)
        att = 2.0 * self._attention_flops(batch_size, seq_len, attention)
        head = self._head_flops(T, head_share)
        return {"linear": lin, "attention": att, "lm_head": head, "total": lin + att + head}

    def _head_flops(self, n_tokens: float, head_share: float) -> float:
        if not 0.0 <= head_share <= 1.0:
            raise ValueError(f"head_share must be in [0, 1], got {head_share!r}")
        return 2.0 * n_tokens * head_share * self.lm_head[0] * self.lm_head[1] if self.lm_head else 0.0

    def _attention_flops(self, batch_size: int, seq_len: int, attention: str) -> float:
        if attention == "full":
            pairs = float(seq_len) * seq_len
        elif attention == "causal":
            pairs = seq_len * (seq_len + 1) / 2.0
        else:
            raise ValueError(f"attention must be 'full' or 'causal', got {attention!r}")
        return 4.0 * batch_size * pairs * self.num_heads * self.head_dim * self.num_layers


# --------------------------------------------------------------------------------------------
# stages
# --------------------------------------------------------------------------------------------
def svd_flops(m: int, n: int) -> float:
    """R-SVD estimate ``6·M·K² + 20·K³`` (``M = max(m, n)``, ``K = min(m, n)``) for a thin SVD."""
    M, K = max(m, n), min(m, n)
    return 6.0 * M * K * K + 20.0 * K**3


def ipsvd_flops(*, in_features: int, out_features: int, n_vectors: int, rank: int) -> float:
    """Linear algebra of IPSVD for one ``[out, in]`` layer with ``N`` probe vectors and rank ``r``. (Keywords only:
    sizes are passed ``(in, out)`` like ``nn.Linear``; this function once took them the other way round.)"""
    N = n_vectors
    kh, kd = min(in_features, N), min(out_features, N)
    return (
        svd_flops(in_features, N)
        + svd_flops(out_features, N)
        + 2.0 * kd * out_features * in_features  # U_Δᵀ W
        + 2.0 * kd * in_features * kh  # (U_Δᵀ W) U_H
        + svd_flops(kd, kh)  # core SVD
        + 2.0 * rank * (out_features * kd + in_features * kh)  # A, B
    )


def _ranks_of(proxy: ModelShape) -> dict[str, int]:
    return {l.name: l.rank for l in proxy.linears if l.rank is not None}


def probe_flops(
    target: ModelShape, proxy: ModelShape, *, n_examples: int, seq_len: int, n_vectors: int, attention: str = "full",
    head_share: float = 1.0,
) -> dict[str, float]:
    """Stage 1: target forward/backward over the probe set + IPSVD of every factorised layer."""
    fwd = target.forward_flops(n_examples, seq_len, attention=attention, head_share=head_share)["total"]
    bwd = target.backward_flops(n_examples, seq_len, weight_grads="none", attention=attention,
                                head_share=head_share)["total"]
    ranks = _ranks_of(proxy)
    svd = sum(
        ipsvd_flops(in_features=l.in_features, out_features=l.out_features, n_vectors=n_vectors, rank=ranks[l.name])
        for l in target.linears if l.name in ranks
    )
    return {"forward": fwd, "backward": bwd, "ipsvd": svd, "total": fwd + bwd + svd}


def alignment_flops(
    target: ModelShape,
    proxy: ModelShape,
    *,
    n_examples: int,
    seq_len: int,
    epochs: int = 1,
    double_backward_factor: float = 2.0,
    attention: str = "full",
    head_share: float = 1.0,
) -> dict[str, float]:
    """Stage 2: teacher pass, gradient projection, proxy first-order graph and its double backward."""
    n = n_examples * epochs
    t_fwd = target.forward_flops(n, seq_len, attention=attention, head_share=head_share)["total"]
    t_bwd = target.backward_flops(n, seq_len, weight_grads="none", attention=attention, head_share=head_share)["total"]
    ranks = _ranks_of(proxy)
    T = float(n) * seq_len
    proj = sum(4.0 * T * ranks[l.name] * (l.in_features + l.out_features) for l in target.linears if l.name in ranks)
    p_fwd = proxy.forward_flops(n, seq_len, attention=attention, head_share=head_share)["total"]
    p_bwd = proxy.backward_flops(n, seq_len, weight_grads="tracked", attention=attention, head_share=head_share)["total"]
    dbl = double_backward_factor * (p_fwd + p_bwd)
    parts = {
        "teacher_forward": t_fwd,
        "teacher_backward": t_bwd,
        "projection": proj,
        "proxy_forward": p_fwd,
        "proxy_backward": p_bwd,
        "double_backward": dbl,
    }
    parts["total"] = sum(parts.values())
    return parts


def scoring_flops(
    model: ModelShape, *, n_train: int, n_val: int, seq_len: int, attention: str = "full", head_share: float = 1.0
) -> dict[str, float]:
    """Influence scoring with ``model``: per-example gradients of train + val examples and inner products; the LM
    head on ``head_share`` of the tokens."""
    n = n_train + n_val
    fwd = model.forward_flops(n, seq_len, attention=attention, head_share=head_share)["total"]
    bwd = model.backward_flops(n, seq_len, weight_grads="tracked", attention=attention, head_share=head_share)["total"]
    dots = 2.0 * n_train * model.tracked_params
    return {"forward": fwd, "backward": bwd, "inner_products": dots, "total": fwd + bwd + dots}


def pipeline_flops(
    target: ModelShape,
    proxy: ModelShape | None,
    *,
    seq_len: int,
    n_train: int,
    n_val: int,
    n_probe_examples: int = 0,
    n_probe_vectors: int = 0,
    n_align_examples: int = 0,
    align_epochs: int = 1,
    double_backward_factor: float = 2.0,
    attention: str = "full",
    head_share: float = 1.0,
) -> dict[str, float]:
    """FLOPs per stage ``{"probe", "alignment", "scoring", "total"}``; the LM head on ``head_share`` of the tokens
    in every stage.

    ``proxy=None`` means scoring with the target itself (no proxy construction); an off-the-shelf
    proxy is a ``ModelShape`` with no low-rank layer and ``n_probe_examples = n_align_examples = 0``.
    """
    out = {"probe": 0.0, "alignment": 0.0}
    if proxy is not None and n_probe_examples:
        out["probe"] = probe_flops(target, proxy, n_examples=n_probe_examples, seq_len=seq_len,
                                   n_vectors=n_probe_vectors, attention=attention, head_share=head_share)["total"]
    if proxy is not None and n_align_examples:
        out["alignment"] = alignment_flops(target, proxy, n_examples=n_align_examples, seq_len=seq_len,
                                           epochs=align_epochs, double_backward_factor=double_backward_factor,
                                           attention=attention, head_share=head_share)["total"]
    scorer = proxy if proxy is not None else target
    out["scoring"] = scoring_flops(scorer, n_train=n_train, n_val=n_val, seq_len=seq_len, attention=attention,
                                   head_share=head_share)["total"]
    out["total"] = out["probe"] + out["alignment"] + out["scoring"]
    return out
