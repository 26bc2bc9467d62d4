"""Build a gradient store: the pool's projected per-example gradients, once, for any later query."""
from __future__ import annotations

from typing import Optional

from ..engine.settings import takes_settings
from ..scoring.config import STORE_FIELDS, ScoringConfig


@takes_settings(ScoringConfig, "scoring", fields=STORE_FIELDS)
def build_store(
    model: str,
    output_dir: str,
    pool: str = "builtin",
    tokenizer: Optional[str] = None,
    k: int = 16,
    seed: int = 0,
    projection: str = "gaussian",
    store_dtype: str = "float16",
    max_length: int = 512,
    batch_size: int = 8,
    builtin_size: int = 2000,
    data_seed: int = 0,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    devices: int = 1,
    accelerator: str = "auto",
    strategy: str = "ddp",
    write_every_n_batches: int = 50,
    overwrite: bool = False,
    progress: bool = True,
    factors_dir: Optional[str] = None,
    precision: Optional[str] = None,
    gradient_checkpointing: bool = False,
    scoring: Optional[ScoringConfig] = None,
) -> str:
    """Project every pool example's gradient (LoGra-style, ``k`` rows per side of each tracked weight) and write them
    to a gradient store in ``output_dir`` (safetensors shards, ``store.json``; resumable: a killed build continues; a
    store of another model, pool or settings is refused). ``python train.py query`` then scores any validation set
    from it in seconds. The metric's settings (``method``, ``damping``, ``damping_mode``, ``kfac_examples``,
    ``loss_reduction``, ``fisher``, ``damping_target``, ``options``) and ``target_patterns`` are the scoring settings'
    fields (:class:`~iprox_lightning.scoring.influence.ScoringConfig`); ``query`` uses the store's.

    Args:
        model: the model whose gradients are stored (the target, a saved proxy directory, ``builtin``, a hub id).
        output_dir: the store directory.
        pool: the candidate pool (any source SFTDataModule reads).
        tokenizer: tokenizer (default: the model's).
        k: projection rows per side of each tracked weight (``k >= a dimension`` leaves that side exact).
        seed: seed of the projections (saved in the store).
        projection: ``gaussian`` (seeded random rows) or ``pca`` (each layer's ``k`` leading eigenvectors of its input
            and output-gradient second moments, fitted on ``kfac_examples`` pool examples; TracIn only).
        store_dtype: storage of the vectors: ``float16``, ``bfloat16`` or ``float32``.
        max_length: token cap per example.
        batch_size: examples per backward pass.
        builtin_size: size of the built-in pool (``pool: builtin``).
        data_seed: seed of the data module.
        dtype: model dtype when loading.
        attn_implementation: attention kernel when loading (``sdpa``, ``eager``): the same function, not part of the
            store's fingerprint.
        devices: processes (DDP when > 1).
        accelerator: ``auto``, ``cpu``, ``gpu``.
        strategy: ``ddp`` (each process holds the whole model and stores its share of the pool) or ``fsdp``
            (``ModelParallelStrategy``, FSDP2: the model sharded per decoder block over the ``devices`` processes, as
            scoring's; the same store).
        write_every_n_batches: write a shard every this many batches.
        overwrite: delete an earlier store in ``output_dir`` first.
        progress: show a progress bar.
        factors_dir: a directory of saved factors shared with scoring runs and other stores (``predict``'s
            ``model.init_args.factors_dir``): K-FAC / EK-FAC factors and PCA moments fitted there before on the same
            model, factor data and settings are loaded, not fitted again (the store keeps its own copy).
        precision: the Trainer precision of the build (``32-true``, ``bf16-mixed``, ``bf16-true``; default float32);
            recorded in the store, whose queries compute the validation gradients under the same one. The vectors
            are projected in float32 whatever it is (``docs/GUIDE.md``, Precision). The Trainer's alone: the module
            reads it from there.
        gradient_checkpointing: activation checkpointing of each decoder block (the forward keeps each block's
            input, the backward recomputes one block at a time): less memory, about one more forward of time, the
            same vectors.
    """
    from ..scoring.store_build import BuildStoreSettings, run_build_store  # lazy: --help (it loads Lightning)
    from .lightning import StopOnSigterm  # lazy: --help

    return run_build_store(BuildStoreSettings(
        model=model, output_dir=output_dir, pool=pool, tokenizer=tokenizer, k=k, seed=seed,
        projection=projection, store_dtype=store_dtype, max_length=max_length, batch_size=batch_size,
        builtin_size=builtin_size, data_seed=data_seed, dtype=dtype, attn_implementation=attn_implementation,
        devices=devices, accelerator=accelerator, strategy=strategy, write_every_n_batches=write_every_n_batches,
        overwrite=overwrite, progress=progress, factors_dir=factors_dir, precision=precision,
        gradient_checkpointing=gradient_checkpointing, scoring=scoring),
        [StopOnSigterm()])
