"""What every suite hands the data module: tokenized records, task names and batch constants.

A *record* is one evaluation question: ``{"id": str, "task": str, "input_ids": list[int], ...}``
(the prompt, fully formatted and tokenized, ending where the model must continue) plus the
suite's gold fields. :func:`collate_eval` turns records into an **evaluation batch**:

* ``suite``          ``str`` — which suite scores the batch;
* ``input_ids``      ``LongTensor[B, T]`` — LEFT-padded prompts;
* ``attention_mask`` ``LongTensor[B, T]``;
* ``id``, ``task``   ``list[str]``;
* the suite's gold fields (ints -> ``LongTensor[B]``, anything else -> ``list``) and its constants
  (e.g. MMLU ``choice_ids``, BBH/TyDiQA ``max_new_tokens`` and ``stop``).

Evaluation batches carry no ``labels``: they are not the SFT batch format of :mod:`iprox_lightning.engine.batch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .common import left_pad


@dataclass
class SuiteData:
    """Records of one suite, the ordered task list (metric slots) and per-batch constants."""

    suite: str
    records: list[dict[str, Any]]
    tasks: list[str]
    constants: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class EvalCollator:
    """Picklable collate function (works with DataLoader workers)."""

    def __init__(self, suite: str, pad_id: int, constants: dict[str, Any] | None = None):
        self.suite = suite
        self.pad_id = pad_id
        self.constants = dict(constants or {})

    def __call__(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_eval(records, self.suite, self.pad_id, self.constants)


def collate_eval(records: list[dict[str, Any]], suite: str, pad_id: int, constants: dict[str, Any] | None = None) -> dict[str, Any]:
    ids, mask = left_pad([r["input_ids"] for r in records], pad_id)
    batch: dict[str, Any] = {"suite": suite, "input_ids": ids, "attention_mask": mask}
    for key in records[0]:
        if key == "input_ids":
            continue
        vals = [r[key] for r in records]
        if all(isinstance(v, bool) for v in vals):
            batch[key] = vals
        elif all(isinstance(v, int) for v in vals):
            batch[key] = torch.tensor(vals, dtype=torch.long)
        else:
            batch[key] = vals
    batch.update(constants or {})
    return batch


def left_truncate(ids: list[int], max_tokens: int | None) -> tuple[list[int], bool]:
    """Keep the last ``max_tokens`` ids (the end of a prompt is where the answer is asked)."""
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, False
    return ids[-max_tokens:], True
