"""Answer normalisation, per-example scores and per-task torchmetrics.

Definitions (scores are in percent, 0–100, like the paper's tables):

* **SQuAD normalisation** (TyDiQA): lower-case, drop ASCII punctuation, drop the articles
  ``a|an|the``, collapse whitespace. ``EM(p, G) = 100·max_g [norm(p) == norm(g)]``;
  ``F1(p, G) = 100·max_g F1_tokens(norm(p).split(), norm(g).split())`` with the bag-of-tokens
  F1 ``2PR/(P+R)`` (0 when no token is shared) — the official SQuAD v1.1 / TyDiQA-GoldP script.
* **BBH exact match** (open-instruct, Hugging Face ``exact_match`` with ``ignore_case`` and
  ``ignore_punctuation``): lower-case and drop ASCII punctuation on both sides, then compare the
  strings exactly (no whitespace collapsing; the extracted prediction is already stripped).
* **BBH answer extraction**: the text after the first ``"So the answer is "`` up to the next
  ``"."``; without that cue, the generation up to its first blank line (stripped).
* **MMLU**: the prediction is the choice with the highest next-token log-probability.

Aggregation: :class:`PerTaskMean` keeps a sum and a count per task (tensor states reduced with
``sum`` across processes) and reports each task's mean, their unweighted mean (``macro``) and the
mean over all examples (``micro``).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

import torch
from torchmetrics import Metric

_PUNCT = set(string.punctuation)
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_BBH_ANSWER = re.compile(r"So the answer is (.*?)\.")


# ------------------------------------------------------------------------ plain functions
def squad_normalize(text: str) -> str:
    """SQuAD v1.1 answer normalisation."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def squad_exact_match(prediction: str, golds: Sequence[str]) -> float:
    """100 if the normalised prediction equals any normalised gold answer, else 0."""
    p = squad_normalize(prediction)
    return 100.0 * float(any(p == squad_normalize(g) for g in golds))


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_f1(prediction: str, golds: Sequence[str]) -> float:
    """100 × max over gold answers of the token-level F1 after SQuAD normalisation."""
    p = squad_normalize(prediction).split()
    return 100.0 * max(_token_f1(p, squad_normalize(g).split()) for g in golds)


def bbh_normalize(text: str) -> str:
    """Lower-case and drop ASCII punctuation (HF ``exact_match`` with ignore_case/punctuation)."""
    return text.lower().translate(_PUNCT_TABLE)


def bbh_exact_match(prediction: str, target: str) -> float:
    return 100.0 * float(bbh_normalize(prediction) == bbh_normalize(target))


def extract_bbh_answer(output: str) -> str:
    """The answer in a CoT generation: after ``"So the answer is "`` up to the next period; without
    the cue, the generation up to its first blank line."""
    m = _BBH_ANSWER.search(output)
    if m:
        return m.group(1).strip()
    return output.strip().split("\n\n")[0].strip()


