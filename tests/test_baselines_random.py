"""The length-matched random control (``baselines.random_selection.length_matched_subset``) against a brute-force
reference: for each reference example, a uniform seeded draw among the not-yet-taken pool ids of its length."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from iprox_lightning.baselines.random_selection import length_matched_subset, random_score


def brute_force(reference, lengths, seed):
    """One id per reference example (ascending length): among the ids of that length not yet taken, the one with the
    largest random score (ties by id)."""
    left = dict(lengths)
    out = []
    for L in sorted(lengths[i] for i in reference):
        pick = min((i for i, n in left.items() if n == L), key=lambda i: (-random_score(i, seed), i))
        out.append(pick)
        del left[pick]
    return out


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_length_matched_subset_matches_brute_force_and_the_histogram(seed):
    rng = np.random.default_rng(seed)
    lengths = {f"ex{j:03d}": int(n) for j, n in enumerate(rng.integers(3, 12, size=120))}
    reference = [str(x) for x in rng.choice(sorted(lengths), size=20, replace=False)]
    got = length_matched_subset(reference, lengths, seed)
    assert got == brute_force(reference, lengths, seed)
    assert len(got) == len(set(got)) == 20
    assert collections.Counter(lengths[i] for i in got) == collections.Counter(lengths[i] for i in reference)
    # reproducible, independent of the pool's order; another seed draws another subset of the same lengths
    assert got == length_matched_subset(reference, dict(reversed(list(lengths.items()))), seed)
    other = length_matched_subset(reference, lengths, seed + 100)
    assert set(other) != set(got)
    assert sorted(lengths[i] for i in other) == sorted(lengths[i] for i in got)


def test_length_matched_subset_takes_a_whole_stratum_when_the_reference_fills_it():
    lengths = {"a3": 3, "b3": 3, "c5": 5, "d5": 5, "e6": 6}
    assert sorted(length_matched_subset(["a3", "b3", "e6"], lengths, seed=4)) == ["a3", "b3", "e6"]
    one = length_matched_subset(["c5"], lengths, seed=4)
    assert one == [max(["c5", "d5"], key=lambda i: random_score(i, 4))]


def test_length_matched_subset_rejects_bad_input():
    lengths = {"a": 3, "b": 4}
    with pytest.raises(ValueError, match="not in the pool's lengths, e.g. 'zz'"):
        length_matched_subset(["a", "zz"], lengths)
    with pytest.raises(ValueError, match="duplicate reference ids"):
        length_matched_subset(["a", "a"], lengths)
