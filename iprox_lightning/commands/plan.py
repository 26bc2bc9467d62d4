"""Plan a run before it starts: peak memory per device and time of every stage; a stage that will not fit is refused.

The work lives in :mod:`iprox_lightning.analysis.plan_report`; this module is the command's arguments."""
from __future__ import annotations

import inspect
from typing import Optional

from ..engine.settings import takes_settings
from ..scoring.config import ScoringConfig


@takes_settings(ScoringConfig, "scoring", fields=("method", "kfac_examples", "kfac_dtype", "kfac_partitions",
                                                  "kfac_offload", "validation_gradients", "shard_layers"))
def plan(
    model: str = "llama-3.2-1b",
    pool_size: int = 16000,
    max_length: int = 512,
    batch_size: int = 8,
    validation_batch_size: Optional[int] = None,
    proxy_validation: str = "target",
    align_batch_size: int = 4,
    response_share: float = 1.0,
    precision: str = "32-true",
    devices: int = 1,
    num_nodes: int = 1,
    strategy: str = "ddp",
    accelerator: str = "cuda",
    device_memory: Optional[str] = None,
    gradient_checkpointing: bool = False,
    micro_batch_size: Optional[int] = None,
    fsdp_cpu_offload: bool = False,
    store_gradient_checkpointing: bool = False,
    sparsity: float = 0.5,
    num_probe_tokens: int = 1024,
    probe_group_layers: Optional[int] = None,
    align_epochs: int = 2,
    align_checkpointing: bool = False,
    align_micro_batch_size: Optional[int] = None,
    align_reshard_proxy: bool = False,
    validation_examples: int = 300,
    tasks: int = 3,
    k: int = 16,
    select_k: int = 800,
    warmup_epochs: int = 1,
    finetune_epochs: int = 4,
    speed_results: Optional[str] = None,
    output: Optional[str] = None,
    lora: Optional[dict] = None,
    checkpoints: int = 1,
    checkpoints_in_turn: bool = False,
    fit: bool = False,
    scoring: Optional[ScoringConfig] = None,
) -> list[dict]:
    """Print, per stage (warm-up; build_proxy's Stage 1 (IPSVD) and Stage 2 (alignment); scoring with each registered
    metric: TracIn, K-FAC, EK-FAC, ...; a gradient store's build; with the proxy: TracIn scoring against the target's
    validation gradients and the store build; the query of a store (the target's, the proxy's); fine-tune), the peak
    memory per device, what makes it up, its time and
    whether it fits ``device_memory``. Memory from the model's shapes (meta device) and the saved activations of its
    own decoder counted on fake tensors (:mod:`iprox_lightning.analysis.memory` says what each stage holds); time from
    a throughput measured by ``bench/speed.py`` for a model of the same size on the same kind of device, else from the
    FLOPs (labelled). With ``device_memory``, a stage that will not fit (the method's stage: ``method`` of scoring)
    stops the command with one ``error:`` line naming the setting to change; the other metrics' rows are
    information.

    Args:
        model: a named shape (smollm2-135m, gemma-3-270m, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-7b),
            a ``.gguf`` file, a Hugging Face model directory or a hub id (its config only; no weights are read).
        pool_size: candidate examples scored (and the base of the warm-up / construction fractions).
        max_length: tokens per example (data.max_length): the padded length the plan assumes.
        batch_size: per-device batch of warm-up, scoring, store build and fine-tune (data.batch_size).
        validation_batch_size: scoring's validation-pass batch (the scoring module's validation_batch_size; default:
            ``batch_size``): with the proxy, the target's backward on the validation examples.
        proxy_validation: the proxy scored against the target's validation gradients (``target``, the pipeline's
            default) or its own (``proxy``: no target held), as ``pipeline --proxy_validation``.
        align_batch_size: per-device batch of build_proxy (its data.batch_size).
        response_share: share of a batch's tokens that are scored (the LM head's rows); 1 is the upper bound.
        precision: trainer.precision: 32-true, bf16-mixed or bf16-true.
        devices: devices per node (trainer.devices).
        num_nodes: nodes (trainer.num_nodes).
        strategy: ddp or fsdp (ModelParallelStrategy, FSDP2: weights, gradients and AdamW sharded over the devices).
        accelerator: cuda or cpu (measured CPU throughputs apply to cpu; on cuda AdamW adds a foreach temporary).
        device_memory: memory of one device, e.g. 80GB, 141GiB; stages above it are refused.
        gradient_checkpointing: activation checkpointing in warm-up / fine-tune (model.gradient_checkpointing).
        micro_batch_size: warm-up / fine-tune split each batch into micro-batches of this many examples
            (model.micro_batch_size: the same steps, one micro-batch's activations); default: the whole batch.
        fsdp_cpu_offload: warm-up / fine-tune under strategy fsdp keep the sharded weights, gradients and AdamW
            moments in host memory (model.fsdp_cpu_offload).
        store_gradient_checkpointing: the store build checkpoints each decoder block (build_store
            gradient_checkpointing).
        sparsity: the proxy's sparsity ρ (IPSVDCallback sparsity).
        num_probe_tokens: Stage 1's probe columns (IPSVDCallback num_probe_tokens).
        probe_group_layers: Stage 1's layers per probe pass on each device (IPSVDCallback probe_group_layers;
            default: every layer of the device's share in one pass).
        align_epochs: Stage 2's epochs.
        align_checkpointing: Stage 2's activation checkpointing of both forwards (ProxyAlignModule
            activation_checkpointing); measured on CPU not to lower Stage 2's peak, so it changes no number here.
        align_micro_batch_size: Stage 2's rows per pass (ProxyAlignModule micro_batch_size; default: the whole build
            batch).
        align_reshard_proxy: Stage 2 under FSDP with the proxy gathered one decoder block at a time
            (ProxyAlignModule reshard_proxy).
        validation_examples: validation examples scored for the validation gradients.
        tasks: score columns: validation tasks, or subtasks with validation_subtasks (scoring keeps one float32
            gradient per column, held as ``validation_gradients`` says; the pipeline at the paper's sizes has 93).
        k: a gradient store's projection rows per side (build_store k).
        select_k: examples the fine-tune trains on.
        warmup_epochs: the warm-up's epochs (its trainer.max_epochs: configs/warmup.yaml 1; LESS's LoRA warm-up,
            configs/less/warmup.yaml, 4): its time.
        finetune_epochs: the fine-tune's epochs (its trainer.max_epochs: configs/finetune.yaml 4): its time.
        speed_results: directory of bench/speed.py's speed_*.json (default: the repository's bench/results).
        output: also write the plan as JSON to this file.
        lora: LoRA warm-up and fine-tune (``{r, alpha, dropout, target_modules}``, the modules' ``lora``): the base
            weights frozen (no gradients, no AdamW state), the adapters trained.
        checkpoints: scoring checkpoints summed (the scoring module's ``checkpoints``; LESS: 4): each checkpoint's
            model (LESS's adapters: one base shared, each checkpoint's adapters), metric state and validation
            gradients are held while the pool is scored. ``method: less`` needs ``lora`` (it scores the adapters'
            gradients).
        checkpoints_in_turn: the scoring module's ``checkpoints_in_turn``: the checkpoints scored one at a time (a
            pass over the pool each), one checkpoint's metric state and validation gradients held at a time.
        fit: also find, per stage, the largest per-device batch and the fewest memory levers (micro-batches,
            checkpointing, probe groups, the validation gradients' holding, K-FAC partitions and offload) that fit
            ``device_memory`` (:mod:`iprox_lightning.analysis.fit`: an ordered search priced by this plan), and print
            them as the overlay ``pipeline --plan`` and each stage command take; the levers given here are replaced
            by the search. A stage that fits at no setting stops the command after the print, naming the reason and
            the nearest setting.
    """
    from ..analysis.plan_report import PlanSettings, run_plan  # lazy: --help (it loads torch)

    defaults = {k: p.default for k, p in inspect.signature(plan).parameters.items()}
    return run_plan(PlanSettings(
        model=model, pool_size=pool_size, max_length=max_length, batch_size=batch_size,
        validation_batch_size=validation_batch_size, proxy_validation=proxy_validation,
        align_batch_size=align_batch_size, response_share=response_share, precision=precision, devices=devices,
        num_nodes=num_nodes, strategy=strategy, accelerator=accelerator, device_memory=device_memory,
        gradient_checkpointing=gradient_checkpointing, micro_batch_size=micro_batch_size,
        fsdp_cpu_offload=fsdp_cpu_offload, store_gradient_checkpointing=store_gradient_checkpointing,
        sparsity=sparsity, num_probe_tokens=num_probe_tokens, probe_group_layers=probe_group_layers,
        align_epochs=align_epochs, align_checkpointing=align_checkpointing,
        align_micro_batch_size=align_micro_batch_size, align_reshard_proxy=align_reshard_proxy,
        validation_examples=validation_examples, tasks=tasks,
        k=k, select_k=select_k, warmup_epochs=warmup_epochs, finetune_epochs=finetune_epochs,
        speed_results=speed_results, output=output, lora=lora, checkpoints=checkpoints,
        checkpoints_in_turn=checkpoints_in_turn, fit=fit,
        scoring=scoring),
        defaults)
