"""Selection: rules that turn score columns into one ranking, ``select`` (restrictions, top-k, the output) and
its summary."""

# public on purpose: the selection (select) and its rules over a task's score columns, which bench/effect.py reports
from .rules import RULES, rule_order, task_columns
from .select import select

__all__ = [
    "RULES", "rule_order", "select", "task_columns",
]
