"""Run the whole method end to end (warm-up to evaluation) and print a summary; built-in demo data by default.

Each stage goes through the same LightningCLI configs a user runs:

    warm-up -> build proxy (IPSVD + alignment) -> score (target and proxy) -> select (target, proxy,
    random) -> fine-tune on each of the three selections -> evaluate each on held-out examples of the
    validation tasks -> summary (retention, the selections explained, the fine-tuned effect)

With a per-task selection rule (``balanced``, the default, ``mean``, ``max``: a rule whose class declares ``per_task``,
:class:`~iprox_lightning.selection.rules.SelectionRule`) the target and
the proxy select one subset per validation task (``selected/<who>.<task>.jsonl``, ranked by the rule over the task's
score columns: with ``validation_subtasks`` in ``data_args``, round-robin over its subtasks by standardised score, or
LESS's max over them) and the target is fine-tuned on each
(``finetune/<who>.<task>/``), each evaluated on its own task; the random selection stays one subset for all tasks.

Each stage reads the previous stage's output directory under ``workdir``. The exact config of
every stage (the shipped ``configs/<stage>.yaml``, the ``configs/builtin/<stage>.yaml`` demo overlay
when running on the built-in data, and a generated overlay with this run's paths) is kept in
``<workdir>/configs/`` so each stage can be re-run by hand. A stage whose output already exists is
reused only when its fingerprint matches (:mod:`iprox_lightning.io.stages`: configs, overlay, sources,
upstream stages and the content of their outputs), so an interrupted pipeline resumes where it stopped; a changed
flag in an existing workdir stops with what differs (``--force true`` re-runs all, or use a new ``--workdir``); a
stage output replaced by hand is used, and the stages that read it run again.

The stages and their orchestration live in :mod:`iprox_lightning.workflow`; this module is the command's arguments.
"""
from __future__ import annotations

from typing import Any


