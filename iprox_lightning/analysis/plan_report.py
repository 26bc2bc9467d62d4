"""``train.py plan``'s work (:func:`run_plan`): the run's settings (:class:`~.memory.RunSettings`) from the command's
options, each stage's peak memory per device and time (:mod:`.memory`) printed as a table, the exact-TracIn-or-store
comparison, with ``fit`` the levers that fit (:mod:`.fit`), and a stage that will not fit refused.
``commands/plan.py`` holds the command's arguments."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import OutputIsDirectoryError, UserInputError
from ..io.jsonfile import write_json
from ..io.output_guard import check_output_not_input
from ..models.loading import check_model_config
from ..scoring.config import ScoringConfig
from . import fit as F
from . import memory as M


_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True)
class PlanSettings:
    """The arguments of one ``python train.py plan``, as :func:`iprox_lightning.commands.plan.plan` received them (its
    signature declares their defaults, its docstring what each means)."""

    model: str
    pool_size: int
    max_length: int
    batch_size: int
    validation_batch_size: Optional[int]
    proxy_validation: str
    align_batch_size: int
    response_share: float
    precision: str
    devices: int
    num_nodes: int
    strategy: str
    accelerator: str
    device_memory: Optional[str]
    gradient_checkpointing: bool
    micro_batch_size: Optional[int]
    fsdp_cpu_offload: bool
    store_gradient_checkpointing: bool
    sparsity: float
    num_probe_tokens: int
    probe_group_layers: Optional[int]
    align_epochs: int
    align_checkpointing: bool
    align_micro_batch_size: Optional[int]
    align_reshard_proxy: bool
    validation_examples: int
    tasks: int
    k: int
    select_k: int
    warmup_epochs: int
    finetune_epochs: int
    speed_results: Optional[str]
    output: Optional[str]
    lora: Optional[dict]
    checkpoints: int
    checkpoints_in_turn: bool
    fit: bool
    scoring: ScoringConfig


def run_plan(p: PlanSettings, defaults: dict) -> list[dict]:
    """Print the plan of ``p`` (and with ``p.fit`` the fit), write it to ``p.output`` when given; returns the stages
    (with ``fit``: the fitted stages). ``defaults``: the command's options and their defaults (``--fit`` prints the
    flags set to another value)."""
    method = p.scoring.method  # any registered metric: its class declares its memory (analysis/memory.py)
    if p.output:
        _check_output(p.output, p.model, p.speed_results)
    device_bytes = M.parse_bytes(p.device_memory) if p.device_memory is not None else None
    if p.fit and device_bytes is None:
        raise UserInputError("--fit true needs --device_memory (e.g. 80GB): the memory the stages must fit in")
    if p.devices < 1 or p.num_nodes < 1:
        raise UserInputError(f"devices and num_nodes must be >= 1, got {p.devices} and {p.num_nodes}")
    if p.model not in M.NAMED_SHAPES:  # sizes read from a file bounded before a config or meta model is built
        check_model_config(p.model)
    lora = M.with_lora_targets(p.lora, p.model) if p.lora is not None else None
    run = M.RunSettings(pool_size=p.pool_size, max_length=p.max_length, batch_size=p.batch_size,
                        validation_batch_size=p.validation_batch_size, proxy_validation=p.proxy_validation,
                        align_batch_size=p.align_batch_size, response_share=p.response_share, precision=p.precision,
                        devices=p.devices * p.num_nodes, strategy=p.strategy, device_kind=p.accelerator,
                        gradient_checkpointing=p.gradient_checkpointing, micro_batch_size=p.micro_batch_size,
                        fsdp_cpu_offload=p.fsdp_cpu_offload,
                        store_gradient_checkpointing=p.store_gradient_checkpointing, sparsity=p.sparsity,
                        num_probe_tokens=p.num_probe_tokens, probe_group_layers=p.probe_group_layers,
                        align_epochs=p.align_epochs, align_checkpointing=p.align_checkpointing,
                        align_micro_batch_size=p.align_micro_batch_size, align_reshard_proxy=p.align_reshard_proxy,
                        validation_examples=p.validation_examples, tasks=p.tasks, method=method,
                        kfac_examples=p.scoring.kfac_examples, kfac_dtype=p.scoring.kfac_dtype,
                        kfac_partitions=p.scoring.kfac_partitions, kfac_offload=p.scoring.kfac_offload, store_k=p.k,
                        select_k=p.select_k, warmup_epochs=p.warmup_epochs, finetune_epochs=p.finetune_epochs,
                        validation_gradients=p.scoring.validation_gradients,
                        shard_layers=p.scoring.shard_layers, checkpoints=p.checkpoints,
                        checkpoints_in_turn=p.checkpoints_in_turn, lora=lora)
    sizes, acts, acts32 = M.model_counts(p.model, run)  # cached per architecture, T and precision
    stages = M.plan_stages(sizes, None, run, acts=acts, acts32=acts32)
    speeds = M.measured_throughput(sizes.params, p.accelerator, p.speed_results or _RESULTS)
    M.attach_times(stages, sizes, run, speeds)

    trained = f"{sizes.trainable / 1e6:,.0f}M"
    if run.lora:
        t = run.lora["target_modules"]
        trained = (f"LoRA r {run.lora['r']} on {', '.join(t) if isinstance(t, list) else t}: "
                   f"{M.lora_params(sizes, run.lora) / 1e6:,.1f}M")
    print(f"plan: {p.model} — {sizes.params / 1e6:,.0f}M parameters ({trained} trained in warm-up), "
          f"{p.precision}, {run.devices} {p.accelerator} device(s), {p.strategy}; T = {p.max_length}, "
          f"batch {p.batch_size} "
          + (f"(validation {p.validation_batch_size}, " if p.validation_batch_size else "(")
          + f"build_proxy {p.align_batch_size}), pool {p.pool_size}"
          + ("; the proxy scored against its own validation gradients" if p.proxy_validation == "proxy" else ""))
    if device_bytes is None:
        print(f"device memory: not given (--device_memory, e.g. 80GB): assumed {run.devices} {p.accelerator} "
              "device(s) of any size, so the fits column is not checked (-)")
    else:
        print(f"device memory: {p.device_memory} = {M.gib(device_bytes)} per device (GB = 10^9 bytes, GiB = 2^30 "
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
    print(f"exact TracIn or the store: {p.tasks} columns' dense validation gradients are {M.gib(dense['float32'])} "
          f"(float32), {M.gib(dense['bfloat16'])} (bfloat16); "
          + {"store": "the store is better: ", "exact": "exact TracIn is better: "}.get(versus["better"], "")
          + versus["why"]
          + (f"; fewest column groups that fit: {versus['fewest_column_groups']}"
             if versus.get("fewest_column_groups") else ""))
    fitted = _fit(sizes, acts, acts32, run, device_bytes, p, defaults) if p.fit else None
    if p.output:
        write_json(p.output, {"model": p.model, "params": sizes.params, "device_memory": device_bytes,
                              "settings": {k: getattr(run, k) for k in run.__dataclass_fields__},
                              "stages": [s.to_dict() for s in stages], "tracin_or_store": versus,
                              **({"fit": fitted[0]} if p.fit else {})}, indent=1)
    if p.fit:
        if fitted[1] is not None:
            raise fitted[1]
        return fitted[0]["stages"]
    refused = [s for s in stages if s.fits(device_bytes) is False and _applies(s.stage, method)]
    if refused:
        s = refused[0]
        raise UserInputError(f"{s.stage} needs {M.gib(s.peak)} per device, more than the device's "
                             f"{M.gib(device_bytes)} ({p.device_memory}; largest: {max(s.parts, key=s.parts.get)}); "
                             f"change {' or '.join(_advice(s.levers, run))}")
    return [s.to_dict() for s in stages]


def _fit(sizes, acts, acts32, run, device_bytes, p: PlanSettings, defaults: dict):
    """``plan --fit``: print the fit (:mod:`iprox_lightning.analysis.fit`) -> ``(its JSON, the error of the first
    applied stage that fits at no setting, or None)``; ``defaults``: the command's options and their defaults (the
    flags printed are the ones set to another value)."""
    report = F.fit_report(sizes, acts, acts32, run, device_bytes, model=p.model)
    # the command's own settings that differ from plan's defaults (the levers are the fit's; --batch_size the fit's
    # smallest where it needs one)
    skip = set(F.LEVERS_OFF) | {"fit", "output", "speed_results", "scoring", "model"}
    if "--batch_size" in report["overlay"]["plan"]:
        skip.add("batch_size")
    flags = ["--model", p.model]
    for k, default in defaults.items():  # the scoring fields' values are the config's
        v = getattr(p, k) if hasattr(p, k) else getattr(p.scoring, k, default)
        if k not in skip and v != default:
            flags += [f"--{k}", json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else str(v)]
    print("\n".join(F.report_lines(report, device_bytes, run.method, flags)))
    out = {"device_memory": device_bytes, "stages": [f.to_dict(device_bytes) for f in report["stages"]],
           "tracin": report["tracin"], "overlay": report["overlay"]}
    failed = [f for f in report["stages"] if not f.fits and F.applies(f.stage, run.method)]
    error = None
    if failed:
        f = failed[0]
        error = UserInputError(f"{f.stage} fits {F.size(device_bytes)} ({p.device_memory}) at no setting the fit "
                               f"tries: {F.reason(f, device_bytes)}; nearest: {'; '.join(f.levers) or 'no lever'}")
    return out, error


def _check_output(output: str, model: str, speed_results: Optional[str]) -> None:
    """Refuse an ``--output`` that is a directory, or is (or lies inside) the model read, or is one of the speed
    results read (a plan beside them is fine: only ``speed_*.json`` files are read there)."""
    if Path(output).is_dir():
        raise OutputIsDirectoryError(f"--output {output} is a directory; name a file, e.g. {Path(output) / 'plan.json'}")
    check_output_not_input(output, {"model": model}, "--output")
    if speed_results and Path(output).name.startswith("speed_") and Path(output).suffix == ".json":
        check_output_not_input(output, {"speed results": speed_results}, "--output")


def _applies(stage: str, method: str) -> bool:
    """Whether a stage runs with this scoring ``method`` (the other methods' rows are information)."""
    return F.applies(stage, method)


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
