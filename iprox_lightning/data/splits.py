"""Reproducible splits of the candidate pool, as in the paper (§ experimental setup).

From one seed:

* **warm-up** subset — a random ``warmup_fraction`` (5%) of the pool; the target model is warmed
  up on it before scoring;
* **construction** subset — a random ``construction_fraction`` (1%) of the pool, used to build the
  IProX proxy, divided into the **probe** set (``probe_fraction`` = 10% of it; IPSVD statistics)
  and the **alignment** set (the other 90%);
* the **fidelity** subset — ``fidelity_examples`` further ids (default 0) in none of the splits above:
  held-out pool examples on which Stage 2 measures the proxy's ranking fidelity (Spearman of the
  proxy's and the target's TracIn scores, ``ProxyAlignModule(fidelity_examples=...)``);
* the **candidate pool** to score — the whole pool.

The warm-up, construction and fidelity subsets are disjoint: all are consecutive slices (in that
order) of one random permutation of the pool's ids, taken in sorted order so the result does not
depend on the order the records were read in; the fidelity slice comes last, so asking for it
changes no other split's ids, and ``n`` fidelity ids are the first ``n`` of a larger request. The
permutation is ``numpy.random.default_rng(seed).permutation``, stable across platforms and numpy
versions.

Rounding (``round`` is round-half-up here, ``⌊x + 0.5⌋``)::

    n_warmup       = max(1, round(warmup_fraction * N))        (0 when warmup_fraction == 0)
    n_construction = max(2, round(construction_fraction * N))
    n_probe        = min(n_construction - 1, max(1, round(probe_fraction * n_construction)))
    n_align        = n_construction - n_probe

so even a tiny pool gets non-empty probe and alignment sets; ``n_warmup + n_construction`` (and
``+ fidelity_examples``) must not exceed ``N``.

Validation sets keep a few examples per task: :func:`sample_per_task`. Stage 2 may train on part of them
(``SFTDataModule(val_train_fraction=...)``): :func:`split_validation` sets that part apart from the examples that
keep monitoring the alignment.
A pool too large to score whole is
cut down first with :func:`stratified_sample` (``python train.py sample_pool``): ``n`` records, each stratum (e.g.
each ``source``) in proportion to its size.
"""
from __future__ import annotations

import math
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..errors import UserInputError


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def _check_fraction(name: str, value: float, *, allow_zero: bool) -> None:
    lo_ok = value >= 0 if allow_zero else value > 0
    if not (lo_ok and value <= 1):
        raise UserInputError(f"{name} must be in {'[0' if allow_zero else '(0'}, 1], got {value}")


@dataclass(frozen=True)
class SplitSizes:
    warmup: int
    probe: int
    align: int

    @property
    def construction(self) -> int:
        return self.probe + self.align


def split_sizes(
    n: int, warmup_fraction: float = 0.05, construction_fraction: float = 0.01, probe_fraction: float = 0.1,
    align_examples: int | None = None,
) -> SplitSizes:
    """The split sizes for a pool of ``n`` examples (rounding rules in the module doc). ``align_examples``: the
    alignment split has exactly this many examples instead of ``n_construction - n_probe``; the probe split keeps the
    size the fractions give it, so the probe ids do not change and the alignment ids of a smaller request are the
    first ones of a larger one."""
    _check_fraction("warmup_fraction", warmup_fraction, allow_zero=True)
    _check_fraction("construction_fraction", construction_fraction, allow_zero=False)
    _check_fraction("probe_fraction", probe_fraction, allow_zero=False)
    if align_examples is not None and (isinstance(align_examples, bool) or not isinstance(align_examples, int)
                                       or align_examples < 1):
        raise UserInputError(f"align_examples must be an int >= 1 (or None: the construction fraction's), "
                             f"got {align_examples!r}")
    n_w = 0 if warmup_fraction == 0 else max(1, _round(warmup_fraction * n))
    n_c = max(2, _round(construction_fraction * n))
    n_p = min(n_c - 1, max(1, _round(probe_fraction * n_c)))
    n_a = n_c - n_p if align_examples is None else align_examples
    if n_w + n_p + n_a > n:
        raise UserInputError(
            f"pool of {n} examples is too small for a warm-up subset of {n_w} and a construction subset of "
            f"{n_p + n_a} (probe {n_p} + align {n_a}); lower warmup_fraction/construction_fraction"
            + ("/align_examples" if align_examples is not None else "") + " or add data"
        )
    return SplitSizes(warmup=n_w, probe=n_p, align=n_a)


