"""Probe collection for IPSVD (paper §4.1 "Efficient and Scalable Implementation" and Appendix
"Implementation Details").

One forward/backward pass over the probe set records, for every targeted layer, the layer input
``h`` and the output-gradient ``δ = ∂L/∂y`` at a sample of token positions and stacks them as
columns: ``H: [in, N]``, ``Delta: [out, N]``.

* Loss: the **sum over examples of the per-example SFT loss** ``L(z)`` (mean cross-entropy over the
  example's response tokens, :func:`iprox_lightning.engine.batch.per_example_loss`). Each token's ``δ`` is
  therefore the gradient of its own example's ``L(z)`` — the quantity influence scores use —
  independent of the batch size and of the other examples' lengths. ``labels="all"`` (the reference
  implementation's choice, ``CompressionConfig.probe_labels``): ``L(z)`` is the mean over every non-pad token
  of the example instead (:func:`all_token_labels`; the first token, which nothing predicts, excepted).
* Token sampling (not sequence means): ``N = num_tokens`` columns are spread uniformly over the valid
  (``attention_mask == 1``) tokens of the whole probe set. Each batch's share is precomputed from
  the masks (proportional to its valid-token count, largest-remainder rounding), then that many
  positions are drawn uniformly without replacement inside the batch. The same positions serve
  ``H`` and ``Delta`` and every layer. With fewer valid tokens than ``N``, all are used.
* Memory: the probe batches are held as token ids (the probe set is small); per layer only the
  ``N`` sampled columns are kept (float32), never whole sequences.
* One step of the backward-pairs engine (:func:`iprox_lightning.engine.tracking.backward_pairs`) per batch,
  consumed by a :class:`ProbeTracker`: no ``.grad`` is touched, so a frozen or trainable model works
  alike. The model is run in eval mode (no dropout) and its mode restored afterwards.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn
from ..progress import progress as progress_of

from ..engine.batch import check_batch, to_device
from ..engine.model_modes import eval_mode
from ..engine.target_layers import find_target_linears, linear_shape
from ..engine.tracking import PairTracker, backward_pairs

log = logging.getLogger(__name__)

# the tokens whose loss gives the probes' output-gradients: the response tokens, or every non-pad token
PROBE_LABELS = ("response", "all")


@dataclass
class Probes:
    """Per-layer probe matrices ``H[name]: [in, N]`` and ``Delta[name]: [out, N]`` (float32)."""

    H: dict[str, torch.Tensor]
    Delta: dict[str, torch.Tensor]
    num_tokens: int  # N, the number of columns actually collected
    num_valid_tokens: int  # valid tokens in the whole probe set
    num_examples: int
    mean_loss: float  # mean per-example SFT loss over the probe set
    batch_shares: list[int] = field(default_factory=list)

    def pop(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return ``(H, Delta)`` of one layer (frees memory as layers are compressed)."""
        return self.H.pop(name), self.Delta.pop(name)


