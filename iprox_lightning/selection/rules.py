"""Selection rules: how the columns of a score table become the order in which ``select`` takes examples.

A score table has a pooled column ``score`` (cosine to the mean gradient of *all* validation examples) and one
column ``score/<task>`` per validation task. A task may be scored in parts — ``score/mmlu.abstract_algebra``
(a subtask: MMLU subject, BBH task, TyDiQA language) or ``score/mmlu.half0`` — and the parts of task ``T`` are
the columns ``score/T`` and ``score/T.<part>``. A rule turns the table into an order of rows, best first:

* ``pooled`` — the pooled ``score`` (the library's historical default; dominated by the largest suite);
* ``mean`` — the mean of the chosen task's parts (one selection per target task, scored against that task);
* ``max`` — LESS: the max over the task's parts (LESS scores each pool example by the max over a task's
  subtasks of the mean cosine to that subtask's validation examples; with no ``task``, the max over every
  task column, i.e. the table's ``score_max``);
* ``balanced`` — task-balanced (BIDS-style): each task column is standardised over the pool (z-score), then the
  task with the fewest picks so far takes its best remaining example, round-robin (one selection serving every
  task, none over-picked).

Rules are plain functions ``rule(ids, columns, task) -> (order, value)`` (row indices best first, and each row's
value under the rule: the pooled, mean or max score, or for ``balanced`` the standardised score of the task that
took it) registered in :data:`RULES`; ``select(...,
rule=..., task=...)`` and ``python train.py select --rule ... --task ...`` name them. Ties are broken by id.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import UserInputError

RuleFn = Callable[[Sequence[str], Mapping[str, np.ndarray], "str | None"], "tuple[np.ndarray, np.ndarray]"]


def task_columns(columns: Mapping[str, np.ndarray], task: str | None) -> dict[str, np.ndarray]:
    """``{column name: values}`` of the per-task columns of ``task`` (its parts), or of every task when
    ``task`` is None. Raises naming the available tasks when there is none."""
    cols = {c: v for c, v in columns.items() if c.startswith("score/")}
    if task is not None:
        cols = {c: v for c, v in cols.items() if c == f"score/{task}" or c.startswith(f"score/{task}.")}
    if not cols:
        have = sorted({c[len("score/"):].split(".")[0] for c in columns if c.startswith("score/")})
        raise UserInputError(f"no score column for task {task!r}; the table's tasks: {have or 'none (pooled score only)'}"
                             if task is not None else "the score table has no per-task columns (score/<task>), which this rule ranks by: "
                             "a table of one score (random_scores, a baseline) is selected with --rule pooled")
    return cols


def _order(values: np.ndarray, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    from .topk import topk_order

    return topk_order(values, ids), values


def pooled(ids, columns, task=None):
    if task is not None:
        raise UserInputError("rule 'pooled' ranks by the pooled score and takes no task; use rule 'mean' or 'max' "
                             f"to select for task {task!r}")
    return _order(np.asarray(columns["score"], np.float64), ids)


def mean(ids, columns, task=None):
    return _order(np.mean(np.stack(list(task_columns(columns, task).values())), axis=0), ids)


def max_(ids, columns, task=None):
    return _order(np.max(np.stack(list(task_columns(columns, task).values())), axis=0), ids)


def balanced(ids, columns, task=None):
    """Round-robin over tasks by standardised score (see the module doc); ``task`` restricts to its parts."""
    cols = task_columns(columns, task)
    orders, zs = [], []
    for v in cols.values():
        v = np.asarray(v, np.float64)
        sd = v.std()
        z = (v - v.mean()) / sd if sd > 0 else v - v.mean()
        orders.append(_order(z, ids)[0])
        zs.append(z)
    n, taken, out = len(ids), np.zeros(len(ids), bool), []
    value = np.zeros(n)
    heads = [0] * len(orders)
    while len(out) < n:
        for t in range(len(orders)):  # one pick per task per round: equal counts, ties by task order
            while heads[t] < n and taken[orders[t][heads[t]]]:
                heads[t] += 1
            if heads[t] < n:
                j = orders[t][heads[t]]
                taken[j] = True
                value[j] = zs[t][j]
                out.append(j)
    return np.asarray(out, dtype=np.int64), value


RULES: dict[str, RuleFn] = {"pooled": pooled, "mean": mean, "max": max_, "balanced": balanced}
"""Selection rules by name (the CLI's ``--rule``)."""


def rule_order(rule: str, ids: Sequence[str], columns: Mapping[str, np.ndarray],
               task: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(order, value)``: row indices in the order rule ``rule`` takes them (best first) and each row's value."""
    if rule not in RULES:
        raise UserInputError(f"unknown selection rule {rule!r}; rules: {', '.join(RULES)}")
    return RULES[rule](list(ids), columns, task)


def rule_columns(rule: str, column_names: Sequence[str], task: str | None = None) -> list[str]:
    """The table columns rule ``rule`` reads (to check them for NaN/inf before ranking)."""
    if rule == "pooled":
        return ["score"]
    return list(task_columns({c: np.zeros(0) for c in column_names}, task))
