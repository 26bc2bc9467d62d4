"""The batch format shared by every stage, and the per-example SFT loss.

A batch is a ``dict`` with

* ``input_ids``      ``LongTensor[B, T]`` — right-padded token ids;
* ``attention_mask`` ``LongTensor[B, T]`` — 1 for real tokens, 0 for padding;
* ``labels``         ``LongTensor[B, T]`` — Hugging Face convention (aligned with ``input_ids``,
  the model shifts internally): the token id on response tokens, ``-100`` everywhere else
  (prompt, template and padding);
* ``id``             ``list[str]`` — a stable example id that survives shuffling, workers, DDP;
* ``task``           ``list[str]`` (optional) — the task / category name of each example.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

from ..errors import UserInputError

IGNORE_INDEX = -100


def to_device(batch: Mapping, device) -> dict:
    """``batch`` with its tensors on ``device`` (the id / task lists as they are)."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` / ``None``: the first CUDA device where one is visible, else the CPU; anything else as given."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
REQUIRED_KEYS = ("input_ids", "attention_mask", "labels", "id")


def check_batch(batch: Mapping[str, Any]) -> None:
    """Raise a clear ``ValueError`` when ``batch`` does not follow the project's batch format."""
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch is missing key(s) {missing}; expected {list(REQUIRED_KEYS)} (+ optional 'task')")
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    if ids.dim() != 2 or ids.shape != mask.shape or ids.shape != labels.shape:
        raise ValueError(
            f"input_ids/attention_mask/labels must share one [B, T] shape, got "
            f"{tuple(ids.shape)}, {tuple(mask.shape)}, {tuple(labels.shape)}"
        )
    if len(batch["id"]) != ids.shape[0]:
        raise ValueError(f"batch has {ids.shape[0]} rows but {len(batch['id'])} ids")


def batch_rows(batch: Mapping[str, Any], rows: slice | list[int]) -> dict[str, Any]:
    """The rows ``rows`` (a slice, or a list of row indices) of ``batch``: tensors whose leading size is the batch's
    and per-row lists (as lists); anything else kept as it is."""
    n = batch["input_ids"].shape[0]
    if isinstance(rows, slice):
        pick_t, pick_l = (lambda v: v[rows]), (lambda v: list(v)[rows])
    else:
        idx = list(rows)
        at = torch.as_tensor(idx, dtype=torch.long, device=batch["input_ids"].device)
        pick_t, pick_l = (lambda v: v[at]), (lambda v: [v[i] for i in idx])
    return {k: (pick_t(v) if torch.is_tensor(v) and v.dim() and v.shape[0] == n
                else pick_l(v) if isinstance(v, (list, tuple)) and len(v) == n else v)
            for k, v in batch.items()}


def micro_batches(batch: Mapping[str, Any], size: int) -> list[dict[str, Any]]:
    """``batch`` cut into consecutive row slices of at most ``size`` rows (:func:`batch_rows`). The rows keep their
    padded length, so each row's computation is the one it has in the whole batch (the micro-batches of warm-up /
    fine-tune and of Stage 2)."""
    n = batch["input_ids"].shape[0]
    return [batch_rows(batch, slice(lo, lo + size)) for lo in range(0, n, size)]


