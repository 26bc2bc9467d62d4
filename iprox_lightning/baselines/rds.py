"""RDS+ (Ivison et al. 2025, "Large-Scale Data Selection for Instruction Tuning"): representation-based
data selection, forward only — the cheap selector a gradient-based one has to beat.

Each example (prompt and response, as the SFT data module formats it) is embedded by the **position-weighted
mean** of the model's final hidden states (token ``t`` of ``n`` non-pad tokens weighs ``t / Σ t``, so later
tokens, which have seen more of the text, count more), and L2-normalised. The score of a pool example for a
validation task is the **mean cosine** to that task's validation examples; ``score`` is the mean over all
validation examples. The result is a score table in the same format as the influence scores, so ``select``
(every rule), the reports and the benchmarks read it unchanged.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from ..engine.batch import IGNORE_INDEX, model_device, to_device
from ..engine.model_modes import eval_mode
from ..scoring.influence import ScoreTable


@torch.no_grad()
def embed(model: torch.nn.Module, batches: Iterable[dict]) -> tuple[list[str], list, np.ndarray, np.ndarray]:
    """``(ids, tasks, embeddings [N, d] (unit rows, float64), response_tokens [N])`` of SFT ``batches`` (on the
    model's device)."""
    body = getattr(model, "base_model", model)  # the decoder without the LM head: no vocabulary-size logits
    ids, tasks, embs, n_resp = [], [], [], []
    device = model_device(model)
    with eval_mode(model):
        for b in batches:
            b = to_device(b, device)
            mask = b["attention_mask"]
            h = body(input_ids=b["input_ids"], attention_mask=mask).last_hidden_state.double()
            pos = mask.double().cumsum(1) * mask.double()
            w = pos / pos.sum(1, keepdim=True).clamp_min(1.0)
            e = (w.unsqueeze(-1) * h).sum(1)
            embs.append(torch.nn.functional.normalize(e, dim=-1).cpu().numpy())
            ids.extend(str(i) for i in b["id"])
            tasks.extend(b.get("task") or [None] * len(b["id"]))
            n_resp.append((b["labels"] != IGNORE_INDEX).sum(1).cpu().numpy())
    d = embs[0].shape[1] if embs else 0
    return (ids, tasks, np.concatenate(embs) if embs else np.zeros((0, d)),
            np.concatenate(n_resp) if n_resp else np.zeros(0, np.int64))


def rds_table(pool_batches: Iterable[dict], validation_batches: Iterable[dict], model: torch.nn.Module):
    """The RDS+ score table (:class:`~iprox_lightning.scoring.ScoreTable`) of the pool against the validation
    tasks (see the module doc)."""
    vids, vtasks, V, _ = embed(model, validation_batches)
    if not vids:
        raise ValueError("RDS+: the validation set is empty")
    ids, tasks, P, n_resp = embed(model, pool_batches)
    sims = P @ V.T  # [N, M] cosines
    names = sorted({str(t) for t in vtasks})
    cols = np.stack([sims[:, [j for j, t in enumerate(vtasks) if str(t) == name]].mean(1) for name in names], 1) \
        if len(ids) else np.zeros((0, len(names)))
    return ScoreTable(ids, sims.mean(1) if len(ids) else np.zeros(0), names, cols, n_resp, n_resp == 0, tasks,
                      settings={"method": "rds+", "pooling": "position-weighted mean", "layer": "last"})
