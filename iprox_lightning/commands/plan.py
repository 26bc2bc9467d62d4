"""Plan a run before it starts: peak memory per device and time of every stage; a stage that will not fit is refused."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..engine.settings import takes_settings
from ..scoring.config import ScoringConfig

_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@takes_settings(ScoringConfig, "scoring", fields=("method", "kfac_examples", "kfac_dtype", "kfac_partitions",
                                                  "kfac_offload", "validation_gradients", "shard_layers"))
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
    micro_batch_size: Optional[int] = None,
    fsdp_cpu_offload: bool = False,
    store_gradient_checkpointing: bool = False,
    sparsity: float = 0.5,
    num_probe_tokens: int = 1024,
    probe_group_layers: Optional[int] = None,
    align_epochs: int = 2,
    align_checkpointing: bool = False,
    align_micro_batch_size: Optional[int] = None,
    validation_examples: int = 300,
    tasks: int = 3,
    k: int = 16,
    select_k: int = 800,
    speed_results: Optional[str] = None,
    output: Optional[str] = None,
    lora: Optional[dict] = None,
    checkpoints: int = 1,
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
        validation_examples: validation examples scored for the validation gradients.
        tasks: score columns: validation tasks, or subtasks with validation_subtasks (scoring keeps one float32
            gradient per column, held as ``validation_gradients`` says; the pipeline at the paper's sizes has 93).
        k: a gradient store's projection rows per side (build_store k).
        select_k: examples the fine-tune trains on.
        speed_results: directory of bench/speed.py's speed_*.json (default: the repository's bench/results).
        output: also write the plan as JSON to this file.
        lora: LoRA warm-up and fine-tune (``{r, alpha, dropout, target_modules}``, the modules' ``lora``): the base
            weights frozen (no gradients, no AdamW state), the adapters trained.
        checkpoints: scoring checkpoints summed (the scoring module's ``checkpoints``; LESS: 4): each checkpoint's
            model (an adapter with its own base), metric state and validation gradients are held while the pool is
            scored. ``method: less`` needs ``lora`` (it scores the adapters' gradients).
        fit: also find, per stage, the largest per-device batch and the fewest memory levers (micro-batches,
            checkpointing, probe groups, the validation gradients' holding, K-FAC partitions and offload) that fit
            ``device_memory`` (:mod:`iprox_lightning.analysis.fit`: an ordered search priced by this plan), and print
            them as the overlay ``pipeline --plan`` and each stage command take; the levers given here are replaced
            by the search. A stage that fits at no setting stops the command after the print, naming the reason and
            the nearest setting.
    """
    from ..analysis import memory as M
    from ..errors import UserInputError

    method = scoring.method  # any registered metric: its class declares its memory (analysis/memory.py)
    if output:
        _check_output(output, model, speed_results)
    device_bytes = M.parse_bytes(device_memory) if device_memory is not None else None
    if fit and device_bytes is None:
        raise UserInputError("--fit true needs --device_memory (e.g. 80GB): the memory the stages must fit in")
    if devices < 1 or num_nodes < 1:
        raise UserInputError(f"devices and num_nodes must be >= 1, got {devices} and {num_nodes}")
    from ..models.loading import check_model_config

    if model not in M.NAMED_SHAPES:  # sizes read from a file bounded before a config or meta model is built
        check_model_config(model)
    if lora is not None:
        lora = M.with_lora_targets(lora, model)
    run = M.RunSettings(pool_size=pool_size, max_length=max_length, batch_size=batch_size,
                        align_batch_size=align_batch_size, response_share=response_share, precision=precision,
                        devices=devices * num_nodes, strategy=strategy, device_kind=accelerator,
                        gradient_checkpointing=gradient_checkpointing, micro_batch_size=micro_batch_size,
                        fsdp_cpu_offload=fsdp_cpu_offload, store_gradient_checkpointing=store_gradient_checkpointing,
                        sparsity=sparsity,
                        num_probe_tokens=num_probe_tokens, probe_group_layers=probe_group_layers,
                        align_epochs=align_epochs, align_checkpointing=align_checkpointing,
                        align_micro_batch_size=align_micro_batch_size,
                        validation_examples=validation_examples, tasks=tasks, method=method,
                        kfac_examples=scoring.kfac_examples, kfac_dtype=scoring.kfac_dtype,
                        kfac_partitions=scoring.kfac_partitions, kfac_offload=scoring.kfac_offload, store_k=k,
                        select_k=select_k, validation_gradients=scoring.validation_gradients,
                        shard_layers=scoring.shard_layers, checkpoints=checkpoints, lora=lora)
    sizes, acts, acts32 = M.model_counts(model, run)  # cached per architecture, T and precision
    stages = M.plan_stages(sizes, None, run, acts=acts, acts32=acts32)
    speeds = M.measured_throughput(sizes.params, accelerator, speed_results or _RESULTS)
    M.attach_times(stages, sizes, run, speeds)

    trained = f"{sizes.trainable / 1e6:,.0f}M"
    if run.lora:
        t = run.lora["target_modules"]
        trained = (f"LoRA r {run.lora['r']} on {', '.join(t) if isinstance(t, list) else t}: "
                   f"{M.lora_params(sizes, run.lora) / 1e6:,.1f}M")
    print(f"plan: {model} — {sizes.params / 1e6:,.0f}M parameters ({trained} trained in warm-up), "
          f"{precision}, {run.devices} {accelerator} device(s), {strategy}; T = {max_length}, batch {batch_size} "
          f"(build_proxy {align_batch_size}), pool {pool_size}")
    if device_bytes is None:
        print(f"device memory: not given (--device_memory, e.g. 80GB): assumed {run.devices} {accelerator} device(s) "
              "of any size, so the fits column is not checked (-)")
    else:
        print(f"device memory: {device_memory} = {M.gib(device_bytes)} per device (GB = 10^9 bytes, GiB = 2^30 "
              "bytes; the peaks below are in GiB)")
    rows = [("stage", "peak/device", "fits", "time", "largest parts")]
    for s in stages:
        fits = s.fits(device_bytes)
        parts = ", ".join(f"{k} {v / M.GIB:.1f}" for k, v in sorted(s.parts.items(), key=lambda kv: -kv[1])[:3])
        when = _time_text(s)
        rows.append((s.stage, M.gib(s.peak), "-" if fits is None else ("yes" if fits else "NO"), when, parts + " GiB"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    versus = M.tracin_or_store(sizes, acts, run, device_bytes)
    dense = versus["dense_validation_gradients"]
    print(f"exact TracIn or the store: {tasks} columns' dense validation gradients are {M.gib(dense['float32'])} "
          f"(float32), {M.gib(dense['bfloat16'])} (bfloat16); "
          + {"store": "the store is better: ", "exact": "exact TracIn is better: "}.get(versus["better"], "")
          + versus["why"]
          + (f"; fewest column groups that fit: {versus['fewest_column_groups']}"
             if versus.get("fewest_column_groups") else ""))
    fitted = _fit(sizes, acts, acts32, run, device_bytes, locals()) if fit else None
    if output:
        from ..io.jsonfile import write_json

        write_json(output, {"model": model, "params": sizes.params, "device_memory": device_bytes,
                            "settings": {k: getattr(run, k) for k in run.__dataclass_fields__},
                            "stages": [s.to_dict() for s in stages], "tracin_or_store": versus,
                            **({"fit": fitted[0]} if fit else {})}, indent=1)
    if fit:
        if fitted[1] is not None:
            raise fitted[1]
        return fitted[0]["stages"]
    refused = [s for s in stages if s.fits(device_bytes) is False and _applies(s.stage, method)]
    if refused:
        s = refused[0]
        raise UserInputError(f"{s.stage} needs {M.gib(s.peak)} per device, more than the device's "
                             f"{M.gib(device_bytes)} ({device_memory}; largest: {max(s.parts, key=s.parts.get)}); "
                             f"change {' or '.join(_advice(s.levers, run))}")
    return [s.to_dict() for s in stages]


def _fit(sizes, acts, acts32, run, device_bytes, args: dict):
    """``plan --fit``: print the fit (:mod:`iprox_lightning.analysis.fit`) -> ``(its JSON, the error of the first
    applied stage that fits at no setting, or None)``."""
    import inspect

    from ..analysis import fit as F
    from ..errors import UserInputError

    report = F.fit_report(sizes, acts, acts32, run, device_bytes, model=args["model"])
    import json

    # the command's own settings that differ from plan's defaults (the levers are the fit's; --batch_size the fit's
    # smallest where it needs one)
    skip = set(F.LEVERS_OFF) | {"fit", "output", "speed_results", "scoring", "model"}
    if "--batch_size" in report["overlay"]["plan"]:
        skip.add("batch_size")
    flags = ["--model", args["model"]]
    for k, p in inspect.signature(plan).parameters.items():  # the scoring fields' values are the config's
        v = args[k] if k in args else getattr(args["scoring"], k, p.default)
        if k not in skip and v != p.default:
            flags += [f"--{k}", json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else str(v)]
    print("\n".join(F.report_lines(report, device_bytes, run.method, flags)))
    out = {"device_memory": device_bytes, "stages": [f.to_dict(device_bytes) for f in report["stages"]],
           "tracin": report["tracin"], "overlay": report["overlay"]}
    failed = [f for f in report["stages"] if not f.fits and F.applies(f.stage, run.method)]
    error = None
    if failed:
        f = failed[0]
        error = UserInputError(f"{f.stage} fits {F.size(device_bytes)} ({args['device_memory']}) at no setting the fit "
                               f"tries: {F.reason(f, device_bytes)}; nearest: {'; '.join(f.levers) or 'no lever'}")
    return out, error


def _check_output(output: str, model: str, speed_results: Optional[str]) -> None:
    """Refuse an ``--output`` that is a directory, or is (or lies inside) the model read, or is one of the speed
    results read (a plan beside them is fine: only ``speed_*.json`` files are read there)."""
    from ..errors import OutputIsDirectoryError
    from ..io.output_guard import check_output_not_input

    if Path(output).is_dir():
        raise OutputIsDirectoryError(f"--output {output} is a directory; name a file, e.g. {Path(output) / 'plan.json'}")
    check_output_not_input(output, {"model": model}, "--output")
    if speed_results and Path(output).name.startswith("speed_") and Path(output).suffix == ".json":
        check_output_not_input(output, {"speed results": speed_results}, "--output")


def _applies(stage: str, method: str) -> bool:
    """Whether a stage runs with this scoring ``method`` (the other methods' rows are information)."""
    from ..analysis.fit import applies  # lazy: --help

    return applies(stage, method)


# a setting a lever names that the run may use already: (the words, whether the run uses it, what to say instead:
# None drops the alternative)
_IN_USE = (
    ("strategy fsdp over more devices", lambda r: r.strategy == "fsdp",
     lambda r: f"more devices (fsdp over {r.devices} now)"),
    ("strategy fsdp (DDP keeps a second copy of the gradients)", lambda r: r.strategy == "fsdp", None),
    ("precision bf16-true", lambda r: r.precision == "bf16-true", None),
    ("activation checkpointing (model.gradient_checkpointing)", lambda r: r.gradient_checkpointing, None),
    ("model.micro_batch_size", lambda r: r.micro_batch_size == 1, None),
    ("build_store gradient_checkpointing", lambda r: r.store_gradient_checkpointing, None),
)


def _advice(levers: list[str], run) -> list[str]:
    """The stage's levers without a setting the run already uses (its ``, or`` alternatives filtered); a lever left
    with nothing is dropped."""
    out = []
    for lever in levers:
        alts = []
        for alt in lever.split(", or "):
            for words, used, instead in _IN_USE:
                if alt.startswith(words) and used(run):
                    alt = instead(run) if instead else None
                    break
            if alt and alt not in alts:
                alts.append(alt)
        if alts:
            out.append(", or ".join(alts))
    return out or ["to a device with more memory"]


def _time_text(s) -> str:
    if s.seconds is not None:
        m = s.seconds / 60
        t = f"{s.seconds:,.0f} s" if m < 2 else (f"{m:,.1f} min" if m < 120 else f"{m / 60:,.1f} h")
        return t + (" (measured rate)" if s.time_source.startswith("measured") else " (FLOPs at a measured rate)")
    return f"{s.flops:.2e} FLOPs (no measured throughput)"
