"""Build a gradient store: the pool's projected per-example gradients, once, for any later query."""
from __future__ import annotations

from typing import Optional


def build_store(
    model: str,
    output_dir: str,
    pool: str = "builtin",
    tokenizer: Optional[str] = None,
    k: int = 16,
    seed: int = 0,
    projection: str = "gaussian",
    method: str = "tracin",
    damping: float = 1e-3,
    damping_mode: str = "relative",
    kfac_examples: int = 1024,
    store_dtype: str = "float16",
    max_length: int = 512,
    batch_size: int = 8,
    builtin_size: int = 2000,
    data_seed: int = 0,
    target_patterns: Optional[list[str]] = None,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    devices: int = 1,
    accelerator: str = "auto",
    write_every_n_batches: int = 50,
    overwrite: bool = False,
    progress: bool = True,
    factors_dir: Optional[str] = None,
    precision: Optional[str] = None,
    loss_reduction: str = "mean",
    fisher: str = "empirical",
    damping_target: str = "factors",
) -> str:
    """Project every pool example's gradient (LoGra-style, ``k`` rows per side of each tracked weight) and write them
    to a gradient store in ``output_dir`` (safetensors shards, ``store.json``; resumable: a killed build continues; a
    store of another model, pool or settings is refused). ``python train.py query`` then scores any validation set
    from it in seconds.

    Args:
        model: the model whose gradients are stored (the target, a saved proxy directory, ``builtin``, a hub id).
        output_dir: the store directory.
        pool: the candidate pool (any source SFTDataModule reads).
        tokenizer: tokenizer (default: the model's).
        k: projection rows per side of each tracked weight (``k >= a dimension`` leaves that side exact).
        seed: seed of the projections (saved in the store).
        projection: ``gaussian`` (seeded random rows) or ``pca`` (each layer's ``k`` leading eigenvectors of its input
            and output-gradient second moments, fitted on ``kfac_examples`` pool examples; TracIn only).
        method: metric applied before projecting: ``tracin``, ``kfac`` or ``ekfac`` (factors fitted once, saved).
        damping: K-FAC / EK-FAC damping.
        damping_mode: ``relative`` or ``absolute``.
        kfac_examples: pool examples the factors are fitted on.
        store_dtype: storage of the vectors: ``float16``, ``bfloat16`` or ``float32``.
        max_length: token cap per example.
        batch_size: examples per backward pass.
        builtin_size: size of the built-in pool (``pool: builtin``).
        data_seed: seed of the data module.
        target_patterns: leaf-name regexes of the tracked linears (default: attention + MLP projections).
        dtype: model dtype when loading.
        attn_implementation: attention kernel when loading (``sdpa``, ``eager``): the same function, not part of the
            store's fingerprint.
        devices: processes (DDP when > 1).
        accelerator: ``auto``, ``cpu``, ``gpu``.
        write_every_n_batches: write a shard every this many batches.
        overwrite: delete an earlier store in ``output_dir`` first.
        progress: show a progress bar.
        factors_dir: a directory of saved factors shared with scoring runs and other stores (``predict``'s
            ``model.init_args.factors_dir``): K-FAC / EK-FAC factors and PCA moments fitted there before on the same
            model, factor data and settings are loaded, not fitted again (the store keeps its own copy).
        precision: the Trainer precision of the build (``32-true``, ``bf16-mixed``, ``bf16-true``; default float32);
            recorded in the store, whose queries compute the validation gradients under the same one. The vectors
            are projected in float32 whatever it is (``docs/GUIDE.md``, Precision).
        loss_reduction: the per-example loss: ``mean`` (default) or ``sum`` of the response tokens' cross-entropies
            (kronfluence's, bergson's); ``query`` uses the store's.
        fisher: K-FAC / EK-FAC factors from the labels (``empirical``, default) or from labels sampled from the
            model (``sampled``, kronfluence's default).
        damping_target: K-FAC damps each factor (``factors``, default) or their product (``product``, kronfluence's).
    """
    import time

    import lightning as L

    from ..console import progress_lines, quiet_lightning_tips, quiet_stage
    from ..data import SFTDataModule
    from ..io.gradient_store import read_info
    from ..scoring.store import GradientStoreModule, GradientStoreWriter
    from .lightning import StopOnSigterm

    quiet_lightning_tips()
    from ..data.pool import check_output_is_not_input

    check_output_is_not_input(output_dir, pool, "output_dir")
    from ..io.output_guard import check_output_not_input

    check_output_not_input(output_dir, {"model": model}, "output_dir")
    module = GradientStoreModule(model, k=k, seed=seed, projection=projection, method=method, damping=damping,
                                 damping_mode=damping_mode,
                                 kfac_examples=kfac_examples, target_patterns=target_patterns, dtype=dtype,
                                 attn_implementation=attn_implementation, factors_dir=factors_dir,
                                 precision=precision, loss_reduction=loss_reduction, fisher=fisher,
                                 damping_target=damping_target)
    dm = SFTDataModule(pool=pool, validation=None, tokenizer=tokenizer or model, max_length=max_length,
                       batch_size=batch_size, seed=data_seed, builtin_size=builtin_size)
    data = {"tokenizer": tokenizer or model, "max_length": max_length, "prompt_template": dm.prompt_template,
            "truncation": dm.truncation, "builtin_size": builtin_size, "batch_size": batch_size}
    writer = GradientStoreWriter(output_dir, store_dtype=store_dtype, write_every_n_batches=write_every_n_batches,
                                 overwrite=overwrite, extra_info={"tokenization": data})
    t0 = time.perf_counter()
    with quiet_stage():  # one summary line, not Lightning's "GPU available" / "TPU available" lines (warnings show)
        trainer = L.Trainer(accelerator=accelerator, devices=devices, logger=False, enable_model_summary=False,
                            enable_progress_bar=progress, inference_mode=False,
                            callbacks=[writer, StopOnSigterm(), *progress_lines()],
                            enable_checkpointing=False, **({"precision": precision} if precision else {}))
        trainer.predict(module, datamodule=dm, return_predictions=False)
    info = read_info(output_dir)
    if trainer.global_rank == 0:
        from ..io.gradient_store import write_info

        info["build_seconds"] = time.perf_counter() - t0  # of this run (a resumed build: its part)
        write_info(output_dir, info)
        print(f"build_store: {info['rows']} pool examples, {info['dim']} numbers each ({store_dtype}; "
              f"{_size(info['bytes_per_example'])} per example, {_size(info['bytes'])} in all), "
              f"in {time.perf_counter() - t0:.1f} s -> {output_dir}")
    return output_dir


def _size(n: float | None) -> str:
    """``n`` bytes for a reader: ``"120 B"``, ``"1.5 KiB"``, ``"3.2 MiB"``."""
    if n is None:
        return "?"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
