"""Write a stratified random sample of a pool (each source in proportion to its size), to score a large pool in part."""
from __future__ import annotations

from pathlib import Path

from ..errors import OutputIsDirectoryError, UserInputError


def sample_pool(pool: str, n: int, output: str, by: str = "source", seed: int = 0, overwrite: bool = False) -> str:
    """Draw ``n`` records of ``pool`` without replacement, each stratum (value of the field ``by``) getting its share
    ``n·|stratum|/|pool|`` (largest remainder; :func:`~iprox_lightning.data.splits.stratified_sample`), and write them
    to ``output`` as JSON Lines: the rows as they are in the pool, every field kept, with their ids (and categories)
    filled in as the pool reader names them, so the sample's records are the pool's.

    Args:
        pool: the pool (a JSONL / JSON / Parquet file, a directory of them, a Hugging Face dataset id).
        n: the sample size (at most the pool's size).
        output: the JSONL file to write. An existing file holding another sample is not replaced unless
            ``overwrite`` is set; the same sample again is left as it is.
        by: the field whose values are the strata (every row must have it), e.g. ``source`` or ``category``.
        seed: seed of the draw within each stratum.
        overwrite: replace ``output`` even when it holds something else.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserInputError(f"--n must be >= 1, got {n}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserInputError(f"--seed must be an integer >= 0, got {seed}")
    out = Path(output)
    if out.is_dir():
        raise OutputIsDirectoryError(f"--output {out} is a directory; name a file, e.g. {out / 'pool_sample.jsonl'}")
    if out.suffix != ".jsonl":
        raise UserInputError(f"--output {out}: the sample is written as JSON Lines; name a .jsonl file")
    src = Path(str(pool))
    if src.exists() and (out.resolve() == src.resolve() or (src.is_dir() and out.resolve().is_relative_to(src.resolve()))):
        raise UserInputError(f"--output {out} would {'replace' if src.is_file() else 'go inside'} the pool {pool}; "
                         "choose another output file")
    from ..data.pool_sample import write_pool_sample  # lazy: --help

    return write_pool_sample(pool, n, out, by, seed, overwrite)