def token_counts(batches: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per example id: ``response_tokens`` (labels other than ``IGNORE_INDEX``) and ``total_tokens``
    (attention mask), over every batch of ``batches``."""
    out: dict[str, dict[str, float]] = {"response_tokens": {}, "total_tokens": {}}
    for batch in batches:
        resp = (batch["labels"] != IGNORE_INDEX).sum(1).tolist()
        total = batch["attention_mask"].sum(1).tolist()
        for ex_id, r, t in zip(batch["id"], resp, total):
            out["response_tokens"][str(ex_id)] = float(r)
            out["total_tokens"][str(ex_id)] = float(t)
    return out


def shifted_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T]`` mask of *input positions* whose next-token prediction is scored.

    Position ``t`` predicts ``labels[:, t + 1]``; the last position never predicts anything.
    """
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


def per_example_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response-token cross-entropy and response-token count per example, from full ``[B, T, V]`` logits.

    Returns ``(ce_sum[B], n_tokens[B])`` computed in float32 (float64 for float64 logits).
    """
    scored = ScoredTokens.of(labels)
    return scored.ce_sums(logits[scored.mask])


@dataclass
class ScoredTokens:
    """The positions of a ``[B, T]`` batch whose next-token prediction is scored (:func:`shifted_token_mask`), in
    row-major order: ``rows[N]`` the example of each, ``targets[N]`` its next token."""

    mask: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, labels: torch.Tensor) -> "ScoredTokens":
        mask = shifted_token_mask(labels)
        rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)[mask]
        targets = labels[:, 1:][mask[:, :-1]]
        return cls(mask=mask, rows=rows, targets=targets)

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def ce_sums(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ce_sum[B], n_tokens[B])`` from the logits of the scored positions (``[N, V]``), in float32 (float64 for
        float64 logits)."""
        if logits.shape[0] != self.rows.numel():
            raise ValueError(f"{logits.shape[0]} rows of logits for {self.rows.numel()} scored positions")
        ce = F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), self.targets,
                             reduction="none")
        ce_sum = ce.new_zeros(self.batch_size).index_add(0, self.rows, ce)
        return ce_sum, torch.bincount(self.rows, minlength=self.batch_size)


def lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model``'s LM head (``get_output_embeddings()``), ``None`` for a model without one."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


@contextlib.contextmanager
def head_on_scored_positions(model: torch.nn.Module, labels: torch.Tensor) -> Iterator[ScoredTokens]:
    """Inside the block, ``model``'s output embedding (the LM head, ``get_output_embeddings()``) sees only the hidden
    states of the scored positions, so ``model(...).logits`` is ``[1, N, V]``: the head's matmul and the vocabulary
    softmax are paid on response tokens only, not on the prompt (a pool prompt is about three quarters of its tokens,
    a few-shot validation prompt nearly all). Values equal the full logits at those positions. A model without
    ``get_output_embeddings`` keeps full logits (:func:`scored_logits` handles both)."""
    scored = ScoredTokens.of(labels)
    head = lm_head(model)
    if head is None:
        yield scored
        return

    def compact(module, args):
        hidden, *rest = args
        if hidden.shape[:2] != scored.mask.shape:
            raise RuntimeError(f"the LM head got hidden states of shape {tuple(hidden.shape)} for labels of shape "
                               f"{tuple(scored.mask.shape)}; cannot pick the scored positions")
        return (hidden[scored.mask.to(hidden.device)].unsqueeze(0), *rest)

    handle = head.register_forward_pre_hook(compact)
    try:
        yield scored
    finally:
        handle.remove()


def scored_logits(model: torch.nn.Module, batch: Mapping[str, Any], **kwargs) -> tuple[torch.Tensor, ScoredTokens]:
    """``model``'s logits at the scored positions of ``batch`` (``[N, V]``, see :class:`ScoredTokens`), computed
    with the LM head on those positions only (:func:`head_on_scored_positions`). ``kwargs`` go to the forward."""
    with head_on_scored_positions(model, batch["labels"]) as scored:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs).logits
    if logits.dim() == 3 and logits.shape[:2] == scored.mask.shape:  # no LM head hook: full logits
        return logits[scored.mask], scored
    return logits.reshape(-1, logits.shape[-1]), scored


