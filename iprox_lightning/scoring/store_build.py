"""``train.py build_store``'s work (:func:`run_build_store`): the pool's projected per-example gradients written once
by a predict run of :class:`~.store.GradientStoreModule` and :class:`~.store.GradientStoreWriter`, and the build's
seconds recorded. ``commands/build_store.py`` holds the command's arguments."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

from ..console import progress_lines, quiet_lightning_tips, quiet_stage
from ..data import SFTDataModule
from ..data.pool import check_output_is_not_input
from ..engine.precision import check_precision
from ..errors import UserInputError
from ..io.gradient_store import read_info, write_info
from ..io.output_guard import check_output_not_input
from .config import ScoringConfig
from .store import GradientStoreModule, GradientStoreWriter


@dataclass(frozen=True)
class BuildStoreSettings:
    """The arguments of one ``python train.py build_store``, as :func:`iprox_lightning.commands.build_store.build_store`
    received them (its signature declares their defaults, its docstring what each means)."""

    model: str
    output_dir: str
    pool: str
    tokenizer: Optional[str]
    k: int
    seed: int
    projection: str
    store_dtype: str
    max_length: int
    batch_size: int
    builtin_size: int
    data_seed: int
    dtype: str
    attn_implementation: str
    devices: int
    accelerator: str
    strategy: str
    write_every_n_batches: int
    overwrite: bool
    progress: bool
    factors_dir: Optional[str]
    precision: Optional[str]
    gradient_checkpointing: bool
    scoring: Optional[ScoringConfig]


def run_build_store(s: BuildStoreSettings, callbacks: list) -> str:
    """Build the store ``s.output_dir`` (a finished build of the same settings is kept, an unfinished one resumed);
    ``callbacks``: more Trainer callbacks (the command's SIGTERM stop). Returns the store's directory."""
    quiet_lightning_tips()
    check_output_is_not_input(s.output_dir, s.pool, "output_dir")
    check_output_not_input(s.output_dir, {"model": s.model}, "output_dir")
    check_precision(s.precision, "build_store")
    strategy = trainer_strategy(s.strategy, s.devices)
    module = GradientStoreModule(s.model, k=s.k, seed=s.seed, projection=s.projection, dtype=s.dtype,
                                 attn_implementation=s.attn_implementation, factors_dir=s.factors_dir,
                                 gradient_checkpointing=s.gradient_checkpointing, scoring=s.scoring)
    dm = SFTDataModule(pool=s.pool, validation=None, tokenizer=s.tokenizer or s.model, max_length=s.max_length,
                       batch_size=s.batch_size, seed=s.data_seed, builtin_size=s.builtin_size)
    data = {"tokenizer": s.tokenizer or s.model, "max_length": s.max_length, "prompt_template": dm.prompt_template,
            "truncation": dm.truncation, "builtin_size": s.builtin_size, "batch_size": s.batch_size}
    writer = GradientStoreWriter(s.output_dir, store_dtype=s.store_dtype,
                                 write_every_n_batches=s.write_every_n_batches, overwrite=s.overwrite,
                                 extra_info={"tokenization": data})
    t0 = time.perf_counter()
    with quiet_stage():  # one summary line, not Lightning's "GPU available" / "TPU available" lines (warnings show)
        trainer = L.Trainer(accelerator=s.accelerator, devices=s.devices, logger=False, enable_model_summary=False,
                            enable_progress_bar=s.progress, inference_mode=False,
                            callbacks=[writer, *callbacks, *progress_lines()],
                            enable_checkpointing=False, **strategy,
                            **({"precision": s.precision} if s.precision else {}))
        trainer.predict(module, datamodule=dm, return_predictions=False)
    info = read_info(s.output_dir)
    if trainer.global_rank == 0:
        info["build_seconds"] = time.perf_counter() - t0  # of this run (a resumed build: its part)
        write_info(s.output_dir, info)
        print(f"build_store: {info['rows']} pool examples, {info['dim']} numbers each ({s.store_dtype}; "
              f"{_size(info['bytes_per_example'])} per example, {_size(info['bytes'])} in all), "
              f"in {time.perf_counter() - t0:.1f} s -> {s.output_dir}")
    return s.output_dir


STRATEGIES = ("ddp", "fsdp")


def trainer_strategy(strategy: str, devices: int) -> dict:
    """The Trainer's ``strategy`` of ``build_store --strategy``: ``ddp`` Lightning's own choice (DDP on several
    devices, as before the option), ``fsdp`` ``ModelParallelStrategy`` (FSDP2 over ``devices``: the model sharded per
    decoder block, :meth:`~.store.GradientStoreModule.configure_model`; CPUs too, over gloo)."""
    if strategy not in STRATEGIES:
        raise UserInputError(f"build_store: --strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "ddp":
        return {}
    return {"strategy": ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)}


def _size(n: float | None) -> str:
    """``n`` bytes for a reader: ``"120 B"``, ``"1.5 KiB"``, ``"3.2 MiB"``."""
    if n is None:
        return "?"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"

