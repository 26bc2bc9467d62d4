"""``pipeline --plan``: an overlay per stage config, the one given or the fit of this run's settings to the device
memory (:mod:`iprox_lightning.analysis.fit`), refused before any stage runs when a stage fits at no setting."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from ..analysis import fit as F
from ..analysis import memory as M
from ..errors import UserInputError
from .stages import DEFAULT_CONFIG_DIR


PLAN_STAGES = ("warmup", "build_proxy", "score", "finetune")
"""The stage configs ``pipeline --plan`` overlays (the fit's: :func:`iprox_lightning.analysis.fit.overlays`)."""


def stage_plan(plan, device_memory, *, target, hardware: dict, config_dir, demo: bool, data_args, sparsity,
               align_epochs, method: str, lora, validation, proxy_validation: str = "target") -> dict[str, dict]:
    """``pipeline --plan``: ``{stage config: overlay}`` to merge into the stages (``{}`` without ``plan``): the
    overlay given, or with ``auto`` the fit of this run's settings (the stage configs as the pipeline merges them)
    to ``device_memory``; a stage that fits at no setting is refused here, before any stage runs.
    ``proxy_validation``: the run's ``--proxy_validation`` (the proxy's scoring holds the target only with
    ``target``)."""
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
                                     align_epochs=align_epochs, method=method, lora=lora, validation=validation,
                                     proxy_validation=proxy_validation)
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

    if str(hardware.get("accelerator", "cpu")).lower() != "cpu" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / int(hardware.get("devices") or 1)
