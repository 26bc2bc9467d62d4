"""Plan a run before it starts: peak memory per device and time of every stage; a stage that will not fit is refused."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def plan(
    model: str = "llama-3.2-1b",
    pool_size: int = 16000,
    max_length: int = 512,
    batch_size: int = 8,
    align_batch_size: int = 4,
    response_share: float = 1.0,
    precision: str = "32-true",
    devices: int = 1,
    num_nodes: int = 1,
    strategy: str = "ddp",
    accelerator: str = "cuda",
    device_memory: Optional[str] = None,
    gradient_checkpointing: bool = False,
    sparsity: float = 0.5,
    num_probe_tokens: int = 1024,
    probe_group_layers: Optional[int] = None,
    align_epochs: int = 2,
    validation_examples: int = 300,
    tasks: int = 3,
    method: str = "tracin",
    kfac_examples: int = 1024,
    k: int = 16,
    select_k: int = 800,
    speed_results: Optional[str] = None,
    output: Optional[str] = None,
) -> list[dict]:
    """Print, per stage (warm-up; build_proxy's Stage 1 (IPSVD) and Stage 2 (alignment); scoring with TracIn, K-FAC
    and EK-FAC; a gradient store's build; fine-tune), the peak memory per device, what makes it up, its time and
    whether it fits ``device_memory``. Memory from the model's shapes (meta device) and the saved activations of its
    own decoder counted on fake tensors (:mod:`iprox_lightning.analysis.memory` says what each stage holds); time from
    a throughput measured by ``bench/speed.py`` for a model of the same size on the same kind of device, else from the
    FLOPs (labelled). With ``device_memory``, a stage that will not fit (the method's stage: ``method`` of scoring)
    stops the command with one ``error:`` line naming the setting to change; K-FAC / EK-FAC rows are information
    unless ``method`` names them.

    Args:
        model: a named shape (smollm2-135m, gemma-3-270m, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-7b),
            a ``.gguf`` file, a Hugging Face model directory or a hub id (its config only; no weights are read).
        pool_size: candidate examples scored (and the base of the warm-up / construction fractions).
        max_length: tokens per example (data.max_length): the padded length the plan assumes.
        batch_size: per-device batch of warm-up, scoring, store build and fine-tune (data.batch_size).
        align_batch_size: per-device batch of build_proxy (its data.batch_size).
        response_share: share of a batch's tokens that are scored (the LM head's rows); 1 is the upper bound.
        precision: trainer.precision: 32-true, bf16-mixed or bf16-true.
        devices: devices per node (trainer.devices).
        num_nodes: nodes (trainer.num_nodes).
        strategy: ddp or fsdp (ModelParallelStrategy, FSDP2: weights, gradients and AdamW sharded over the devices).
        accelerator: cuda or cpu (measured CPU throughputs apply to cpu; on cuda AdamW adds a foreach temporary).
        device_memory: memory of one device, e.g. 80GB, 141GiB; stages above it are refused.
        gradient_checkpointing: activation checkpointing in warm-up / fine-tune (model.gradient_checkpointing).
        sparsity: the proxy's sparsity ρ (IPSVDCallback sparsity).
        num_probe_tokens: Stage 1's probe columns (IPSVDCallback num_probe_tokens).
        probe_group_layers: Stage 1's layers per probe pass on each device (IPSVDCallback probe_group_layers;
            default: every layer of the device's share in one pass).
        align_epochs: Stage 2's epochs.
        validation_examples: validation examples scored for the validation gradients.
        tasks: score columns: validation tasks, or subtasks with validation_subtasks (scoring keeps one float32
            gradient per column; the pipeline at the paper's sizes has 93).
        method: the scoring method the run uses: tracin, kfac or ekfac.
        kfac_examples: examples K-FAC / EK-FAC factors are fitted on (time only: the factors' size is fixed).
        k: a gradient store's projection rows per side (build_store k).
        select_k: examples the fine-tune trains on.
        speed_results: directory of bench/speed.py's speed_*.json (default: the repository's bench/results).
        output: also write the plan as JSON to this file.
    """
    import json

    from ..analysis import memory as M
    from ..errors import UserInputError

    device_bytes = M.parse_bytes(device_memory) if device_memory is not None else None
    if devices < 1 or num_nodes < 1:
        raise UserInputError(f"devices and num_nodes must be >= 1, got {devices} and {num_nodes}")
    run = M.RunSettings(pool_size=pool_size, max_length=max_length, batch_size=batch_size,
                        align_batch_size=align_batch_size, response_share=response_share, precision=precision,
                        devices=devices * num_nodes, strategy=strategy, device_kind=accelerator,
                        gradient_checkpointing=gradient_checkpointing, sparsity=sparsity,
                        num_probe_tokens=num_probe_tokens, probe_group_layers=probe_group_layers,
                        align_epochs=align_epochs,
                        validation_examples=validation_examples, tasks=tasks, method=method,
                        kfac_examples=kfac_examples, store_k=k, select_k=select_k)
    config = M.load_config(model)
    sizes = M.ModelSizes.from_config(config, name=model)
    stages = M.plan_stages(sizes, config, run)
    speeds = M.measured_throughput(sizes.params, accelerator, speed_results or _RESULTS)
    M.attach_times(stages, sizes, run, speeds)

    print(f"plan: {model} — {sizes.params / 1e6:,.0f}M parameters ({sizes.trainable / 1e6:,.0f}M trained in warm-up), "
          f"{precision}, {run.devices} {accelerator} device(s), {strategy}; T = {max_length}, batch {batch_size} "
          f"(build_proxy {align_batch_size}), pool {pool_size}")
    rows = [("stage", "peak/device", "fits", "time", "largest parts")]
    for s in stages:
        fits = s.fits(device_bytes)
        parts = ", ".join(f"{k} {v / M.GIB:.1f}" for k, v in sorted(s.parts.items(), key=lambda kv: -kv[1])[:3])
        when = _time_text(s)
        rows.append((s.stage, M.gib(s.peak), "-" if fits is None else ("yes" if fits else "NO"), when, parts + " GiB"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    if output:
        Path(output).write_text(json.dumps({"model": model, "params": sizes.params, "device_memory": device_bytes,
                                            "settings": {k: getattr(run, k) for k in run.__dataclass_fields__},
                                            "stages": [s.to_dict() for s in stages]}, indent=1))
    refused = [s for s in stages if s.fits(device_bytes) is False and _applies(s.stage, method)]
    if refused:
        s = refused[0]
        raise UserInputError(f"{s.stage} needs {M.gib(s.peak)} per device, more than the device's "
                             f"{M.gib(device_bytes)} (largest: {max(s.parts, key=s.parts.get)}); change "
                             f"{' or '.join(s.levers)}")
    return [s.to_dict() for s in stages]


def _applies(stage: str, method: str) -> bool:
    """Whether a stage runs with this scoring ``method`` (the other methods' rows are information)."""
    return not stage.startswith("scoring (") or stage == f"scoring ({method})"


def _time_text(s) -> str:
    if s.seconds is not None:
        m = s.seconds / 60
        return (f"{m:,.1f} min" if m < 120 else f"{m / 60:,.1f} h") + " (measured)"
    return f"{s.flops:.2e} FLOPs"
