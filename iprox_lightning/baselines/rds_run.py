"""``train.py rds_scores``'s work (:func:`write_rds_scores`): RDS+ scores of a pool (:func:`.rds.rds_table`, forward
passes only) written as a score table with its settings and fingerprint. ``commands/rds_scores.py`` holds the
command's arguments."""
from __future__ import annotations

import time
from pathlib import Path

from ..data import SFTDataModule
from ..data.pool import check_output_is_not_input
from ..engine.batch import resolve_device
from ..errors import OutputExistsError
from ..io.fingerprint import loader_digest, source_identity
from ..io.ownership import check_owned, make_owned_dir
from ..io.score_dir import write_settings
from ..io.scores import read_settings
from ..models.loading import load_model
from .rds import rds_table


def write_rds_scores(model: str, out: Path, *, pool, validation, tokenizer: str | None, max_length: int,
                     batch_size: int, seed: int, builtin_size: int, device: str, overwrite: bool) -> str:
    """Score ``pool`` with RDS+ under ``model`` against ``validation`` into ``<out>/scores.parquet`` +
    ``settings.json`` (another run's scores there are replaced only with ``overwrite``); returns the table's path."""
    check_output_is_not_input(out, pool, "output_dir")
    settings = {"method": "rds+", "max_length": max_length}
    _check_other_run(out, settings, overwrite)
    dm = SFTDataModule(pool=pool, validation=validation, tokenizer=tokenizer or model, max_length=max_length,
                       batch_size=batch_size, seed=seed, builtin_size=builtin_size)
    dm.setup("predict")
    dm.setup("validate")
    net, _ = load_model(model, tokenizer=False)
    net.to(resolve_device(device))
    t0 = time.perf_counter()
    table = rds_table(dm.predict_dataloader(), dm.validation_dataloader(), net)
    wall = time.perf_counter() - t0
    make_owned_dir(out, "scores")
    path = table.save(str(out / "scores.parquet"))
    write_settings(out, {"method": "rds+", **table.settings, "wall_s": wall, "pool": dm.pool_provenance(),
                         "fingerprint": {
        "model": source_identity(model), "settings": settings,
        "pool": loader_digest(dm.predict_dataloader()), "validation": loader_digest(dm.validation_dataloader())}})
    print(f"rds_scores: RDS+ scores of {len(table)} pool examples against {len(table.task_names)} validation "
          f"task(s) in {wall:.1f} s -> {path}")
    return path


def _check_other_run(out: Path, settings: dict, overwrite: bool) -> None:
    """Refuse an ``out`` holding another run's scores (another selector's or other settings) unless ``overwrite``
    (and then only one the package wrote)."""
    old = read_settings(out) or None
    other_run = old is not None and (old.get("fingerprint") or {}).get("settings") != settings
    if other_run and overwrite:
        check_owned(out, "scores", option="--overwrite true", what="its scores would be replaced")
    if other_run and not overwrite:
        raise OutputExistsError(f"output_dir {out} holds another run's scores ({out / 'settings.json'}: method "
                                f"{old.get('method')!r}); pass --overwrite true to replace them, or choose another "
                                "output_dir")
