"""Scores and nearest neighbours from a gradient store: a matrix product, no pass over the pool.

With ``x(z) = P(M g(z))`` the stored vector of pool example ``z`` (:mod:`.projection`; ``P`` the factored
projection, ``M`` the influence metric) and ``s_T = Σ_{z' ∈ T} x(z')`` the summed projected gradient of the
validation examples of task ``T``:

* ``score_T(z) = cos(x(z), s_T)``, the TracIn (or K-FAC, EK-FAC) cosine of :mod:`.influence` in the projected
  space (``P`` linear, so ``s_T`` is the projection of the task's summed gradient); with identity projections
  (``k >= every dimension``) it *is* the exact score;
* ``score(z) = cos(x(z), Σ_T s_T)`` (the pooled score), ``score_max`` LESS's ``max_T`` (written by the score table);
* a task named ``<suite>.<subtask>`` is a part of ``<suite>`` for ``select --rule max --task <suite>`` (LESS:
  the max over subtasks): each subtask costs one ``D``-vector, so memory is ``D · n_tasks``, never full gradients.

An example flagged ``zero_grad`` scores 0, one flagged ``nonfinite`` NaN (as in exact scoring).
:func:`nearest` returns, for each query vector, the ``k`` stored examples of highest cosine.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from ..errors import UserInputError
from .influence import ScoreTable


def task_sums(parts: Iterable[Mapping]) -> tuple[list[str], torch.Tensor, np.ndarray]:
    """``(task names sorted, S [K, D] float64 (row k: Σ of the vectors of task k), counts [K])`` of the outputs of
    :meth:`.projection.GradientProjector.project_batch` (an example without a task counts as ``"all"``). A NaN/inf
    vector raises naming its task, as exact scoring does."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for p in parts:
        X = p["vectors"].double()
        for j, t in enumerate(p["task"]):
            t = "all" if t is None else str(t)
            if bool(p["nonfinite"][j]):
                raise ValueError(f"the projected gradient of validation example {p['id'][j]!r} (task {t!r}) is not "
                                 "finite (NaN/inf): the model overflows on it; no scores were computed")
            sums[t] = X[j] if t not in sums else sums[t] + X[j]
            counts[t] = counts.get(t, 0) + 1
    if not sums:
        raise UserInputError("the validation data is empty: cannot compute validation gradients")
    names = sorted(sums)
    return names, torch.stack([sums[t] for t in names]), np.asarray([counts[t] for t in names], np.int64)


def cosine_scores(X: torch.Tensor, S: torch.Tensor, zero_grad, nonfinite) -> tuple[np.ndarray, np.ndarray]:
    """``(score [n], task_scores [n, K])``: cosines of the rows of ``X [n, D]`` with ``Σ_k S_k`` and with each
    ``S_k`` (float64), 0 for ``zero_grad`` rows and where a norm is 0, NaN for ``nonfinite`` rows."""
    X = X.double()
    S = S.double()
    Sall = S.sum(0)
    nx = X.norm(dim=1)
    ns, nall = S.norm(dim=1), Sall.norm()
    dots = X @ S.t()
    dall = X @ Sall
    den_t = nx[:, None] * ns[None, :]
    task = torch.where(den_t > 0, dots / den_t.clamp(min=1e-300), torch.zeros_like(dots))
    den = nx * nall
    score = torch.where(den > 0, dall / den.clamp(min=1e-300), torch.zeros_like(dall))
    zero = torch.as_tensor(np.asarray(zero_grad, bool))
    bad = torch.as_tensor(np.asarray(nonfinite, bool))
    score = torch.where(zero, torch.zeros_like(score), score)
    task = torch.where(zero[:, None], torch.zeros_like(task), task)
    score = torch.where(bad, torch.full_like(score, float("nan")), score)
    task = torch.where(bad[:, None], torch.full_like(task, float("nan")), task)
    return score.numpy(), task.numpy()