@dataclass(frozen=True)
class PoolSplits:
    """Ids of each split (lists of str, in random order). ``pool`` is every id, sorted; ``fidelity`` is
    empty unless ``make_splits(fidelity_examples=n)`` asked for it."""

    warmup: list[str]
    probe: list[str]
    align: list[str]
    pool: list[str]
    fidelity: list[str] = field(default_factory=list)

    NAMES = ("warmup", "probe", "align", "construction", "fidelity", "pool")

    @property
    def construction(self) -> list[str]:
        return self.probe + self.align

    def get(self, name: str) -> list[str]:
        if name not in self.NAMES:
            raise KeyError(f"unknown split {name!r}; one of {', '.join(self.NAMES)}")
        return list(getattr(self, name))


def make_splits(
    ids: Sequence[str],
    seed: int = 0,
    warmup_fraction: float = 0.05,
    construction_fraction: float = 0.01,
    probe_fraction: float = 0.1,
    fidelity_examples: int = 0,
    align_examples: int | None = None,
) -> PoolSplits:
    """Warm-up / probe / alignment (/ fidelity) subsets and the candidate pool from one seed (module doc).
    ``fidelity_examples`` ids after the construction subset form the ``fidelity`` split; the other splits'
    ids do not depend on it."""
    pool = sorted(ids)
    if len(set(pool)) != len(pool):
        dup = next(a for a, b in zip(pool, pool[1:]) if a == b)
        raise UserInputError(f"make_splits: duplicate id {dup!r}")
    sizes = split_sizes(len(pool), warmup_fraction, construction_fraction, probe_fraction, align_examples)
    if fidelity_examples < 0:
        raise UserInputError(f"fidelity_examples must be >= 0, got {fidelity_examples}")
    end = sizes.warmup + sizes.construction
    if end + fidelity_examples > len(pool):
        raise UserInputError(
            f"pool of {len(pool)} examples is too small for {fidelity_examples} fidelity examples besides the "
            f"warm-up ({sizes.warmup}) and construction ({sizes.construction}) subsets; at most {len(pool) - end}")
    perm = np.random.default_rng(seed).permutation(len(pool))
    order = [pool[i] for i in perm]
    w, p = sizes.warmup, sizes.probe
    return PoolSplits(
        warmup=order[:w],
        probe=order[w : w + p],
        align=order[w + p : end],
        pool=pool,
        fidelity=order[end : end + fidelity_examples],
    )


def sample_per_task(ids: Sequence[str], tasks: Sequence[str], per_task: int | None, seed: int = 0) -> dict[str, list[str]]:
    """``{task: ids}`` keeping at most ``per_task`` random ids per task (all when ``None``).

    Tasks keep their first-seen order; within a task the sample is drawn from the sorted ids with
    ``numpy.random.default_rng([seed, crc32(task)])`` and returned sorted, so it is reproducible
    and one task's sample does not depend on the other tasks.
    """
    if len(ids) != len(tasks):
        raise ValueError(f"sample_per_task: {len(ids)} ids but {len(tasks)} tasks")
    if per_task is not None and per_task < 1:
        raise UserInputError(f"per_task must be >= 1 or None, got {per_task}")
    groups: Mapping[str, list[str]] = defaultdict(list)
    for i, t in zip(ids, tasks):
        groups[t].append(i)
    out: dict[str, list[str]] = {}
    for t, members in groups.items():
        members = sorted(members)
        if per_task is not None and len(members) > per_task:
            rng = np.random.default_rng([seed, zlib.crc32(t.encode("utf-8"))])  # independent per task
            keep = np.sort(rng.choice(len(members), size=per_task, replace=False))
            members = [members[k] for k in keep]
        out[t] = members
    return out