class _LinearCrossEntropy(torch.autograd.Function):
    """``ce[i] = CE(hidden[i] @ weightᵀ + bias, targets[i])`` without the ``[N, V]`` logits: the vocabulary is
    visited in row chunks, and when ``hidden`` needs a gradient the chunk's ``∂ce_i/∂hidden_i = (softmax_i −
    onehot_i) @ weight`` is computed right there and kept (``[N, d]``); the backward scales it by the incoming
    gradient. No gradient for ``weight`` / ``bias`` (the LM head is frozen where this runs). CE in float32 (float64
    for float64 hidden states), the head's matmuls in its own dtype — as the unfused path."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, want_grad):
        ce_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        N = hidden.shape[0]
        ce = torch.empty(N, dtype=ce_dtype, device=hidden.device)
        grad = torch.empty_like(hidden) if want_grad else None
        for s in range(0, N, chunk):
            z = F.linear(hidden[s:s + chunk], weight, bias).to(ce_dtype)
            t = targets[s:s + chunk]
            z_t = z.gather(1, t.unsqueeze(1)).squeeze(1)
            m = z.amax(dim=1, keepdim=True)
            z.sub_(m).exp_()
            total = z.sum(dim=1, keepdim=True)
            ce[s:s + chunk] = (m + total.log()).squeeze(1) - z_t
            if grad is not None:
                z.div_(total)  # softmax
                z[torch.arange(z.shape[0], device=z.device), t] -= 1
                grad[s:s + chunk] = z.to(weight.dtype) @ weight
        ctx.save_for_backward(grad)
        return ce

    @staticmethod
    def backward(ctx, grad_ce):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce.unsqueeze(1).to(grad.dtype), None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Per-row cross-entropy of the logits ``hidden @ weightᵀ + bias`` (``hidden [N, d]``, ``weight [V, d]``) against
    ``targets [N]``, never holding more than ``chunk`` rows of logits (default: about 32M logits, 128 MB in float32;
    smaller chunks re-read the head's weight once per chunk, which costs more than it saves): equal to
    ``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="none")``, with the gradient w.r.t.
    ``hidden`` only (see :class:`_LinearCrossEntropy`)."""
    if chunk is None:
        chunk = max(1, (1 << 25) // weight.shape[0])
    want_grad = torch.is_grad_enabled() and hidden.requires_grad  # (inside forward, grad mode is always off)
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, int(chunk), want_grad)


_HEAD_IS_PLAIN: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def fusable_head(model: torch.nn.Module, batch: Mapping[str, Any], **kwargs) -> torch.nn.Linear | None:
    """``model``'s LM head if :func:`scored_ce_sums` may fuse it with the cross-entropy, else ``None``: it must be a
    plain, unsharded ``nn.Linear`` whose output the model's forward returns unchanged as the logits (not so under
    logit soft-capping or a logit scale). The second part is checked once per model, with a forward (no gradient) of
    two tokens of ``batch``'s first example."""
    head = lm_head(model)
    if type(head) is not torch.nn.Linear or type(head.weight.data) is not torch.Tensor:
        return None
    plain = _HEAD_IS_PLAIN.get(model)
    if plain is None:
        seen: list[torch.Tensor] = []
        hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        ids = batch["input_ids"][:1, :2]
        try:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits
        finally:
            hook.remove()
        with torch.no_grad():
            want = F.linear(seen[-1], head.weight, head.bias) if len(seen) == 1 else None
        plain = _HEAD_IS_PLAIN[model] = want is not None and logits.shape == want.shape and torch.allclose(
            logits.to(want.dtype), want, rtol=0, atol=0, equal_nan=True)
    return head if plain else None


@contextlib.contextmanager
def unfused_head(model: torch.nn.Module):
    """Inside the block the engine computes ``model``'s loss with the LM head unfused (:func:`scored_logits`), as when
    :func:`fusable_head` refuses a head (for measuring what the fusion saves: ``bench/speed.py --compare-unfused``)."""
    _HEAD_IS_PLAIN[model] = False
    try:
        yield
    finally:
        del _HEAD_IS_PLAIN[model]  # checked again (and fused) at the next call


