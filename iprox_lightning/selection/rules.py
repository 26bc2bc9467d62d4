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

A rule is one class, a :class:`SelectionRule` subclass with a class keyword ``name=``: it registers itself once in
:data:`RULES` (name -> the rule, a callable ``rule(ids, columns, task) -> (order, value)``: row indices best first, and
each row's value under the rule: the pooled, mean or max score, or for ``balanced`` the standardised score of the
task that took it), and declares whether the pipeline selects one subset per validation task with it (``per_task``)
and which columns it reads (:meth:`SelectionRule.columns`). ``select(..., rule=..., task=...)``,
``python train.py select --rule ... --task ...`` and ``pipeline --select_rule ...`` name them. Ties are broken by id.
"""
from __future__ import annotations

from typing import ClassVar, Mapping, Sequence

import numpy as np

from ..errors import UserInputError
from .topk import topk_order

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
    return topk_order(values, ids), values


class SelectionRule:
    """A selection rule (module docstring): ``rule(ids, columns, task) -> (order, value)``.

    Declared on the class: ``name`` (the class keyword; registers the rule in :data:`RULES`), ``per_task`` (the
    pipeline selects one subset per validation task with it, each ranked against that task; ``False``: one subset
    for all) and :meth:`columns` (the score columns it reads, checked for NaN/inf before ranking)."""

    name: ClassVar[str]
    per_task: ClassVar[bool] = True

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in RULES:
                raise TypeError(f"selection rule name {name!r} is taken by {type(RULES[name]).__name__}")
            cls.name = name
            RULES[name] = cls()

    def __call__(self, ids: Sequence[str], columns: Mapping[str, np.ndarray],
                 task: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def columns(self, column_names: Sequence[str], task: str | None = None) -> list[str]:
        """The table columns the rule reads: the task's parts (every task's with no ``task``)."""
        return list(task_columns({c: np.zeros(0) for c in column_names}, task))


RULES: dict[str, SelectionRule] = {}
"""Selection rules by name (the CLI's ``--rule``), filled by :class:`SelectionRule` subclasses."""


class Pooled(SelectionRule, name="pooled"):
    """The pooled ``score``; takes no task (one selection for all)."""

    per_task = False

    def __call__(self, ids, columns, task=None):
        if task is not None:
            raise UserInputError("rule 'pooled' ranks by the pooled score and takes no task; use rule 'mean' or 'max' "
                                 f"to select for task {task!r}")
        return _order(np.asarray(columns["score"], np.float64), ids)

    def columns(self, column_names, task=None):
        return ["score"]


class Mean(SelectionRule, name="mean"):
    """The mean of the task's parts."""

    def __call__(self, ids, columns, task=None):
        return _order(np.mean(np.stack(list(task_columns(columns, task).values())), axis=0), ids)


class Max(SelectionRule, name="max"):
    """LESS: the max over the task's parts."""

    def __call__(self, ids, columns, task=None):
        return _order(np.max(np.stack(list(task_columns(columns, task).values())), axis=0), ids)


class Balanced(SelectionRule, name="balanced"):
    """Round-robin over tasks by standardised score (see the module doc); ``task`` restricts to its parts."""

    def __call__(self, ids, columns, task=None):
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


def rule_order(rule: str, ids: Sequence[str], columns: Mapping[str, np.ndarray],
               task: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(order, value)``: row indices in the order rule ``rule`` takes them (best first) and each row's value."""
    return _rule(rule)(list(ids), columns, task)


def rule_columns(rule: str, column_names: Sequence[str], task: str | None = None) -> list[str]:
    """The table columns rule ``rule`` reads (to check them for NaN/inf before ranking)."""
    return _rule(rule).columns(column_names, task)


def _rule(rule: str) -> SelectionRule:
    if rule not in RULES:
        raise UserInputError(f"unknown selection rule {rule!r}; rules: {', '.join(RULES)}")
    return RULES[rule]