def split_validation(ids: Sequence[str], tasks: Sequence[str], fraction: float, seed: int = 0,
                     subtasks: Sequence[str | None] | None = None) -> tuple[list[str], list[str]]:
    """``(train_ids, monitor_ids)``: per task, ``n_train = min(n − 1, max(1, round(fraction · n)))`` of its ``n``
    validation examples for training (0 when ``n == 1`` or ``fraction == 0``: a task always keeps at least one
    example for monitoring), the rest for monitoring; the two lists are disjoint and cover ``ids``.

    Deterministic by ``seed`` and independent of the read order and of the other tasks: within a task each subtask's
    ids (sorted) are shuffled with ``numpy.random.default_rng([seed, crc32(task), crc32(subtask)])`` and the subtasks
    (sorted) are interleaved round-robin in an order drawn from ``default_rng([seed, crc32(task)])``; the first
    ``n_train`` of that sequence train. So the training examples spread over the subtasks (MMLU subjects, BBH tasks,
    TyDiQA languages) rather than exhausting one. Both lists keep the order of ``ids``.
    """
    if len(ids) != len(tasks) or (subtasks is not None and len(subtasks) != len(ids)):
        raise ValueError(f"split_validation: {len(ids)} ids, {len(tasks)} tasks"
                         + ("" if subtasks is None else f", {len(subtasks)} subtasks"))
    _check_fraction("fraction", fraction, allow_zero=True)
    if fraction == 1:
        raise ValueError("split_validation: fraction must be < 1 (every task keeps examples for monitoring)")
    if len(set(ids)) != len(ids):
        raise ValueError("split_validation: duplicate ids")
    groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for k, (i, t) in enumerate(zip(ids, tasks)):
        groups[t]["" if subtasks is None or subtasks[k] is None else str(subtasks[k])].append(i)
    train: set[str] = set()
    for t, subs in groups.items():
        n = sum(len(v) for v in subs.values())
        n_train = 0 if fraction == 0 or n < 2 else min(n - 1, max(1, _round(fraction * n)))
        if not n_train:
            continue
        crc_t = zlib.crc32(t.encode("utf-8"))
        queues = []
        for sub in sorted(subs):
            members = sorted(subs[sub])
            perm = np.random.default_rng([seed, crc_t, zlib.crc32(sub.encode("utf-8"))]).permutation(len(members))
            queues.append([members[k] for k in perm])
        order = np.random.default_rng([seed, crc_t]).permutation(len(queues))
        queues = [queues[k] for k in order]
        sequence = [q[j] for j in range(max(len(q) for q in queues)) for q in queues if j < len(q)]
        train.update(sequence[:n_train])
    return [i for i in ids if i in train], [i for i in ids if i not in train]


def stratified_sample(records: Sequence[Mapping], n: int, seed: int, by: str | None = "source") -> list:
    """``n`` records drawn without replacement, each stratum (value of ``by``) getting its share
    ``n·|stratum|/|records|`` (largest remainder, ties by stratum name), shuffled within the stratum with
    ``seed``. Returned in stratum order, then draw order.

    The stratum of a record is ``str(record.get(by))`` (a record without the field is in stratum ``"None"``;
    ``train.py sample_pool`` refuses such rows before calling this); ``by=None`` puts every record in one stratum:
    a uniform draw. The draw is
    ``numpy.random.default_rng(seed).permutation`` per stratum, strata in sorted order, so the same records in the
    same order give the same sample on every platform (``bench/fidelity_v2.py``'s recorded samples were drawn
    with this function).
    """
    if n > len(records):
        raise ValueError(f"sample of {n} asked from {len(records)} records")
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault("None" if by is None else str(r.get(by)), []).append(r)
    names = sorted(groups)
    exact = {g: n * len(groups[g]) / len(records) for g in names}
    take = {g: int(math.floor(exact[g])) for g in names}
    for g in sorted(names, key=lambda g: (-(exact[g] - take[g]), g))[: n - sum(take.values())]:
        take[g] += 1
    rng = np.random.default_rng(seed)
    out = []
    for g in names:
        idx = rng.permutation(len(groups[g]))[: take[g]]
        out.extend(groups[g][int(i)] for i in idx)
    return out
