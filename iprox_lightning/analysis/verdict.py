"""The verdict of a proxy check: use this proxy, or which free baseline does as well, on which task, and what to try.

:func:`check_verdict` reads the rows ``train.py check`` computes (the proxy's first, then the free baselines: the
length sort and, for an IProX proxy, Layer Extraction at its sparsity), each with a per-task table
(:func:`~.retention.per_task_retention`). The rule, per validation task (the pooled row when there are no tasks):

* a baseline **does as well** on a task when its Spearman with the target's scores is at least the proxy's minus
  ``margin`` (default 0: a tie counts against the proxy, which costs a build and a scoring run; the baselines are
  free);
* a task is **weak** when the proxy's Spearman there is below ``floor`` (default 0.4), whatever the baselines do:
  beating a free baseline that is itself poor (the length sort ranks BBH at -0.16 on SmolLM2) is no evidence that the
  proxy's selection helps. The 0.4 comes from the downstream benchmark (``bench/effect.py``, SmolLM2-135M, k = 26 of
  512): the ρ = 0.5 proxy's own selection matched the target's gain on the tasks where it kept Spearman 0.47 / 0.55 of
  the target's ranking (TyDiQA, MMLU) and fell below every random seed where it kept 0.13 (BBH);
* a short-answer task (at least half of the target's top 5% on it among the 10% shortest responses) is also weak
  when, among those shortest responses (``spearman_within_shortest`` of the per-task table; at least
  ``MIN_SHORTEST`` of them), the proxy's
  Spearman is below ``floor``: its agreement on the task is then a preference for short responses, which the length
  sort has for free. Measured on the same benchmark (MMLU, the 64 three-token examples of 512): the ρ = 0.5 proxy kept
  0.02 there (0.62 over the whole sample) and its selection among them was no better than random subsets of them
  (−0.014 nats), while the target's beat them (+0.025 exact, +0.057 through its store);
* **use this proxy** when no baseline does as well on any task and no task is weak, else **do not use it yet**,
  naming each task and baseline with both numbers, each weak task, and the tasks where the proxy passes.

The next step follows from what lost and what the proxy manifest (``iprox_proxy.json``) records, first match wins:
not aligned -> align it; built from another model than the checked target -> rebuild it from the warmed-up target;
Layer Extraction does as well, or a task is weak -> keep more rank (lower sparsity), align longer at another learning
rate, or select for the weak tasks with the target itself; only the length sort does as well -> the target's own
ranking follows response length: warm the target up first (or align longer).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

LENGTH_SORT = "length sort"
LAYER_EXTRACTION = "layer extraction"
FLOOR = 0.4  # the module docstring says where it comes from
MIN_SHORTEST = 20  # fewer shortest responses than this: their Spearman is too noisy to judge a task by
SHORT_ANSWER_SHARE = 0.5  # a short-answer task: at least this share of the target's top 5% is among the shortest


def _baseline_label(name: str) -> str:
    low = name.lower()
    if low.startswith(LENGTH_SORT):
        return "the length sort"
    if low.startswith(LAYER_EXTRACTION):
        return "Layer Extraction" + name[len(LAYER_EXTRACTION):]
    return name


def _spearman_by_task(row: Mapping[str, Any]) -> dict[str, float]:
    per_task = row.get("per_task") or {}
    if per_task:
        return {t: float(m["spearman"]) if m.get("spearman") is not None else math.nan for t, m in per_task.items()}
    return {"pooled": float(row["spearman"]) if row.get("spearman") is not None else math.nan}


def _weak_among_shortest(row: Mapping[str, Any], floor: float) -> list[dict[str, Any]]:
    """The short-answer tasks (``SHORT_ANSWER_SHARE`` of the target's top 5% among the shortest responses) where the
    row's Spearman among the shortest responses (at least ``MIN_SHORTEST``) is below ``floor``."""
    out = []
    for task, m in (row.get("per_task") or {}).items():
        v, n = m.get("spearman_within_shortest"), m.get("shortest_n") or 0
        short_task = (m.get("target_top5_in_shortest") or 0.0) >= SHORT_ANSWER_SHARE
        if short_task and v is not None and not math.isnan(float(v)) and n >= MIN_SHORTEST and float(v) < floor:
            out.append({"task": task, "proxy_spearman": float(m["spearman"]), "within_shortest": float(v),
                        "shortest_n": int(n)})
    return out


def check_verdict(rows: Sequence[Mapping[str, Any]], *, manifest: Mapping[str, Any] | None = None,
                  target: str | None = None, margin: float = 0.0, floor: float = FLOOR) -> dict[str, Any]:
    """``{"use": bool, "verdict": one line, "next_step": one line or None, "as_good": [{"task", "baseline",
    "baseline_spearman", "proxy_spearman"}, ...], "weak": [{"task", "proxy_spearman"}, ...], "passes": [task, ...]}``
    for check rows (``rows[0]`` the proxy, the rest baselines). ``floor``: the Spearman below which a task is weak
    (``-1`` turns the floor off).

    A ``weak`` entry judged among the shortest responses also holds ``within_shortest`` and ``shortest_n``.

    ``manifest``: the proxy's ``iprox_proxy.json`` (``None`` for a model that is not an IProX proxy); ``target``:
    the checked target (to notice a proxy built from another model). A task where the proxy's Spearman is undefined
    (NaN) counts as lost to every baseline with a defined one.
    """
    if not rows:
        raise ValueError("check_verdict: no rows")
    proxy, baselines = rows[0], list(rows[1:])
    p_tasks = _spearman_by_task(proxy)
    as_good = []
    for b in baselines:
        b_tasks = _spearman_by_task(b)
        for task, p in p_tasks.items():
            v = b_tasks.get(task, math.nan)
            if math.isnan(v):
                continue
            if math.isnan(p) or v >= p - margin:
                as_good.append({"task": task, "baseline": b["proxy"], "baseline_spearman": v, "proxy_spearman": p})
    weak = [{"task": t, "proxy_spearman": p} for t, p in p_tasks.items() if not math.isnan(p) and p < floor]
    weak += [w for w in _weak_among_shortest(proxy, floor) if w["task"] not in {x["task"] for x in weak}]
    failed = {a["task"] for a in as_good} | {w["task"] for w in weak}
    passes = [t for t in p_tasks if t not in failed]
    if not as_good and not weak:
        worst = min(p_tasks, key=lambda t: (p_tasks[t] if not math.isnan(p_tasks[t]) else -2.0))
        best_b = max((_spearman_by_task(b).get(worst, math.nan) for b in baselines), default=math.nan,
                     key=lambda v: -2.0 if math.isnan(v) else v)
        against = (" and ".join(_baseline_label(b["proxy"]) for b in baselines) if baselines else "no baseline")
        vs = f" vs {best_b:.2f} for the best baseline" if not math.isnan(best_b) else ""
        where = f"worst task {worst}" if worst != "pooled" else "pooled"
        return {"use": True, "as_good": [], "weak": [], "passes": passes, "next_step": None,
                "verdict": f"use this proxy: it ranks closer to the target than {against} on every task "
                           f"({where}: Spearman {p_tasks[worst]:.2f}{vs})"}
    reasons = []
    if as_good:
        reasons.append("as good or better, for free: " + "; ".join(
            f"{_baseline_label(a['baseline'])} on {a['task']} ({a['baseline_spearman']:.2f} vs the proxy's "
            f"{a['proxy_spearman']:.2f})" for a in as_good))
    if weak:
        reasons.append("it keeps little of the target's ranking on " + ", ".join(
            f"{w['task']} (Spearman {w['proxy_spearman']:.2f} < {floor:.2f})" if "within_shortest" not in w else
            f"{w['task']} among its {w['shortest_n']} shortest responses (Spearman {w['within_shortest']:.2f} < "
            f"{floor:.2f}; {w['proxy_spearman']:.2f} over all: a preference for short responses, which the length "
            "sort has for free)" for w in weak))
    verdict = "do not use this proxy yet: " + "; ".join(reasons)
    if passes and passes != ["pooled"]:
        verdict += f" (it passes on {', '.join(passes)})"
    return {"use": False, "as_good": as_good, "weak": weak, "passes": passes, "verdict": verdict,
            "next_step": next_step(as_good, weak=weak, manifest=manifest, target=target)}


def next_step(as_good: Sequence[Mapping[str, Any]], *, weak: Sequence[Mapping[str, Any]] = (),
              manifest: Mapping[str, Any] | None = None, target: str | None = None) -> str:
    """What to try when a baseline does as well (see the module docstring for the order)."""
    m = dict(manifest or {})
    align = m.get("alignment") or {}
    sparsity = m.get("achieved_sparsity", m.get("sparsity"))
    if manifest is None:
        return ("this model is not an IProX proxy: build one from the warmed-up target (python train.py fit "
                "--config configs/build_proxy.yaml --model.target <warmed-up target>) and check it")
    if not align or align.get("aligned") is False or align.get("align") is False:
        return ("the proxy is not aligned: build it with alignment on (configs/build_proxy.yaml: --model.align "
                "true, lr 1e-4 to 1e-3, 1-2 epochs) and check again")
    built_from = m.get("target_model")
    if target and built_from and _differs(built_from, target):
        return (f"the proxy was built from {built_from}, not from the checked target {target}: warm the target up "
                "first (configs/warmup.yaml), then build the proxy from the warmed-up target")
    lr, steps = align.get("lr"), align.get("steps")
    tried = f" (this one: lr {lr:g}, {steps} steps)" if lr is not None and steps is not None else ""
    length_only = as_good and all(str(a["baseline"]).lower().startswith(LENGTH_SORT) for a in as_good)
    if not length_only:
        lower, e_g = ((f" than {sparsity:.2f}", f"{max(0.1, round(sparsity - 0.2, 1)):.1f}")
                      if isinstance(sparsity, (int, float)) else ("", "0.3"))
        weak_tasks = sorted({w["task"] for w in weak} - {"pooled"})
        with_target = (f"; or select for {', '.join(weak_tasks)} with the target's own gradients (python train.py "
                       "build_store --model <target>, then query)") if weak_tasks else ""
        return (f"keep more of each layer: rebuild with a lower --sparsity{lower} (e.g. {e_g}), or align longer or at "
                f"another learning rate{tried}{with_target}")
    return ("the target's own ranking follows response length: warm the target up first (configs/warmup.yaml) so "
            f"its gradients carry task signal, or align the proxy longer{tried}")


def _differs(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() != Path(b).resolve()
    except OSError:
        return a != b
