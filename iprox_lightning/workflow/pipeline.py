"""The pipeline's stages in order (the stage table of ``ARCHITECTURE.md``): warm-up, build the proxy, score the pool
with the target and the proxy, select (target, proxy and random; one subset per validation task with a per-task
rule), fine-tune on each selection and evaluate, then the summary. :func:`run_pipeline` checks a run's settings before
any stage, holds the workdir's lock and runs them; each stage is run or reused by its fingerprint
(:mod:`iprox_lightning.workflow.stages`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..baselines.random_selection import write_random_scores
from ..console import quiet_stage
from ..evaluation import effect as evaluation_effect
from ..io.jsonfile import write_json
from ..io.output_guard import check_output_not_input
from ..io.ownership import make_owned_dir
from ..io.score_dir import ScoreDirLock
from ..io.scores import read_scores, read_table, task_names_of
from ..io.stages import pipeline_provenance
from ..models.lora import LoraSettings
from ..progress import activity
from ..selection.rules import RULES
from ..selection.select import select
from .plan import stage_plan
from .settings import PipelineSettings, check_arguments, check_sources, trainer_hardware
from .stages import _SIGTERM, _stage_runner, _StageRunner
from .summary import _artifacts, _format_summary, _next_command, _summary


def run_pipeline(s: PipelineSettings, run_lightning: Callable[[list[str]], Any]) -> dict[str, Any]:
    """Check ``s`` (every argument a late stage would refuse, the hardware, the sources, LoRA, ``--plan``), then run
    every stage in ``s.workdir`` under its lock with ``run_lightning`` (``python train.py <command>`` in this
    process); returns the summary, also written to ``<workdir>/summary.json`` and printed."""
    threads = 1 if s.num_threads is None and s.target == "builtin" else s.num_threads
    if threads:
        torch.set_num_threads(threads)
    wd = Path(s.workdir)
    check_arguments(wd, s.sparsity, s.select_fraction, s.method, s.select_rule, s.eval_per_task, s.proxy_validation)
    hardware = trainer_hardware(s.accelerator, s.devices, s.num_nodes, s.strategy, s.precision)
    check_sources(s.target, s.pool, s.validation)
    lora_settings = LoraSettings.of(s.lora)  # refused before any stage
    lora = lora_settings.to_dict() if lora_settings is not None else None
    plan_overlays = stage_plan(s.plan, s.device_memory, target=s.target, hardware=hardware, config_dir=s.config_dir,
                               demo=s.demo, data_args=s.data_args, sparsity=s.sparsity, align_epochs=s.align_epochs,
                               method=s.method, lora=lora, validation=s.validation,
                               proxy_validation=s.proxy_validation)
    check_output_not_input(wd, s.sources, "--workdir")
    make_owned_dir(wd, "pipeline workdir")
    # SIGTERM stops the run with the CLI's one 'stopped' line, the lock released and removed on the way out
    with _SIGTERM, ScoreDirLock(wd, ".pipeline.lock", "pipeline run", "use another --workdir", remove=True), \
            activity(f"pipeline {wd}"):  # between and inside stages, a line at least every interval
        stages = _stage_runner(wd, s.config_dir, s.demo, s.force, dict(s.sources), hardware, run_lightning, threads,
                               plan_overlays)
        return _run_stages(s, stages, lora)


def _run_stages(s: PipelineSettings, stages: _StageRunner, lora: dict | None) -> dict[str, Any]:
    """The stages of a run, while its workdir lock is held: the stage table of ``ARCHITECTURE.md`` in order, one step
    each, then the summary."""
    wd = stages.wd
    data_args = {"pool": s.pool, "validation": s.validation, "seed": s.seed, **(s.data_args or {})}
    warm = _warm_up(stages, s.target, data_args, s.seed, lora)
    proxy = _build_proxy(stages, warm, data_args, s.seed, s.sparsity, s.align_epochs)
    score_dirs = _score_pool(stages, warm, proxy, data_args, s.seed, s.method, s.proxy_validation)
    scores, tasks, selected = _select_subsets(stages, score_dirs, s.pool, data_args, s.seed, s.select_fraction,
                                              s.select_rule)
    effect = None
    if s.finetune:
        effect = _finetune_and_evaluate(stages, warm, selected, tasks, s.pool, s.validation, data_args, s.seed,
                                        s.eval_per_task, lora)

    # 6. summary --------------------------------------------------------------------------------
    summary = _summary(wd, warm, proxy, scores, selected, stages.times, s.pool, s.select_rule if tasks else None, tasks)
    summary["selection_rule"] = {"rule": s.select_rule, "k": s.select_fraction, **({"tasks": tasks} if tasks else {})}
    if lora is not None:
        summary["lora"] = lora
    summary.update(pipeline_provenance(stages.ledger, method=s.method, sparsity=s.sparsity, score_dirs=score_dirs,
                                       proxy_validation=s.proxy_validation))
    if effect is not None:
        summary["selection_effect"] = effect
    summary["artifacts"] = _artifacts(wd, s.finetune, tasks)
    summary["next_command"] = _next_command(wd, warm, proxy, s.pool, s.validation, data_args, s.proxy_validation)
    write_json(wd / "summary.json", summary)
    print(_format_summary(summary))
    return summary


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


def _select_subsets(stages: _StageRunner, score_dirs: dict[str, Path], pool, data_args: dict, seed: int,
                    select_fraction: float, select_rule: str):
    """4. select: target, proxy, random (a per-task rule: target and proxy once per validation task) ->
    ``(scores, tasks, {name: <workdir>/selected/<name>.jsonl})``."""

    wd, times = stages.wd, stages.times
    scores = {who: read_scores(d / "scores.parquet") for who, d in score_dirs.items()}
    rand_path = wd / "scores" / "random" / "scores.parquet"
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
    t0 = time.perf_counter()
    with quiet_stage(), activity("evaluate: the warmed-up target and its fine-tuned copies"):
        effect = evaluation_effect.selection_effect(
            wd, warm, pool=pool, validation=validation, seed=seed, data_args=data_args, tasks=tasks,
            eval_per_task=eval_per_task, device="cpu" if stages.trainer["accelerator"] == "cpu" else "auto",
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

    if not RULES[rule].per_task:
        return []
    _, table = read_table(scores_path)
    tasks = list(dict.fromkeys(name.split(".")[0] for name in task_names_of(table)))
    if not tasks:
        raise ValueError(f"select_rule {rule!r} selects once per validation task, but {scores_path} has no per-task "
                         "score columns (score/<task>)")
    return tasks