def pipeline(
    workdir: str = "outputs/pipeline",
    target: str = "builtin",
    pool: str = "builtin",
    validation: str = "builtin",
    sparsity: float = 0.5,
    select_fraction: float = 0.05,
    select_rule: str = "balanced",
    method: str = "tracin",
    proxy_validation: str = "target",
    config_dir: str | None = None,
    demo_overlays: bool | None = None,
    accelerator: str = "cpu",
    devices: int = 1,
    num_nodes: int | None = None,
    strategy: str | None = None,
    precision: str | None = None,
    finetune: bool = True,
    force: bool = False,
    seed: int = 0,
    data_args: dict[str, Any] | None = None,
    align_epochs: int | None = None,
    num_threads: int | None = None,
    eval_per_task: int | None = None,
    lora: dict[str, Any] | None = None,
    plan: str | dict[str, Any] | None = None,
    device_memory: str | None = None,
) -> dict[str, Any]:
    """Run every stage and print a summary (proxy size vs target, time per stage, selection quality).

    Args:
        workdir: where every stage writes (``warmup/``, ``proxy/``, ``scores/``, ``selected/``, ...).
        target: the target model (``builtin``, hub id, local dir, ``.gguf``).
        pool: candidate pool source (``builtin``, JSONL/JSON/Parquet file, HF dataset id).
        validation: validation sets (``builtin``, a file with a ``category`` column, ``eval:<dir>``).
        sparsity: ρ, the share of each compressed layer's parameters removed.
        select_fraction: k as a fraction of the pool (paper: 5%).
        select_rule: how the score columns become one ranking (``balanced``, ``mean``, ``max``, ``pooled``:
            :mod:`iprox_lightning.selection.rules`) for the target's and the proxy's selection (the random one ranks
            by its random score). ``balanced`` (default), ``mean`` and ``max`` select once per validation task
            (``selected/<who>.<task>.jsonl``): round-robin over the task's columns by standardised score / their
            mean / their max (LESS's max over its subtasks with ``data_args={"validation_subtasks": true}``), and
            the target is fine-tuned on each. ``balanced`` is the default: on the downstream benchmark it was the best rule,
            or within 0.02 nats of it, on every task (``docs/BENCHMARKS.md``). ``pooled``: one subset by
            the cosine to the mean gradient of all validation examples (dominated by the largest task).
        method: the scoring stage's ``method`` (``ScoringConfig``): ``tracin``, ``kfac``, ``ekfac`` or any registered
            metric.
        proxy_validation: whose validation gradients the proxy's pool gradients are scored against: ``target`` (the
            warmed target's, projected into the proxy's factor space: the validation examples pay the target's
            backward, the pool only the proxy's; ``InfluenceScoringModule(validation_model=...)``) or ``proxy`` (its
            own, the paper's). Default ``target``: on SmolLM2 it lifted the worst task's Spearman with the target at
            ρ = 0.3 (BBH 0.39 → 0.43) and ρ = 0.5 (0.26 → 0.36) (`docs/BENCHMARKS.md`, issue-22 levers).
        config_dir: the stage configs (default: the repository's ``configs/``).
        demo_overlays: also apply ``configs/builtin/*.yaml`` (default: when pool is ``builtin``).
        accelerator: the Trainer accelerator of every stage (``cpu``, ``gpu``, ``auto``); the held-out evaluation's
            device.
        devices: the Trainer devices of every stage (processes per node). Above 1 (or with ``num_nodes`` above 1)
            each Lightning stage runs as its own ``python -m iprox_lightning.cli <subcommand>`` process, which
            Lightning's launcher starts the other processes from; its output goes to ``<workdir>/logs/<stage>.out``.
            The steps outside Lightning (random scores, select, the held-out evaluation, the summary) run once, in
            this process.
        num_nodes: the Trainer ``num_nodes`` of every stage (default: the stage configs', 1). Several nodes: untested
            here; each node would have to run the pipeline.
        strategy: the Trainer ``strategy`` of every stage, e.g. ``ddp`` (default: the stage configs', ``auto``).
        precision: the Trainer ``precision`` of every stage: ``32-true``, ``bf16-mixed`` or ``bf16-true`` (default: the
            stage configs', ``32-true``); the held-out evaluation runs in it too. What stays float32/64 under bf16:
            ``docs/GUIDE.md`` (Precision).
        finetune: also fine-tune the warmed-up target on each selection (proxy's, target's, random of
            the same size) and evaluate each on held-out examples of the validation tasks
            (:mod:`iprox_lightning.evaluation.heldout`).
        force: re-run stages whose outputs exist.
        seed: seed of every stage.
        data_args: extra ``SFTDataModule`` arguments for every stage (e.g. ``{"max_length": 128, "val_per_task": 2,
            "validation_subtasks": true}``).
        align_epochs: epochs of the alignment stage (default: the config's).
        num_threads: torch intra-op threads (default: 1 for the tiny built-in model, where threading
            overhead dominates — measured 28 s vs 6.4 min for the whole demo on a loaded 2-core machine —
            else torch's default).
        eval_per_task: evaluate the fine-tuned models on at most this many validation examples per task, drawn
            with ``seed``, first from those the scoring's validation sample (``val_per_task``) left out (default:
            every validation example; on the built-in data 50 fresh examples per validation family).
        lora: LoRA warm-up and fine-tuning (peft) instead of full fine-tuning, ``{"r": 8, "alpha": 16, "dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"]}`` (:class:`~iprox_lightning.models.lora.LoraSettings`): the
            adapters of every epoch in ``warmup/model/adapters/`` (and each fine-tune's), the merged dense model in
            ``warmup/model``, which the proxy is built from and scored as the target (default: full fine-tuning).
        plan: ``auto``: before any stage, fit every stage to ``device_memory`` (``train.py plan --fit``:
            :mod:`iprox_lightning.analysis.fit`, the largest per-device batch and the fewest memory levers:
            micro-batches that accumulate to the configs' batch, checkpointing, probe groups, the validation
            gradients' holding, K-FAC partitions and offload) at this run's settings, and apply it to the stages; a
            stage that fits at no setting stops the run before it starts. Or the overlay ``plan --fit`` prints
            (``{"warmup": {...}, "build_proxy": {...}, "score": {...}, "finetune": {...}}``: each merged into that
            stage's config). Default: the configs' settings. A stage the fit leaves unchanged keeps its fingerprint.
        device_memory: the memory of one device for ``plan auto`` (e.g. ``80GB``; default: the first CUDA device's,
            or on CPUs the host's shared by the devices).
    """
    from ..workflow.pipeline import run_pipeline  # lazy: --help (the stages load torch and Lightning)
    from ..workflow.settings import PipelineSettings  # lazy: --help
    from .lightning import run_lightning  # lazy: --help

    settings = PipelineSettings(
        workdir=workdir, target=target, pool=pool, validation=validation, sparsity=sparsity,
        select_fraction=select_fraction, select_rule=select_rule, method=method, proxy_validation=proxy_validation,
        config_dir=config_dir, demo_overlays=demo_overlays, accelerator=accelerator, devices=devices,
        num_nodes=num_nodes, strategy=strategy, precision=precision, finetune=finetune, force=force, seed=seed,
        data_args=data_args, align_epochs=align_epochs, num_threads=num_threads, eval_per_task=eval_per_task,
        lora=lora, plan=plan, device_memory=device_memory)
    return run_pipeline(settings, run_lightning)