def scored_ce_sums(model: torch.nn.Module, batch: Mapping[str, Any],
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor, ScoredTokens]:
    """``(ce_sum[B], n_tokens[B], scored)`` of ``batch`` — :meth:`ScoredTokens.ce_sums` of :func:`scored_logits` —
    without the logits: the LM head and the cross-entropy run fused over the scored positions' hidden states
    (:func:`linear_cross_entropy`), so no ``[N, V]`` tensor is made (on SmolLM2 at 128 tokens: ~100 MB per batch of 8;
    with it, the scoring engine is about 10% faster on a CPU). Gradients flow to everything below the head, not to the
    head. A head that :func:`fusable_head` refuses is computed the unfused way (:func:`scored_logits`). One forward of
    ``model`` either way (its own head runs on no row when fused)."""
    head = fusable_head(model, batch, **kwargs)
    if head is None:
        logits, scored = scored_logits(model, batch, **kwargs)
        return (*scored.ce_sums(logits), scored)
    scored = ScoredTokens.of(batch["labels"])
    kept: list[torch.Tensor] = []

    def keep_hidden(module, args):
        hidden, *rest = args
        if hidden.shape[:2] != scored.mask.shape:
            raise RuntimeError(f"the LM head got hidden states of shape {tuple(hidden.shape)} for labels of shape "
                               f"{tuple(scored.mask.shape)}; cannot pick the scored positions")
        kept.append(hidden[scored.mask.to(hidden.device)])
        return (hidden[:1, :0], *rest)  # the model's own head: no row

    handle = head.register_forward_pre_hook(keep_hidden)
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    finally:
        handle.remove()
    h = kept[0]
    ce = linear_cross_entropy(h, head.weight, head.bias, scored.targets.to(h.device))
    ce_sum = ce.new_zeros(scored.batch_size).index_add(0, scored.rows.to(ce.device), ce)
    return ce_sum, torch.bincount(scored.rows, minlength=scored.batch_size), scored


def example_means(ce_sum: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``L(z)`` per example: its summed response-token cross-entropy over its response-token count (``0`` for an
    example without a response token)."""
    return ce_sum / n.clamp(min=1).to(ce_sum.dtype)


def example_mean_sum(ce_sum: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``Σ_z L(z)``, ``L`` the per-example response-token mean (:func:`per_example_loss`): each row of an
    output-gradient is then exactly its own example's, whatever the batch."""
    return example_means(ce_sum, n).sum()


def example_sum_sum(ce_sum: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``Σ_z L(z)``, ``L`` the per-example response-token *sum* of cross-entropies (``loss_reduction="sum"``,
    kronfluence's and bergson's per-example loss): the batch's summed cross-entropy."""
    return ce_sum.sum()


LOSS_REDUCTIONS = ("mean", "sum")
"""The per-example loss ``L(z)`` over an example's response tokens: the mean cross-entropy (the project's default) or
the summed cross-entropy (kronfluence's and bergson's)."""


def check_loss_reduction(reduction: str) -> None:
    if reduction not in LOSS_REDUCTIONS:
        raise UserInputError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")


def example_loss_fn(reduction: str = "mean"):
    """The ``loss_fn(ce_sum, n)`` of :func:`~iprox_lightning.engine.tracking.backward_pairs` whose per-example
    gradients are those of ``L(z)`` with ``reduction`` (:data:`LOSS_REDUCTIONS`)."""
    check_loss_reduction(reduction)
    return example_mean_sum if reduction == "mean" else example_sum_sum


def sample_targets(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Next tokens sampled from the model's predictive distribution ``softmax(logits)`` (``logits [N, V]``, one row
    per scored position; a sampled Fisher's labels, kronfluence's default ``fisher="sampled"``). Deterministic in
    ``seed`` on any device: ``N`` uniforms from a CPU generator seeded with ``seed``, then the inverse of each row's
    cumulative distribution (float64)."""
    u = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    cdf = torch.softmax(logits.detach().double(), dim=-1).cumsum(dim=-1)
    u = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)


def token_mean(ce_sum: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy over all response tokens of the batch (the usual SFT loss, :func:`sft_loss`)."""
    return ce_sum.sum() / n.sum().clamp(min=1).to(ce_sum.dtype)


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``L(z)`` = mean cross-entropy over the response tokens of each example.

    Returns ``(loss[B], n_tokens[B])``. An example with no response token gets loss ``0`` (never
    NaN) and ``n_tokens == 0``; its gradient is exactly zero.
    """
    ce_sum, n = per_example_token_ce(logits, labels)
    return example_means(ce_sum, n), n


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy over all response tokens of the batch (the usual SFT loss)."""
    return token_mean(*per_example_token_ce(logits, labels))
