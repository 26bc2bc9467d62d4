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
"""
from __future__ import annotations

import contextlib

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from ..errors import (PROXY_VALIDATIONS, InputNotFoundError, OutputNotDirectoryError, UserError, UserInputError,
                      check_choice)
from ..progress import activity, touch

log = logging.getLogger(__name__)

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _write_overlay(path: Path, content: dict) -> Path:
    from ..io.atomic import write_text_atomic

    return write_text_atomic(path, yaml.safe_dump(content, sort_keys=False))


def _count_params(path: str) -> int:
    from ..models.loading import load_model
    from ..engine.target_layers import count_parameters

    model, _ = load_model(path, tokenizer=False)
    return count_parameters(model)


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
    import torch

    from ..selection.select import select
    from .lightning import run_lightning

    if num_threads is None and target == "builtin":
        num_threads = 1
    if num_threads:
        torch.set_num_threads(num_threads)

    wd = Path(workdir)
    check_arguments(wd, sparsity, select_fraction, method, select_rule, eval_per_task, proxy_validation)
    hardware = trainer_hardware(accelerator, devices, num_nodes, strategy, precision)
    check_sources(target, pool, validation)
    from ..models.lora import LoraSettings

    lora_settings = LoraSettings.of(lora)  # refused before any stage
    lora = lora_settings.to_dict() if lora_settings is not None else None
    plan_overlays = stage_plan(plan, device_memory, target=target, hardware=hardware, config_dir=config_dir,
                               demo=(pool == "builtin") if demo_overlays is None else demo_overlays,
                               data_args=data_args, sparsity=sparsity, align_epochs=align_epochs, method=method,
                               lora=lora, validation=validation)
    from ..io.output_guard import check_output_not_input
    from ..io.ownership import make_owned_dir
    from ..io.score_dir import ScoreDirLock

    check_output_not_input(wd, {"pool": pool, "target": target, "validation": validation}, "--workdir")
    make_owned_dir(wd, "pipeline workdir")
    # SIGTERM stops the run with the CLI's one 'stopped' line, the lock released and removed on the way out
    with _SIGTERM, ScoreDirLock(wd, ".pipeline.lock", "pipeline run", "use another --workdir", remove=True), \
            activity(f"pipeline {wd}"):  # between and inside stages, a line at least every interval
        return _pipeline(wd, target=target, pool=pool, validation=validation, sparsity=sparsity,
                         select_fraction=select_fraction, select_rule=select_rule, method=method,
                         config_dir=config_dir, demo_overlays=demo_overlays, hardware=hardware, threads=num_threads,
                         finetune=finetune, force=force, seed=seed, data_args=data_args, align_epochs=align_epochs,
                         eval_per_task=eval_per_task, run_lightning=run_lightning, select=select,
                         proxy_validation=proxy_validation, lora=lora, plan_overlays=plan_overlays)


def check_arguments(wd: Path, sparsity: float, select_fraction: float, method: str, select_rule: str = "balanced",
                    eval_per_task: int | None = None, proxy_validation: str = "target") -> None:
    """Refuse at once the arguments a late stage would refuse (after warm-up and proxy building ran)."""
    if wd.exists() and not wd.is_dir():
        raise OutputNotDirectoryError(f"workdir {wd} is a file, not a directory")
    if isinstance(sparsity, bool) or not 0.0 <= sparsity < 1.0:
        raise UserInputError(f"sparsity must be in [0, 1), got {sparsity}")
    if isinstance(select_fraction, bool) or not 0.0 < select_fraction <= 1.0:
        raise UserInputError(f"select_fraction must be a fraction in (0, 1], got {select_fraction}")
    from ..selection.rules import RULES

    if select_rule not in RULES:
        raise UserInputError(f"select_rule: unknown selection rule {select_rule!r}; rules: {', '.join(RULES)}")
    check_choice("proxy_validation", proxy_validation, PROXY_VALIDATIONS)
    if eval_per_task is not None and (isinstance(eval_per_task, bool) or eval_per_task < 1):
        raise UserInputError(f"eval_per_task must be >= 1 or null (every validation example), got {eval_per_task}")
    from ..scoring.config import ScoringConfig

    try:
        config = ScoringConfig(method=method)
    except ValueError as e:
        raise UserInputError(f"method: {e}") from None
    if getattr(config.metric_class(), "needs_optimizer_state", False):
        raise UserInputError(f"method: {method} scores a LoRA checkpoint's adapter gradients with its Adam moments, "
                             "which the pipeline's dense target and proxy do not have: run LESS with configs/less/ "
                             "(docs/GUIDE.md, 'LoRA: adapter gradients and LESS')")


def trainer_hardware(accelerator: str, devices: int, num_nodes: int | None, strategy: str | None,
                     precision: str | None) -> dict[str, Any]:
    """The Trainer settings every stage's overlay gets: ``accelerator`` and ``devices`` always, ``num_nodes``,
    ``strategy`` and ``precision`` when given (else the stage configs' own); a bad value is refused before any stage
    runs."""
    from lightning.pytorch.strategies import StrategyRegistry

    from ..engine.precision import check_precision

    for name, value in (("devices", devices), ("num_nodes", num_nodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserInputError(f"{name} must be a positive integer, got {value!r}")
    strategies = ["auto", *sorted(StrategyRegistry.available_strategies())]
    if strategy is not None and strategy not in strategies and "." not in str(strategy):
        raise UserInputError(f"strategy: unknown strategy {strategy!r}; give one of {', '.join(strategies)} or a "
                             "strategy class path (e.g. lightning.pytorch.strategies.ModelParallelStrategy)")
    check_precision(precision, "pipeline")  # the precisions every stage supports (engine/precision.py)
    check_strategy_hardware(strategy, accelerator, devices)
    out: dict[str, Any] = {"accelerator": accelerator, "devices": devices}
    if num_nodes is not None:
        out["num_nodes"] = num_nodes
    if strategy is not None:
        out["strategy"] = {"class_path": strategy} if "." in strategy else strategy
    if precision is not None:
        out["precision"] = str(precision)
    return out


GPU_STRATEGIES = ("fsdp", "deepspeed")
"""Strategies (their names and class paths contain these) that run on CUDA devices only."""


def check_strategy_hardware(strategy: str | None, accelerator: str, devices: int) -> None:
    """Refuse before any stage a strategy the machine cannot run: FSDP or DeepSpeed without a CUDA device (or with
    ``--accelerator cpu``), more ``--devices`` than the CUDA devices there are, DeepSpeed without its package
    (before: Lightning's error inside the first stage, or inside a stage's own process)."""
    import importlib.util

    import torch

    kind = next((k for k in GPU_STRATEGIES if strategy is not None and k in str(strategy).lower()), None)
    if kind is None:
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise UserInputError(f"strategy {strategy!r} runs on CUDA devices only, and this machine has none: use "
                             "--strategy ddp (or leave --strategy out) on CPUs")
    if str(accelerator).lower() == "cpu":
        raise UserInputError(f"strategy {strategy!r} runs on CUDA devices only, and the accelerator is cpu (the "
                             "default): pass --accelerator gpu, or --strategy ddp to run on CPUs")
    if isinstance(devices, int) and devices > gpus:
        raise UserInputError(f"strategy {strategy!r} with --devices {devices}: this machine has {gpus} CUDA "
                             f"device(s); pass --devices {gpus} or fewer")
    if kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise UserInputError(f"strategy {strategy!r} needs the deepspeed package, which is not installed "
                             "(pip install deepspeed), or use --strategy fsdp / ddp")


class _SigtermStop:
    """SIGTERM during a pipeline run stops it as SIGTERM within a stage does: ``train.py`` prints its one ``stopped``
    line and exits 143 (before, a SIGTERM between two stages killed the process with no line).

    Inside a stage run in this process Lightning's own handler is installed (it calls this one too): the stage stops at
    its next safe point and raises ``SIGTERMException``; one that ends anyway is recorded and the run stops after it.
    Anywhere else (between stages, loading a stage's model, saving its output) the run stops at once, as Ctrl-C does:
    every artifact is written to a temporary and renamed, and a stage stopped before its record is redone by the next
    run (:meth:`~iprox_lightning.io.stages.StageLedger.start`). A stage in its own processes gets the signal passed on
    and stops at its safe point; the run stops when it has."""

    def __init__(self) -> None:
        self.pending = False
        self.child = None  # the stage process running now (several devices), if any
        self._previous = None
        self._installed = False

    def _handler(self, signum, frame) -> None:
        import signal

        self.pending = True
        if self.child is not None:
            self.child.send_signal(signum)
        elif signal.getsignal(signal.SIGTERM) == self._handler:  # no Lightning run is stopping at its safe point
            self.stop()

    def stop(self) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException()

    def check(self) -> None:
        """Stop now if a SIGTERM came while a stage ran to its end."""
        if self.pending:
            self.stop()

    def __enter__(self):
        import signal

        self.pending, self.child = False, None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self._installed = True
        except ValueError:  # not the main thread: no handler of ours
            self._installed = False
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


_SIGTERM = _SigtermStop()


def _processes(trainer: dict[str, Any]) -> int:
    return int(trainer.get("devices") or 1) * int(trainer.get("num_nodes") or 1)


def _run_stage_process(args: list[str], log_file: Path, threads: int | None) -> None:
    """``python -m iprox_lightning.cli <args>`` in its own process (Lightning's launcher starts the other ranks from
    it), its output into ``log_file``; a stage's one-line user error is raised as one, any other failure with the end
    of the output."""
    import os
    import subprocess
    import sys

    import iprox_lightning

    root = str(Path(iprox_lightning.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "iprox_lightning.cli", *args], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
        _SIGTERM.child = child  # a SIGTERM is passed on: the stage stops at its safe point
        try:
            code = child.wait()
        finally:
            _SIGTERM.child = None
    _SIGTERM.check()  # the stage was stopped by (or ran to its end despite) a SIGTERM: stop here
    if code == 0:
        return
    lines = log_file.read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    if code == 2 and errors:
        raise UserInputError(f"{errors[-1][len('error: '):]} (stage output: {log_file})")
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    raise StageProcessFailed(f"stage failed (exit {code}): python -m iprox_lightning.cli {' '.join(args)}; its last "
                             f"line: {last[:500]} (its whole output, the traceback included: {log_file})")


class StageProcessFailed(UserError, RuntimeError):
    """A stage run in its own processes failed: one line with its last line of output and the log holding the rest
    (the stage's own traceback is in the log; the pipeline's would say nothing more)."""


def check_sources(target: str, pool, validation) -> None:
    """Refuse at once a hub id that is neither cached nor reachable (before: the warm-up started, then a traceback)."""
    from ..data.sources import is_hub_dataset, parse_hub_id
    from ..models.hub import check_dataset_source, check_model_source

    if isinstance(target, str):
        check_model_source(target, "target model")
    for what, src in (("pool", pool), ("validation", validation)):
        for s in ([src] if isinstance(src, str) else list(src or []) if isinstance(src, (list, tuple)) else []):
            if isinstance(s, str) and s != "builtin" and not s.startswith("eval:") and is_hub_dataset(s):
                check_dataset_source(parse_hub_id(s)[0], f"{what} {s!r}: data set")


def _pipeline(wd: Path, *, target, pool, validation, sparsity, select_fraction, select_rule, method, config_dir,
              demo_overlays, hardware, finetune, force, seed, data_args, align_epochs, eval_per_task,
              run_lightning, select, proxy_validation="target", threads=None, lora=None,
              plan_overlays=None) -> dict[str, Any]:
    """The stages of :func:`pipeline`, run while its workdir lock is held: the stage table of ``ARCHITECTURE.md`` in
    order, one step each."""
    stages = _stage_runner(wd, config_dir, (pool == "builtin") if demo_overlays is None else demo_overlays, force,
                           {"target": target, "pool": pool, "validation": validation}, hardware,
                           run_lightning, threads, plan_overlays)
    data_args = {"pool": pool, "validation": validation, "seed": seed, **(data_args or {})}
    warm = _warm_up(stages, target, data_args, seed, lora)
    proxy = _build_proxy(stages, warm, data_args, seed, sparsity, align_epochs)
    score_dirs = _score_pool(stages, warm, proxy, data_args, seed, method, proxy_validation)
    scores, tasks, selected = _select_subsets(stages, score_dirs, pool, data_args, seed, select, select_fraction,
                                              select_rule)
    effect = None
    if finetune:
        effect = _finetune_and_evaluate(stages, warm, selected, tasks, pool, validation, data_args, seed, eval_per_task,
                                        lora)

    # 6. summary --------------------------------------------------------------------------------
    summary = _summary(wd, warm, proxy, scores, selected, stages.times, pool, select_rule if tasks else None, tasks)
    summary["selection_rule"] = {"rule": select_rule, "k": select_fraction, **({"tasks": tasks} if tasks else {})}
    if lora is not None:
        summary["lora"] = lora
    from ..io.stages import pipeline_provenance

    summary.update(pipeline_provenance(stages.ledger, method=method, sparsity=sparsity, score_dirs=score_dirs,
                                       proxy_validation=proxy_validation))
    if effect is not None:
        summary["selection_effect"] = effect
    summary["artifacts"] = _artifacts(wd, finetune, tasks)
    summary["next_command"] = _next_command(wd, warm, proxy, pool, validation, data_args, proxy_validation)
    from ..io.jsonfile import write_json

    write_json(wd / "summary.json", summary)
    print(_format_summary(summary))
    return summary


@dataclass(frozen=True)
class _StageRunner:
    """Runs the stages of one pipeline run (:meth:`run`) and holds what they share: the stage configs, the ledger of
    fingerprints, the seconds per stage (``<workdir>/seconds_per_stage.json``) and the trainer settings."""

    wd: Path
    cfg_dir: Path
    demo: bool
    force: bool
    ledger: Any  # io.stages.StageLedger
    times: dict[str, float]
    run_lightning: Callable
    trainer: dict[str, Any]  # every stage's trainer settings
    fit_trainer: dict[str, Any]  # the training stages'
    logger: dict[str, Any]
    threads: int | None = None  # torch threads of a stage run in its own processes (OMP_NUM_THREADS)
    plan_overlays: dict | None = None  # pipeline --plan: {stage config: overlay merged into the stage's}

    def named_logger(self, name: str) -> dict[str, Any]:
        return {**self.logger, "init_args": {**self.logger["init_args"], "name": name}}

    def run(self, name: str, subcommand: str, overlay: dict, done: Path, tag: str | None = None,
            upstream: tuple = (), files: tuple = ()) -> None:
        """Run stage ``name`` (``python train.py <subcommand>`` with its configs and ``overlay``), or reuse ``done``
        when the stage's fingerprint matches."""
        from ..console import quiet_stage

        ledger, times = self.ledger, self.times
        if self.plan_overlays and name in self.plan_overlays:  # pipeline --plan: the fit's levers for this stage
            from ..analysis.fit import merge_overlay

            overlay = merge_overlay(overlay, self.plan_overlays[name])
        key = f"{name}:{tag}" if tag else name
        configs = [self.cfg_dir / f"{name}.yaml"]
        if self.demo and (self.cfg_dir / "builtin" / f"{name}.yaml").exists():
            configs.append(self.cfg_dir / "builtin" / f"{name}.yaml")
        fp = ledger.prepare(key, configs, overlay, upstream=upstream, files=files)
        output = done if done.name == "scores.parquet" else done.parent  # what downstream stages read
        if ledger.reuse(key, done, output):
            log.info("stage %s: %s exists with fingerprint %s, reused", key, done, fp)
            print(f"[pipeline] {key}: reused ({done}, fingerprint {fp[:12]} matches)")
            if key in ledger.notes:
                print(f"[pipeline] {key}: note: {ledger.notes[key]}")
            return
        if key in ledger.notes:
            print(f"[pipeline] {key}: runs again: {ledger.notes[key]}")
        if done.name == "scores.parquet":  # start the scoring output fresh (force, or an upstream output changed)
            from ..io.score_dir import clear_output

            if self.force or (key in ledger.notes and key not in ledger.partial):  # a partial one resumes its shards
                clear_output(done.parent)
        configs.append(_write_overlay(self.wd / "configs" / f"{key.replace(':', '_')}.yaml", overlay))
        args = [subcommand] + [a for c in configs for a in ("--config", str(c))]
        log.info("stage %s: python train.py %s", key, " ".join(args))
        ledger.start(key)  # a fault from here to its record leaves the stage marked partial: the next run redoes it
        t0 = time.perf_counter()
        with activity(f"{key}: {subcommand} {configs[0].name}"):  # a line at least every interval, loops or not
            if _processes(self.trainer) > 1:  # its own processes: Lightning's launcher re-runs the command it was given
                _run_stage_process(args, self.wd / "logs" / f"{key.replace(':', '_')}.out", self.threads)
            else:
                with quiet_stage(), _device_memory_peak(self.wd / PEAK_MEMORY_FILE, key):  # the one line below
                    self.run_lightning(args)
        ledger.record(key, output)
        _SIGTERM.check()  # a SIGTERM the stage's Lightning run received but ran to its end: stop after its record
        self.took(key, time.perf_counter() - t0)
        print(f"[pipeline] {key}: {subcommand} {configs[0].name}, {times[key]:.1f} s -> {output}", flush=True)
        touch()

    def took(self, key: str, seconds: float) -> None:
        """Record that stage ``key`` took ``seconds`` (in :attr:`times` and ``<workdir>/seconds_per_stage.json``, written
        at once: every stage the summary shows, the last one, ``evaluate``, included)."""
        from ..io.jsonfile import write_json

        self.times[key] = seconds
        write_json(self.wd / "seconds_per_stage.json", self.times)


def _read_numbers(path: Path) -> dict[str, float]:
    """A ``{stage: number}`` record of the workdir (seconds per stage, peak memory), read with its checks; a
    damaged one is refused naming the file (remove it: the numbers are recorded afresh)."""
    from ..io.jsonfile import Fields, read_json

    data = read_json(path, what="the pipeline's numbers per stage", fix="remove it: the numbers are recorded afresh")
    fields = Fields(path)
    for k, v in data.items():
        fields.check(k, v, "number", minimum=0)
    return data


PEAK_MEMORY_FILE = "peak_device_memory_per_stage.json"
"""``{stage: peak bytes allocated on the CUDA device}`` of the stages run in the pipeline's own process on a GPU."""


@contextlib.contextmanager
def _device_memory_peak(path: Path, key: str):
    """Record the stage's peak CUDA memory (``torch.cuda.max_memory_allocated`` since the stage began) in ``path``;
    nothing on a machine without CUDA (a CPU process's peak RSS cannot be told apart per stage)."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        peaks = _read_numbers(path) if path.exists() else {}
        peaks[key] = int(torch.cuda.max_memory_allocated())
        from ..io.jsonfile import write_json

        write_json(path, peaks)


def _stage_runner(wd: Path, config_dir, demo: bool, force: bool, sources: dict, hardware: dict,
                  run_lightning, threads: int | None = None, plan_overlays: dict | None = None) -> _StageRunner:
    """The stage configs (checked), the seconds of earlier runs (none with ``force``), the trainer settings and the
    stage ledger of a pipeline run in ``wd``."""
    cfg_dir = Path(config_dir) if config_dir else DEFAULT_CONFIG_DIR
    if not (cfg_dir / "warmup.yaml").exists():
        raise InputNotFoundError(f"stage configs not found in {cfg_dir} (pass --config_dir)")
    times_path = wd / "seconds_per_stage.json"
    times: dict[str, float] = _read_numbers(times_path) if times_path.exists() and not force else {}
    from ..console import interactive

    # one line per stage (below): no model summary, and progress bars only on a terminal
    # absolute log/root paths: TensorBoard's writer thread opens its events file by the path it was given, later, from
    # whatever the working directory is then (a relative one failed mid-run on SmolLM2: FileNotFoundError)
    trainer_common = {**hardware, "default_root_dir": str(wd.resolve() / "lightning"),
                      "enable_model_summary": False, "enable_progress_bar": interactive()}
    # training stages log every step: a small run (a few batches: a sample, a 5% selection) then logs at all, without
    # Lightning's warning that its batches are fewer than the logging interval
    fit_common = {**trainer_common, "log_every_n_steps": 1}
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(wd.resolve() / "logs")}}

    from ..data.eval_validation import parse_eval_source
    from ..io.stages import StageLedger

    # a stage's output is reused only when its fingerprint (configs, overlay, sources, upstream stages) matches;
    # an eval:<dir>[:suites] validation source is identified by its directory and suites
    for k, v in sources.items():
        if isinstance(v, str) and (parsed := parse_eval_source(v)):
            sources[k] = {"eval": parsed[0], "suites": list(parsed[1])}
    ledger = StageLedger(wd, sources, force=force)
    return _StageRunner(wd, cfg_dir, demo, force, ledger, times, run_lightning, trainer_common, fit_common, logger,
                        threads, plan_overlays)


def _warm_up(stages: _StageRunner, target, data_args: dict, seed: int, lora: dict | None = None) -> Path:
    """1. warm-up: the target fine-tuned on the warm-up split -> ``<workdir>/warmup/model`` (with ``lora``: the merged
    dense model, its adapters in ``adapters/``)."""
    warm = stages.wd / "warmup" / "model"
    stages.run("warmup", "fit", {
        "seed_everything": seed,
        "trainer": {**stages.fit_trainer, "logger": stages.named_logger("warmup")},
        "model": {"init_args": {"model": target, "save_dir": str(warm), **_lora_args(lora)}},
        "data": {"init_args": {**data_args, "tokenizer": target, "train_split": "warmup"}},
    }, warm / "config.json")
    return warm


def _lora_args(lora: dict | None) -> dict:
    """The training modules' ``lora`` option: absent without LoRA (the stage configs, and so the fingerprints of a run
    without it, stay as they were)."""
    return {} if lora is None else {"lora": lora}


def _build_proxy(stages: _StageRunner, warm: Path, data_args: dict, seed: int, sparsity: float,
                 align_epochs: int | None) -> Path:
    """2. build the proxy (IPSVD callback + alignment) from the warmed-up target -> ``<workdir>/proxy/model``."""
    proxy = stages.wd / "proxy" / "model"
    stages.run("build_proxy", "fit", {
        "seed_everything": seed,
        "trainer": {**stages.fit_trainer, **({"max_epochs": align_epochs} if align_epochs is not None else {}),
                    "logger": stages.named_logger("build_proxy"),
                    "callbacks": [{"class_path": "iprox_lightning.callbacks.IPSVDCallback",
                                   "init_args": {"sparsity": sparsity, "method": "ipsvd"}}]},
        "model": {"init_args": {"target": str(warm), "save_dir": str(proxy)}},
        "data": {"init_args": {**data_args, "tokenizer": str(warm), "train_split": "align"}},
    }, proxy / "iprox_proxy.json", upstream=("warmup",))
    return proxy


def _score_pool(stages: _StageRunner, warm: Path, proxy: Path, data_args: dict, seed: int,
                method: str, proxy_validation: str = "target") -> dict[str, Path]:
    """3. score the pool with the target (reference) and the proxy (against the target's validation gradients unless
    ``proxy_validation`` is ``proxy``) -> ``{who: <workdir>/scores/<who>}``."""
    score_dirs = {}
    for who, model_dir in (("target", warm), ("proxy", proxy)):
        out = stages.wd / "scores" / who
        score_dirs[who] = out
        model = {"model": str(model_dir), "method": method}
        if who == "proxy" and proxy_validation == "target":
            model["validation_model"] = str(warm)
        stages.run("score", "predict", {
            "seed_everything": seed,
            "trainer": {**stages.trainer, "callbacks": [{"class_path": "iprox_lightning.scoring.InfluenceWriter",
                                                         "init_args": {"output_dir": str(out)}}],
                        "logger": stages.named_logger(f"score_{who}")},
            "model": {"init_args": model},
            "data": {"init_args": {**data_args, "tokenizer": str(warm)}},
        }, out / "scores.parquet", tag=who, upstream=("warmup", "build_proxy") if who == "proxy" else ("warmup",))
    return score_dirs


def _select_subsets(stages: _StageRunner, score_dirs: dict[str, Path], pool, data_args: dict, seed: int, select,
                    select_fraction: float, select_rule: str):
    """4. select: target, proxy, random (a per-task rule: target and proxy once per validation task) ->
    ``(scores, tasks, {name: <workdir>/selected/<name>.jsonl})``."""
    from ..io.scores import read_scores
    from ..baselines.random_selection import write_random_scores

    wd, times = stages.wd, stages.times
    scores = {who: read_scores(d / "scores.parquet") for who, d in score_dirs.items()}
    rand_path = wd / "scores" / "random" / "scores.parquet"
    from ..io.ownership import make_owned_dir

    make_owned_dir(rand_path.parent, "scores")
    write_random_scores(sorted(scores["target"]), rand_path, seed=seed)  # cheap: always from this run's pool
    scores["random"] = read_scores(rand_path)
    tasks = selection_tasks(score_dirs["target"] / "scores.parquet", select_rule)
    selected = {}
    t0 = time.perf_counter()
    for who in ("target", "proxy", "random"):
        src = rand_path if who == "random" else score_dirs[who] / "scores.parquet"
        for task in tasks if tasks and who != "random" else [None]:
            name = who if task is None else f"{who}.{task}"
            selected[name] = Path(select(str(src), k=select_fraction, rule="pooled" if who == "random" else select_rule,
                                         task=task, pool=pool, quiet=True, builtin_size=data_args.get("builtin_size"),
                                         output=str(wd / "selected" / f"{name}.jsonl")))
    stages.took("select", time.perf_counter() - t0)
    per = f", one subset per task ({', '.join(tasks)}; random: one for all)" if tasks else ""
    print(f"[pipeline] select: top {select_fraction:g} by the target's, the proxy's and random scores{per}, "
          f"{times['select']:.1f} s -> {wd / 'selected'}", flush=True)
    return scores, tasks, selected


def _finetune_and_evaluate(stages: _StageRunner, warm: Path, selected: dict[str, Path], tasks: list[str], pool,
                           validation, data_args: dict, seed: int, eval_per_task: int | None,
                           lora: dict | None = None) -> dict[str, Any]:
    """5. fine-tune the warmed-up target on each selection, evaluate each on held-out examples -> the effect."""
    from ..console import quiet_stage

    wd, times = stages.wd, stages.times
    for name in sorted(selected, key=lambda n: (("proxy", "target", "random").index(n.split(".")[0]), n)):
        ft = wd / "finetune" / name / "model"
        stages.run("finetune", "fit", {
            "seed_everything": seed,
            "trainer": {**stages.fit_trainer, "logger": stages.named_logger(f"finetune_{name}")},
            "model": {"init_args": {"model": str(warm), "save_dir": str(ft), **_lora_args(lora)}},
            "data": {"init_args": {**data_args, "tokenizer": str(warm), "train_split": "selected",
                                   "selected": str(selected[name])}},
        }, ft / "config.json", tag=name, upstream=("warmup",), files=(selected[name],))
    from ..evaluation.effect import selection_effect

    t0 = time.perf_counter()
    with quiet_stage(), activity("evaluate: the warmed-up target and its fine-tuned copies"):
        effect = selection_effect(wd, warm, pool=pool, validation=validation, seed=seed, data_args=data_args,
                                  tasks=tasks, eval_per_task=eval_per_task,
                                  device="cpu" if stages.trainer["accelerator"] == "cpu" else "auto",
                                  precision=stages.trainer.get("precision"))
    stages.took("evaluate", time.perf_counter() - t0)
    print(f"[pipeline] evaluate: the warmed-up target and its fine-tuned copies on held-out examples, "
          f"{times['evaluate']:.1f} s -> {wd / 'summary.json'}", flush=True)
    return effect


def selection_tasks(scores_path: str | Path, rule: str) -> list[str]:
    """The validation tasks a per-task rule selects for (a rule whose class declares ``per_task``: with it the pipeline
    selects and fine-tunes once per validation task; ``balanced`` over the task's own score columns, its subtasks,
    where ``select --rule balanced`` without ``--task`` balances one subset over every task): the tasks of the score
    table's columns ``score/<task>`` and ``score/<task>.<part>``, in order; ``[]`` for any other rule."""
    from ..selection.rules import RULES

    if not RULES[rule].per_task:
        return []
    from ..io.scores import read_table, task_names_of

    _, table = read_table(scores_path)
    tasks = list(dict.fromkeys(name.split(".")[0] for name in task_names_of(table)))
    if not tasks:
        raise ValueError(f"select_rule {rule!r} selects once per validation task, but {scores_path} has no per-task "
                         "score columns (score/<task>)")
    return tasks


def _artifacts(wd: Path, finetune: bool, tasks: list[str] | None = None) -> dict[str, str]:
    """What the pipeline leaves for the user, by what it is (every path exists when the summary is printed)."""
    out = {"warmed-up target": wd / "warmup" / "model", "proxy": wd / "proxy" / "model",
           "proxy's scores": wd / "scores" / "proxy" / "scores.parquet",
           "target's scores": wd / "scores" / "target" / "scores.parquet"}
    for task in tasks or [None]:
        name, label = ("proxy", "") if task is None else (f"proxy.{task}", f" ({task})")
        out[f"proxy's selection{label}"] = wd / "selected" / f"{name}.jsonl"
        if finetune:
            out[f"fine-tuned on it{label}"] = wd / "finetune" / name / "model"
    out.update({"summary": wd / "summary.json", "stage configs": wd / "configs"})
    return {k: str(v) for k, v in out.items()}


CHECK_SAMPLE = 64  # pool examples the next command's check scores on a real model (three models score each: minutes)


def _next_command(wd: Path, warm: Path, proxy: Path, pool, validation, data_args: dict,
                  proxy_validation: str = "target") -> str:
    """``train.py check`` of this run's proxy against its warmed-up target, on the same pool and validation sets, the
    proxy scored against the validation gradients this run's proxy selection used."""
    import shlex

    args = ["python", "train.py", "check", "--target", str(warm), "--proxy", str(proxy)]
    for flag, value in (("--pool", pool), ("--validation", validation)):
        if value != "builtin":
            args += [flag, value if isinstance(value, str) else json.dumps(value)]
    if pool != "builtin":  # a real model: the README recipe's sample (check's default, 200, on the demo)
        args += ["--sample", str(CHECK_SAMPLE)]
    for key in ("val_per_task", "max_length"):  # in the README's order
        if data_args.get(key):
            args += [f"--{key}", str(data_args[key])]
    if proxy_validation != "target":  # check's default for an IProX proxy is the target's
        args += ["--proxy_validation", proxy_validation]
    args += ["--output_dir", str(wd / "check")]
    return " ".join(shlex.quote(a) for a in args)


def rule_task_scores(path: str | Path, rule: str, tasks: list[str]) -> dict[str, dict[str, float]]:
    """``id -> {task: score}`` of a score table under a per-task rule: each task's value is what ranks that task's
    selection (e.g. ``max``: the max over the task's subtask columns)."""
    import numpy as np

    from ..io.scores import read_table
    from ..selection.rules import rule_order

    _, table = read_table(path)
    ids = [str(i) for i in table.column("id").to_pylist()]
    columns = {c: np.asarray([np.nan if v is None else float(v) for v in table.column(c).to_pylist()], np.float64)
               for c in table.column_names if c.startswith("score/")}
    values = {task: rule_order(rule, ids, columns, task)[1] for task in tasks}
    return {i: {task: float(values[task][j]) for task in tasks} for j, i in enumerate(ids)}


def _per_task(wd, rule: str | None = None, tasks: list[str] | None = None) -> dict[str, Any]:
    """Proxy vs target per validation task (the score tables' ``score/<task>`` columns, or with a per-task rule each
    task's ranking under it, :func:`rule_task_scores`; lengths = the target table's response tokens):
    :func:`~iprox_lightning.analysis.retention.per_task_retention` and its worst task."""
    from ..analysis.retention import per_task_retention, per_task_scores, worst_task
    from ..io.scores import read_table

    target = wd / "scores" / "target" / "scores.parquet"
    proxy = wd / "scores" / "proxy" / "scores.parquet"
    _, table = read_table(target)
    lengths = dict(zip(map(str, table.column("id").to_pylist()), map(float, table.column("n_tokens").to_pylist())))
    scores = (lambda p: rule_task_scores(p, rule, tasks)) if tasks else per_task_scores
    per_task = per_task_retention(scores(proxy), scores(target), lengths)
    return {"retention_proxy_vs_target_per_task": per_task, "retention_proxy_vs_target_worst_task": worst_task(per_task)}


def _uncompressible(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the proxy cannot compress, from its manifest: ``{"uncompressible": {"params": share of the target's
    parameters outside the targeted layers, "flops": share of per-token matmul FLOPs outside them}}`` (empty for a
    manifest of an older version, which lacks the counts)."""
    before, targeted = manifest.get("params_before"), manifest.get("target_params_before")
    if not before or targeted is None:
        return {}
    other = manifest.get("untargeted_matmul_params")
    return {"uncompressible": {"params": round(1 - targeted / before, 4),
                               "flops": None if other is None else round(other / max(other + targeted, 1), 4)}}


def _summary(wd, warm, proxy, scores, selected, times, pool, rule=None, tasks=None) -> dict[str, Any]:
    from ..analysis.retention import retention_metrics

    from ..io.proxy import read_manifest

    manifest = read_manifest(proxy)
    out: dict[str, Any] = {
        "workdir": str(wd),
        # the manifest records both counts; load a model only for a manifest that lacks them
        "target_params": manifest.get("params_before") or _count_params(str(warm)),
        "proxy_params": manifest.get("params_after") or _count_params(str(proxy)),
        "proxy_manifest": {k: manifest[k] for k in ("sparsity", "method", "mode", "damping", "damping_mode") if k in manifest},
        **_uncompressible(manifest),
        "seconds_per_stage": {k: round(v, 2) for k, v in times.items()},
        "retention_proxy_vs_target": retention_metrics(scores["proxy"], scores["target"]),
        "retention_random_vs_target": retention_metrics(scores["random"], scores["target"]),
        **_per_task(Path(wd), rule, tasks),
    }
    if pool == "builtin":
        from ..data.synthetic import BUILTIN_VALIDATION_FAMILIES, oracle_share

        ids = {who: [json.loads(l)["id"] for l in Path(p).read_text().splitlines() if l.strip()] for who, p in selected.items()}
        out["oracle"] = {
            "validation_families": list(BUILTIN_VALIDATION_FAMILIES),
            "base_rate": oracle_share(sorted(scores["target"])),
            **{f"{who}_selection": oracle_share(i) for who, i in ids.items()},
            "per_family": {who: {f: oracle_share(i, [f]) for f in BUILTIN_VALIDATION_FAMILIES} for who, i in ids.items()},
        }
    out["selection"] = {}
    for who, p in selected.items():
        from ..io.selection import read_meta

        expl = (read_meta(p) or {}).get("explanation")
        if expl:
            out["selection"][who] = expl
    return out


def _format_task_selections(selection: dict[str, Any], tasks: list[str], who: str = "proxy") -> list[str]:
    """A few lines per task on ``who``'s per-task selections: size, the pool categories it over-weights, lengths, the
    top examples (the full explanation is in ``selected/<who>.<task>.jsonl.meta.json``)."""
    lines = [f"{who}'s selections : one per task, best first (explained in full in selected/{who}.<task>.jsonl.meta.json)"]
    for task in tasks:
        e = selection.get(f"{who}.{task}")
        if not e:
            continue
        cats = ", ".join(f"{c['category']} {c['selected']}" for c in e["share_by_category"][:3] if c["selected"])
        ln = e["length"]
        length = (f"; {ln['unit']} median {ln['selected']['median']:.0f} (pool {ln['pool']['median']:.0f})"
                  if ln["selected"] and ln["pool"] else "")
        lines.append(f"   {task:<10}: {e['count']} of {e['pool_size']} ({cats}{', ...' if len(e['share_by_category']) > 3 else ''})"
                     f"{length}")
        for ex in e.get("top", [])[:2]:
            text = ex["instruction"] + (f" [{ex['context']}]" if ex["context"] else "") + f" -> {ex['response']}"
            lines.append(f"      top {ex['id']} ({ex['category']}): {text[:90]!r}")
    return lines


def _format_summary(s: dict[str, Any]) -> str:
    lines = ["", "=" * 72, "IProX pipeline summary", "=" * 72]
    tp, pp = s["target_params"], s["proxy_params"]
    lines.append(f"target parameters : {tp:,}")
    lines.append(f"proxy parameters  : {pp:,} ({pp / tp:.1%} of the target; {s['proxy_manifest']})")
    if "uncompressible" in s:
        u = s["uncompressible"]
        flops = f", {u['flops']:.1%} of the per-token matmul FLOPs (LM head)" if u.get("flops") is not None else ""
        lines.append(f"   not compressible: {u['params']:.1%} of the target's parameters (embedding, LM head, norms)"
                     f"{flops}")
    lines.append("seconds per stage : " + ", ".join(f"{k} {v:.1f}" for k, v in s["seconds_per_stage"].items()))
    if "stages" in s:
        from ..io.stages import format_provenance

        lines.extend(format_provenance(s))
    if "selection_rule" in s:
        sr = s["selection_rule"]
        if sr.get("tasks"):
            lines.append(f"selection rule    : {sr['rule']} over each task's score columns, one subset per task "
                         f"({', '.join(sr['tasks'])}) for target and proxy (random: one uniform subset), "
                         f"k = {sr['k']:g} of the pool each")
        else:
            lines.append(f"selection rule    : {sr['rule']} (target and proxy; random: uniform), k = {sr['k']:g} of the pool")
    r = s["retention_proxy_vs_target"]
    lines.append(f"proxy vs target   : Spearman {r['spearman']:.3f}, Kendall {r['kendall']:.3f}, top-5% overlap {r['top5%']:.2f}")
    if s.get("retention_proxy_vs_target_per_task"):  # the pooled score mixes the tasks; each task on its own
        from ..analysis.retention import format_per_task

        lines.extend(format_per_task(s["retention_proxy_vs_target_per_task"]))
    r = s["retention_random_vs_target"]
    lines.append(f"random vs target  : Spearman {r['spearman']:.3f}, top-5% overlap {r['top5%']:.2f}")
    if "oracle" in s:
        o = s["oracle"]
        lines.append(f"selection oracle  : share of selected examples from the validation families {o['validation_families']}")
        names = [k[: -len("_selection")] for k in o if k.endswith("_selection")]
        lines.append("   " + " | ".join(f"{who} {o[who + '_selection']:.3f}" for who in names)
                     + f" | base rate {o['base_rate']:.3f}")
        if "per_family" in o:
            for fam in o["validation_families"]:
                lines.append(f"   {fam + ' share':<17}: " + " | ".join(
                    f"{who} {o['per_family'][who][fam]:.3f}" for who in names if who in o["per_family"]))
    if s.get("selection", {}).get("proxy"):
        from ..selection.summary import format_selection

        lines.append("proxy's selection :")
        lines.extend("   " + l for l in format_selection(s["selection"]["proxy"]).splitlines())
    elif s.get("selection_rule", {}).get("tasks"):
        lines.extend(_format_task_selections(s["selection"], s["selection_rule"]["tasks"]))
    if s.get("selection_effect"):
        from ..evaluation.effect import format_effect

        lines.extend(format_effect(s["selection_effect"]))
    lines.append("=" * 72)
    if s.get("artifacts"):
        lines.append("artifacts:")
        width = max(len(k) for k in s["artifacts"])
        lines.extend(f"   {k:<{width}} : {v}" for k, v in s["artifacts"].items())
    if s.get("next_command"):
        lines.append("next: is the proxy worth using (per-task retention vs the free baselines, a verdict)?")
        lines.append(f"   {s['next_command']}")
    return "\n".join(lines)


PLAN_STAGES = ("warmup", "build_proxy", "score", "finetune")
"""The stage configs ``pipeline --plan`` overlays (the fit's: :func:`iprox_lightning.analysis.fit.overlays`)."""


def stage_plan(plan, device_memory, *, target, hardware: dict, config_dir, demo: bool, data_args, sparsity,
               align_epochs, method: str, lora, validation) -> dict[str, dict]:
    """``pipeline --plan``: ``{stage config: overlay}`` to merge into the stages (``{}`` without ``plan``): the
    overlay given, or with ``auto`` the fit of this run's settings (the stage configs as the pipeline merges them)
    to ``device_memory``; a stage that fits at no setting is refused here, before any stage runs."""
    if plan is None:
        if device_memory is not None:
            raise UserInputError("device_memory is the memory --plan auto fits the stages to: pass --plan auto too")
        return {}
    if isinstance(plan, dict):
        unknown = sorted(set(plan) - set(PLAN_STAGES))
        if unknown or not all(isinstance(v, dict) for v in plan.values()):
            raise UserInputError(f"plan: an overlay per stage config ({', '.join(PLAN_STAGES)}), each a mapping, as "
                                 f"train.py plan --fit prints it; got {', '.join(unknown) or 'a value that is not a mapping'}")
        return plan
    if plan != "auto":
        raise UserInputError(f"plan must be auto or the overlay train.py plan --fit prints (a JSON mapping), got {plan!r}")
    from ..analysis import fit as F
    from ..analysis import memory as M

    cfg_dir = Path(config_dir) if config_dir else DEFAULT_CONFIG_DIR
    configs = {}
    for name in PLAN_STAGES:
        merged: dict = {}
        for f in [cfg_dir / f"{name}.yaml"] + ([cfg_dir / "builtin" / f"{name}.yaml"] if demo else []):
            if f.exists():
                merged = F.merge_overlay(merged, yaml.safe_load(f.read_text()) or {})
        merged = F.merge_overlay(merged, {"data": {"init_args": dict(data_args or {})}})
        configs[name] = merged
    memory = M.parse_bytes(device_memory) if device_memory is not None else _device_memory(hardware)
    runs, sizes_of = F.pipeline_runs(configs, target=target, hardware=hardware, sparsity=sparsity,
                                     align_epochs=align_epochs, method=method, lora=lora, validation=validation)
    fits = []
    for stages, run in runs:
        sizes, acts, acts32 = sizes_of(run)
        fits += F.fit_stages(sizes, acts, acts32, run, memory, stages)
    failed = [f for f in fits if not f.fits]
    if failed:
        f = failed[0]
        raise UserInputError(f"plan auto: {f.stage} fits {F.size(memory)} per device at no setting the fit tries: "
                             f"{F.reason(f, memory)}; nearest: {'; '.join(f.levers) or 'no lever'}")
    route = ""
    tracin = next((f for f in fits if f.stage == "scoring (tracin)"), None)
    if tracin is not None:  # exact TracIn in several passes: say the store would take one
        score_run = next(r for stages, r in runs if tracin.stage in stages)
        store = F.fit_stages(*sizes_of(score_run), score_run, memory, [F.STORE])[0]
        r = F.tracin_route(sizes_of(score_run)[0], score_run, memory, tracin, store)
        route = f"; the gradient store would be the better path: {r['why']}" if r["to_store"] else ""
    chosen = [f"{f.stage}: {'; '.join(f.levers)}" for f in fits if f.levers]
    print(f"[pipeline] plan auto: every stage fits {F.size(memory)} per device "
          + (f"with {' | '.join(chosen)}" if chosen else "at the configs' settings: nothing changed") + route, flush=True)
    return F.overlays(fits, method)["stages"]


def _device_memory(hardware: dict) -> float:
    """The memory of one device of the run: the first CUDA device's, or on CPUs the host's shared by the run's
    processes on the node."""
    import os

    import torch

    if str(hardware.get("accelerator", "cpu")).lower() != "cpu" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / int(hardware.get("devices") or 1)