def query_table(shards: Iterable[Mapping], names: Sequence[str], S: torch.Tensor, settings: Mapping | None = None):
    """The :class:`~.influence.ScoreTable` of every stored example (rows sorted by id) against the task sums ``S``
    (one matrix product per shard; ``shards`` as :func:`iprox_lightning.io.gradient_store.iter_shards` yields them)."""
    ids, tasks, scores, task_scores, n_tok, zero, bad = [], [], [], [], [], [], []
    for s in shards:
        sc, ts = cosine_scores(s["vectors"], S, s["zero_grad"].numpy(), s["nonfinite"].numpy())
        ids += s["ids"]
        tasks += s["tasks"]
        scores.append(sc)
        task_scores.append(ts)
        n_tok.append(s["n_tokens"].numpy())
        zero.append(s["zero_grad"].numpy())
        bad.append(s["nonfinite"].numpy())
    if not ids:
        raise UserInputError("the gradient store holds no example")
    o = sorted(range(len(ids)), key=lambda j: ids[j])  # rows by id, like a merged score table
    cat = lambda parts: np.concatenate(parts)[o]  # noqa: E731
    return ScoreTable([ids[j] for j in o], cat(scores), list(names), cat(task_scores), cat(n_tok), cat(zero),
                      [tasks[j] for j in o] if any(t is not None for t in tasks) else None, dict(settings or {}),
                      nonfinite=cat(bad))


def topk_rows(values: torch.Tensor, index: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, index)`` of the ``min(k, n)`` largest entries of each row of ``values [m, n]`` (``index [m, n]``:
    each entry's position in the store), best first, equal values by lower index: the order of a stable descending
    sort by value of the rows ordered by index, found by ``torch.topk`` (linear) plus a stable sort of the ``k``
    chosen; only a row where a value equal to its ``k``-th is left out falls back to the full stable sort."""
    n = values.shape[1]
    k = min(k, n)
    v, j = torch.topk(values, k, dim=1, sorted=True)
    i = index.gather(1, j)
    if k < n:  # a tie across the k-th place: which equal entries are in depends on topk; settle those rows exactly
        kth = v[:, -1:]
        tied = (values == kth).sum(1) > (v == kth).sum(1)
        if bool(tied.any()):
            rows = torch.nonzero(tied).flatten()
            ro = torch.argsort(index[rows], dim=1, stable=True)
            rv, ri = values[rows].gather(1, ro), index[rows].gather(1, ro)
            o = torch.sort(rv, dim=1, descending=True, stable=True).indices[:, :k]
            v[rows], i[rows] = rv.gather(1, o), ri.gather(1, o)
    # among the chosen: by index, then (stable) by value descending
    o = torch.argsort(i, dim=1, stable=True)
    v, i = v.gather(1, o), i.gather(1, o)
    o = torch.sort(v, dim=1, descending=True, stable=True).indices
    return v.gather(1, o), i.gather(1, o)


def nearest(shards: Iterable[Mapping], Q: torch.Tensor, k: int,
            block_rows: int = 65536) -> tuple[list[list[str]], np.ndarray]:
    """``(ids [m][k'], cosines [m, k'])``: for each row of ``Q [m, D]`` the ``k' = min(k, n)`` stored examples of
    highest cosine, best first (ties by position in the store), streamed shard by shard and within a shard by blocks
    of ``block_rows`` stored rows with a running top-k per query (:func:`topk_rows`): memory ``m·(k + block_rows)``
    plus a shard, never the ``[m, n]`` cosines. Stored rows flagged ``zero_grad`` or ``nonfinite`` are never
    returned."""
    if k < 1:
        raise UserInputError(f"k must be >= 1, got {k}")
    if block_rows < 1:
        raise UserInputError(f"block_rows must be >= 1, got {block_rows}")
    Qn = torch.nn.functional.normalize(Q.double(), dim=1)
    best_v = torch.full((Q.shape[0], 0), float("-inf"), dtype=torch.float64)
    best_i = torch.zeros((Q.shape[0], 0), dtype=torch.long)
    all_ids: list[str] = []
    for s in shards:
        ok_all = ~(s["zero_grad"] | s["nonfinite"])
        start = len(all_ids)
        all_ids += s["ids"]
        for a in range(0, len(s["ids"]), block_rows):
            X = s["vectors"][a:a + block_rows].double()
            sims = Qn @ torch.nn.functional.normalize(X, dim=1).t()
            sims[:, ~ok_all[a:a + block_rows]] = float("-inf")
            idx = torch.arange(start + a, start + a + X.shape[0]).expand(Q.shape[0], -1)
            best_v, best_i = topk_rows(torch.cat([best_v, sims], 1), torch.cat([best_i, idx], 1), k)
    keep = torch.isfinite(best_v).all(0)
    best_v, best_i = best_v[:, keep], best_i[:, keep]
    return [[all_ids[j] for j in row] for row in best_i.tolist()], best_v.numpy()