def allocate_shares(counts: list[int], total: int) -> list[int]:
    """Split ``total`` columns over batches proportionally to ``counts`` (largest remainder), never
    more than a batch's count. ``sum(result) == min(total, sum(counts))``."""
    n_all = sum(counts)
    if total >= n_all:
        return list(counts)
    exact = [total * c / n_all for c in counts]
    shares = [int(x) for x in exact]
    rest = total - sum(shares)
    order = sorted(range(len(counts)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:rest]:
        shares[i] += 1
    return shares


def sample_positions(attention_mask: torch.Tensor, share: int, generator: torch.Generator) -> torch.Tensor:
    """``share`` distinct valid positions ``[(b, t), ...]`` (``LongTensor[share, 2]``, row-major
    order) drawn uniformly without replacement among ``attention_mask == 1``."""
    valid = attention_mask.bool().nonzero()  # [n_valid, 2], row-major
    if share > valid.shape[0]:
        raise ValueError(f"cannot sample {share} positions among {valid.shape[0]} valid tokens")
    pick = torch.randperm(valid.shape[0], generator=generator)[:share].sort().values
    return valid[pick]


def all_token_labels(batch: Mapping) -> dict:
    """``batch`` with ``labels`` on every non-pad token (``input_ids`` where ``attention_mask == 1``, ``-100`` on
    padding): the loss of ``labels="all"``."""
    labels = torch.where(batch["attention_mask"].bool(), batch["input_ids"], torch.full_like(batch["input_ids"], -100))
    return {**batch, "labels": labels}


class ProbeTracker(PairTracker):
    """Writes the ``(h, δ)`` of the selected token positions of each step as the next columns of
    ``H[name]: [in, N]`` and ``Delta[name]: [out, N]`` (float32, on ``store``)."""

    def __init__(self, modules: Mapping[str, nn.Module], num_columns: int, store: torch.device) -> None:
        self.modules = dict(modules)
        self.H = {n: torch.empty(linear_shape(m)[1], num_columns, dtype=torch.float32, device=store)
                  for n, m in self.modules.items()}
        self.Delta = {n: torch.empty(linear_shape(m)[0], num_columns, dtype=torch.float32, device=store)
                      for n, m in self.modules.items()}
        self.filled = {n: 0 for n in self.modules}
        self.store = store
        self.offset = 0
        self.positions: tuple[torch.Tensor, torch.Tensor] | None = None

    def select(self, positions: torch.Tensor) -> None:
        """The ``[(b, t), ...]`` positions (``LongTensor[n, 2]``) the next step records."""
        self.positions = (positions[:, 0], positions[:, 1])

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        b_idx, t_idx = self.positions
        o, n = self.offset, b_idx.shape[0]
        self.H[name][:, o : o + n] = h[b_idx, t_idx].to(self.store, torch.float32).T
        self.Delta[name][:, o : o + n] = delta[b_idx, t_idx].to(self.store, torch.float32).T
        self.filled[name] += n

    def end_step(self) -> None:
        self.offset += self.positions[0].shape[0]
        self.positions = None


def collect_probes(
    model: nn.Module,
    dataloader: Iterable[Mapping],
    modules: Mapping[str, nn.Module] | None = None,
    *,
    num_tokens: int = 1024,
    seed: int = 0,
    storage_device: str | torch.device | None = None,
    progress: bool = True,
    labels: str = "response",
    warn_short: bool = True,
) -> Probes:
    """Collect ``H``/``Delta`` probe columns of ``modules`` (default: the targeted linears of
    ``model``) over ``dataloader`` (batches in the project's format). See the module docstring.

    ``storage_device``: where the probe columns are kept (default: the model's device). ``labels``
    (:data:`PROBE_LABELS`): ``"response"`` — ``δ`` of the response-token loss (the batch's ``labels``);
    ``"all"`` — of the loss over every non-pad token (:func:`all_token_labels`). The token positions
    sampled are the same either way (every valid token is a candidate). ``warn_short=False``: no warning when the
    probe set holds fewer valid tokens than ``num_tokens`` (a second pass over the same batches, already warned).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if labels not in PROBE_LABELS:
        raise ValueError(f"labels must be one of {PROBE_LABELS}, got {labels!r}")
    modules = dict(modules) if modules is not None else find_target_linears(model)
    batches = []
    for i, batch in enumerate(dataloader):
        try:
            check_batch(batch)
        except ValueError as e:
            raise ValueError(f"probe batch {i}: {e}") from None
        batches.append(batch)
    counts = [int(b["attention_mask"].sum()) for b in batches]
    n_valid = sum(counts)
    if n_valid == 0:
        raise ValueError("the probe dataloader yielded no valid (attention_mask == 1) token")
    shares = allocate_shares(counts, num_tokens)
    N = sum(shares)
    if N < num_tokens and warn_short:
        log.warning("probe set has only %d valid tokens (< num_tokens=%d): using all of them", N, num_tokens)

    device = next(model.parameters()).device
    tracker = ProbeTracker(modules, N, torch.device(storage_device) if storage_device is not None else device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    loss_sum, n_examples = 0.0, 0
    with eval_mode(model):
        for batch, share in progress_of(list(zip(batches, shares)), desc="IPSVD probes", unit="batch", enabled=progress, leave=True):
            n_examples += batch["input_ids"].shape[0]
            if share == 0:
                continue
            tracker.select(sample_positions(batch["attention_mask"], share, gen).to(device))
            step = all_token_labels(batch) if labels == "all" else batch
            loss_sum += float(backward_pairs(model, to_device(step, device), [tracker]).loss)
    missing = [n for n, k in tracker.filled.items() if k != N]
    if missing:
        raise RuntimeError(
            f"no output-gradient reached layer(s) {missing[:5]}{'...' if len(missing) > 5 else ''} "
            "during probe collection: are they used in the forward pass and does the loss depend on them?"
        )
    return Probes(H=tracker.H, Delta=tracker.Delta, num_tokens=N, num_valid_tokens=n_valid, num_examples=n_examples,
                  mean_loss=loss_sum / max(n_examples, 1), batch_shares=shares)
