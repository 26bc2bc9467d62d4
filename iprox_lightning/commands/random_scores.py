"""Baseline scores: seeded random scores for every pool example (random selection through the same select step)."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import OutputExistsError, OutputIsDirectoryError


def random_scores(output: str, pool: str = "builtin", seed: int = 0, overwrite: bool = False) -> str:
    """Seeded random scores for every pool example (random selection via ``select``).

    Args:
        output: the score table to write (Parquet).
        pool: the candidate pool (any source SFTDataModule reads).
        seed: seed of the random scores.
        overwrite: replace an existing ``output`` that holds other scores (another selector's table, another seed
            or pool); the same scores again are left as they are.
    """
    from ..baselines.random_selection import random_scores as draw  # lazy: --help
    from ..data.pool import check_output_is_not_input, read_pool  # lazy: --help
    from ..io.scores import read_scores, write_scores  # lazy: --help

    out = Path(output)
    check_output_is_not_input(out, pool, "output")
    if out.is_dir():
        raise OutputIsDirectoryError(f"output {out} is a directory; name a file, e.g. {out / 'scores.parquet'}")
    recs = read_pool(pool)
    scores = draw(sorted(r["id"] for r in recs), seed)
    if os.path.lexists(out):
        try:
            old = read_scores(out)
        except (ValueError, OSError):
            old = None
        if not overwrite:
            if old != scores:
                raise OutputExistsError(f"output {out} exists and holds other scores (another selector's table, or "
                                        "another seed or pool); pass --overwrite true to replace it, or choose another "
                                        "output")
            print(f"random_scores: {out} already holds these scores (seed {seed}, {len(recs)} pool examples)")
            return str(out)
        if old is None or out.is_symlink():  # --overwrite replaces a score table only, never through a link
            what = "a symbolic link" if out.is_symlink() else "not a score table"
            raise OutputExistsError(f"output {out} exists and is {what}: not replaced, even with --overwrite true (the "
                                    "package replaces only what it writes). Choose another output, or delete it by "
                                    "hand if it is yours to drop")
    path = str(write_scores(scores, out))
    print(f"random_scores: wrote seeded (seed {seed}) random scores for {len(recs)} pool examples to {path}")
    return path
