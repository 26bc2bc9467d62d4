"""Baseline scores: seeded random scores for every pool example (random selection through the same select step)."""
from __future__ import annotations


def random_scores(output: str, pool: str = "builtin", seed: int = 0) -> str:
    """Seeded random scores for every pool example (random selection via ``select``).

    Args:
        output: the score table to write (Parquet).
        pool: the candidate pool (any source SFTDataModule reads).
        seed: seed of the random scores.
    """
    from ..data.pool import read_pool
    from ..baselines.random_selection import write_random_scores

    recs = read_pool(pool)
    path = str(write_random_scores(sorted(r["id"] for r in recs), output, seed=seed))
    print(f"random_scores: wrote seeded (seed {seed}) random scores for {len(recs)} pool examples to {path}")
    return path
