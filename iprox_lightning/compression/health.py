"""Proxy health: does the proxy still compute the target's function? (held-out loss and KL)

A proxy whose loss is several times the target's cannot keep the target's gradients — alignment
has to start from a sound model (measured on SmolLM2: Stage 1 at ρ = 0.5 with the old defaults left
a held-out loss of 15 against 2.4). :func:`proxy_health` measures, on held-out batches:

* ``target_loss`` / ``proxy_loss`` — mean per-example SFT loss (response tokens; the reduction the
  probes and the scores use, :func:`~iprox_lightning.engine.batch.per_example_loss`), the LM head run on the
  response tokens only (:func:`~iprox_lightning.engine.batch.scored_logits`);
* ``kl`` — ``τ²``-free mean over response tokens of ``KL(p_target ‖ p_proxy)`` at temperature 1;
* ``top1_agreement`` — share of response positions where both models predict the same next token.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.batch import ScoredTokens, example_means, model_device, scored_logits, to_device
from ..engine.model_modes import eval_mode


@torch.no_grad()
def proxy_health(target: nn.Module, proxy: nn.Module, batches: Iterable[Mapping]) -> dict[str, float]:
    """Held-out ``target_loss``, ``proxy_loss``, ``kl`` and ``top1_agreement`` (see the module docstring)."""
    sums = {"target_loss": 0.0, "proxy_loss": 0.0}
    n_ex, kl_sum, agree, n_tok = 0, 0.0, 0, 0
    with eval_mode(target, proxy):
        for batch in batches:
            # the LM head on the response tokens only: [N, V] per model, rows in ScoredTokens order
            lt = scored_logits(target, to_device(batch, model_device(target)))[0].float().cpu()
            lp = scored_logits(proxy, to_device(batch, model_device(proxy)))[0].float().cpu()
            scored = ScoredTokens.of(batch["labels"].cpu())
            for key, logits in (("target_loss", lt), ("proxy_loss", lp)):
                ce_sum, n = scored.ce_sums(logits)
                sums[key] += float(example_means(ce_sum, n)[n > 0].sum())
            n_ex += int((n > 0).sum())
            if lt.shape[0]:
                log_t = F.log_softmax(lt, dim=-1)
                log_p = F.log_softmax(lp, dim=-1)
                kl_sum += float((log_t.exp() * (log_t - log_p)).sum())
                agree += int((lt.argmax(-1) == lp.argmax(-1)).sum())
                n_tok += lt.shape[0]
    if n_ex == 0 or n_tok == 0:
        raise ValueError("proxy_health: the batches hold no response token")
    return {"target_loss": sums["target_loss"] / n_ex, "proxy_loss": sums["proxy_loss"] / n_ex,
            "kl": kl_sum / n_tok, "top1_agreement": agree / n_tok, "examples": n_ex, "tokens": n_tok}
