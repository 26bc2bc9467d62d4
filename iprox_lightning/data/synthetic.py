"""The built-in demo data: procedurally generated instruction examples, built offline so the whole IProX
pipeline runs anywhere in a few minutes on a CPU (every example is at most ~64 tokens long).

Data
    :func:`generate_builtin_dataset` draws examples from :data:`BUILTIN_FAMILIES`, six clearly
    distinct task families (two-number addition, list reversal, list sorting, upper-casing a word,
    a look-up in a small generated table, counting list items). Records follow the project's Dolly
    schema (``id``, ``instruction``, ``context``, ``response``, ``category``); ``category`` is the
    family and ids are stable: ``builtin-<family>-<index within the family, 5 digits>``.
    Families are assigned round-robin (example ``i`` belongs to family ``i mod 6``), so each family
    holds ``n // 6`` or ``n // 6 + 1`` examples; the list is then shuffled with the same seed.

Oracle
    :func:`builtin_validation` draws validation examples from :data:`BUILTIN_VALIDATION_FAMILIES`
    only (a subset of the families; ids ``builtin-val-<family>-<index>``). A good selector picks
    training examples of those families, so :func:`oracle_share` — the share of selected ids whose
    family is a validation family — measures selection quality with known ground truth. Random
    selection gives the base rate ``len(BUILTIN_VALIDATION_FAMILIES) / len(BUILTIN_FAMILIES)`` = 1/3.

The character tokenizer and the tiny Llama the demo runs on are in
:mod:`iprox_lightning.models.builtin`.
"""
from __future__ import annotations

import random
import re
import string
from typing import Iterable

BUILTIN_FAMILIES: tuple[str, ...] = ("addition", "reverse", "sort", "uppercase", "lookup", "count")
"""The task families of the built-in data set (also its ``category`` values)."""

BUILTIN_VALIDATION_FAMILIES: tuple[str, ...] = ("addition", "uppercase")
"""The families the built-in validation sets are drawn from (the oracle's "relevant" families)."""

_ID_RE = re.compile(r"^builtin-(?:val-)?([a-z]+)-\d+$")
_WORDS = ("red", "tan", "sky", "oak", "ice", "sun", "fog", "ivy", "elm", "jam", "owl", "fir")
_INSTRUCTIONS = {
    "addition": ("Add the numbers.", "What is the sum?", "Compute the total."),
    "reverse": ("Reverse the list.", "Write the list backwards."),
    "sort": ("Sort the list.", "Put the letters in order."),
    "uppercase": ("Uppercase the word.", "Write the word in capitals."),
    "lookup": ("What is {key} in the table?", "Look up {key}."),
    "count": ("How many items are there?", "Count the items."),
}


# ----------------------------------------------------------------------------- data
def _letters(rng: random.Random, lo: int, hi: int) -> list[str]:
    return rng.sample(string.ascii_lowercase, rng.randint(lo, hi))


def _make_example(family: str, rng: random.Random) -> tuple[str, str, str]:
    """``(instruction, context, response)`` of one example of ``family``."""
    instruction = rng.choice(_INSTRUCTIONS[family])
    if family == "addition":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return instruction, f"{a}+{b}", str(a + b)
    if family == "reverse":
        xs = _letters(rng, 3, 6)
        return instruction, " ".join(xs), " ".join(reversed(xs))
    if family == "sort":
        xs = _letters(rng, 3, 6)
        return instruction, " ".join(xs), " ".join(sorted(xs))
    if family == "uppercase":
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
        return instruction, word, word.upper()
    if family == "lookup":
        keys = rng.sample(string.ascii_lowercase, 3)
        values = rng.sample(_WORDS, 3)
        key = rng.randrange(3)
        table = " ".join(f"{k}={v}" for k, v in zip(keys, values))
        return instruction.format(key=keys[key]), table, values[key]
    if family == "count":
        xs = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9))]
        return instruction, " ".join(xs), str(len(xs))
    raise ValueError(f"unknown built-in family {family!r}; choose one of {BUILTIN_FAMILIES}")


def _record(prefix: str, family: str, index: int, rng: random.Random) -> dict:
    instruction, context, response = _make_example(family, rng)
    return {
        "id": f"{prefix}-{family}-{index:05d}",
        "instruction": instruction,
        "context": context,
        "response": response,
        "category": family,
    }


def generate_builtin_dataset(n: int = 2000, seed: int = 0) -> list[dict]:
    """``n`` built-in instruction examples (Dolly schema), deterministic in ``seed``.

    Example ``i`` (before the final shuffle) belongs to family ``BUILTIN_FAMILIES[i % 6]`` and gets
    id ``builtin-<family>-<i // 6 :05d>``.
    """
    if n < 1:
        raise ValueError(f"generate_builtin_dataset: n must be >= 1, got {n}")
    rng = random.Random(f"iprox-builtin-pool-{seed}")
    k = len(BUILTIN_FAMILIES)
    records = [_record("builtin", BUILTIN_FAMILIES[i % k], i // k, rng) for i in range(n)]
    rng.shuffle(records)
    return records


def builtin_validation(n_per_task: int = 8, seed: int = 0, families: Iterable[str] | None = None) -> list[dict]:
    """Validation examples: ``n_per_task`` per family of ``families`` (default
    :data:`BUILTIN_VALIDATION_FAMILIES`), ids ``builtin-val-<family>-<index>``, ``category`` = family.

    Drawn from a random stream independent of :func:`generate_builtin_dataset`'s.
    """
    fams = tuple(BUILTIN_VALIDATION_FAMILIES if families is None else families)
    unknown = [f for f in fams if f not in BUILTIN_FAMILIES]
    if unknown:
        raise ValueError(f"builtin_validation: unknown families {unknown}; choose from {BUILTIN_FAMILIES}")
    if n_per_task < 1:
        raise ValueError(f"builtin_validation: n_per_task must be >= 1, got {n_per_task}")
    rng = random.Random(f"iprox-builtin-validation-{seed}")
    return [_record("builtin-val", fam, i, rng) for fam in fams for i in range(n_per_task)]


def builtin_family(example_id: str) -> str:
    """The family of a built-in example id (``builtin-<family>-00042`` -> ``<family>``)."""
    m = _ID_RE.match(example_id)
    if m is None or m.group(1) not in BUILTIN_FAMILIES:
        raise ValueError(f"{example_id!r} is not a built-in example id (expected 'builtin-<family>-<number>')")
    return m.group(1)


def oracle_share(selected_ids: Iterable[str], families: Iterable[str] | None = None) -> float:
    """Share of ``selected_ids`` whose family is in ``families`` (default
    :data:`BUILTIN_VALIDATION_FAMILIES`). Random selection scores about 1/3; a perfect selector 1.
    """
    relevant = set(BUILTIN_VALIDATION_FAMILIES if families is None else families)
    ids = list(selected_ids)
    if not ids:
        raise ValueError("oracle_share: no selected ids")
    return sum(builtin_family(i) in relevant for i in ids) / len(ids)