# ------------------------------------------------------------------------ torchmetrics
class PerTaskMean(Metric):
    """Mean of a per-example score, per task, with ``macro`` (over tasks) and ``micro`` (over
    examples) averages. ``compute()`` returns ``{task: mean, ..., "macro": m, "micro": m}``; tasks
    without examples are left out (and out of ``macro``)."""

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, tasks: Sequence[str], **kwargs):
        super().__init__(**kwargs)
        if not tasks:
            raise ValueError(f"{type(self).__name__} needs at least one task name")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"{type(self).__name__}: duplicate task names in {list(tasks)}")
        self.tasks = list(tasks)
        self._index = {t: i for i, t in enumerate(self.tasks)}
        self.add_state("score_sum", torch.zeros(len(tasks), dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(len(tasks), dtype=torch.float32), dist_reduce_fx="sum")

    def _task_index(self, tasks: Sequence[str]) -> torch.Tensor:
        try:
            idx = [self._index[t] for t in tasks]
        except KeyError as e:
            raise KeyError(f"{type(self).__name__}: unknown task {e.args[0]!r}; known: {self.tasks}") from None
        return torch.tensor(idx, dtype=torch.long, device=self.score_sum.device)

    def update(self, scores: torch.Tensor | Sequence[float], tasks: Sequence[str]) -> None:  # type: ignore[override]
        scores = torch.as_tensor(scores, dtype=torch.float32, device=self.score_sum.device).reshape(-1)
        if scores.numel() != len(tasks):
            raise ValueError(f"{type(self).__name__}: {scores.numel()} scores but {len(tasks)} task names")
        idx = self._task_index(tasks)
        self.score_sum.index_add_(0, idx, scores)
        self.count.index_add_(0, idx, torch.ones_like(scores))

    def compute(self) -> dict[str, torch.Tensor]:
        seen = self.count > 0
        out = {t: self.score_sum[i] / self.count[i] for i, t in enumerate(self.tasks) if bool(seen[i])}
        if bool(seen.any()):
            out["macro"] = (self.score_sum[seen] / self.count[seen]).mean()
            out["micro"] = self.score_sum.sum() / self.count.sum()
        return out


class PerTaskAccuracy(PerTaskMean):
    """Accuracy (percent) per task: ``update(preds [B], target [B], tasks)`` with class indices."""

    def update(self, preds: torch.Tensor, target: torch.Tensor, tasks: Sequence[str]) -> None:  # type: ignore[override]
        if preds.shape != target.shape:
            raise ValueError(f"PerTaskAccuracy: preds {tuple(preds.shape)} vs target {tuple(target.shape)}")
        super().update(100.0 * (preds == target).float(), tasks)


class ExactMatch(PerTaskMean):
    """Exact match (percent) per task: ``update(preds: list[str], targets, tasks)``.

    ``normalization="squad"`` (targets: list of gold-answer lists, max over golds) or ``"bbh"``
    (targets: one string each).
    """

    def __init__(self, tasks: Sequence[str], normalization: str = "squad", **kwargs):
        if normalization not in ("squad", "bbh"):
            raise ValueError(f"ExactMatch: normalization must be 'squad' or 'bbh', got {normalization!r}")
        super().__init__(tasks, **kwargs)
        self.normalization = normalization

    def update(self, preds: Sequence[str], targets: Sequence, tasks: Sequence[str]) -> None:  # type: ignore[override]
        if len(preds) != len(targets):
            raise ValueError(f"ExactMatch: {len(preds)} predictions but {len(targets)} targets")
        if self.normalization == "squad":
            scores = [squad_exact_match(p, [t] if isinstance(t, str) else t) for p, t in zip(preds, targets)]
        else:
            scores = [bbh_exact_match(p, t) for p, t in zip(preds, targets)]
        super().update(scores, tasks)


class SquadF1(PerTaskMean):
    """SQuAD token F1 (percent) per task: ``update(preds: list[str], golds: list[list[str]], tasks)``."""

    def update(self, preds: Sequence[str], targets: Sequence, tasks: Sequence[str]) -> None:  # type: ignore[override]
        if len(preds) != len(targets):
            raise ValueError(f"SquadF1: {len(preds)} predictions but {len(targets)} targets")
        super().update([squad_f1(p, [t] if isinstance(t, str) else t) for p, t in zip(preds, targets)], tasks)


def flatten_results(suite: str, metric: str, values: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{"<suite>/<metric>": macro, "<suite>/<metric>_micro": micro, "<suite>/<metric>/<task>": v}``."""
    out: dict[str, float] = {}
    for k, v in values.items():
        v = float(v)
        if k == "macro":
            out[f"{suite}/{metric}"] = v
        elif k == "micro":
            out[f"{suite}/{metric}_micro"] = v
        else:
            out[f"{suite}/{metric}/{k}"] = v
    return out


def format_results(results: dict[str, float], title: str = "evaluation") -> str:
    """One plain table of evaluation results (``flatten_results`` keys, full names): a suite's headline metric, its
    micro average, then its tasks indented under it. Accuracy-like metrics are percentages as computed."""
    if not results:
        return f"{title}: no results"
    width = max(len(k) for k in results) + 2
    lines = [f"{title}:", f"  {'metric':<{width}}{'value':>8}"]
    for k in sorted(results, key=lambda k: (k.split("/")[0], k.count("/"), k)):
        name = ("  " + k) if k.count("/") > 1 else k
        lines.append(f"  {name:<{width}}{results[k]:>8.2f}")
    return "\n".join(lines)
