"""What a selection holds, next to the pool it was drawn from — plain functions, no model needed.

:func:`explain_selection` takes the selected ids (best first), the pool's canonical records and the
score table's rows and returns a JSON-able dict:

* ``share_by_category``: for each ``category`` (the source/task of a record), its count and share in the
  selection, its share in the pool and the ratio of the two (``> 1``: over-represented);
* ``per_task``: when the table has per-validation-task scores (``score/<task>``), the category shares
  of the top ``count`` examples by each task's score — which pool categories each validation task pulls in;
* ``length``: the length distribution (min / quartiles / mean / max) of the selection and of the pool,
  in response tokens (the table's ``n_tokens``) or, without that column, response characters;
* ``top`` / ``bottom``: the highest- and lowest-ranked selected examples with their text, score and
  per-task scores.

:func:`format_selection` renders it as the lines ``select`` prints and the report includes.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

TASK_PREFIX = "score/"


def _dist(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {}
    a = np.asarray(values, dtype=float)
    q = np.percentile(a, [0, 25, 50, 75, 100])
    return {"n": int(a.size), "min": float(q[0]), "p25": float(q[1]), "median": float(q[2]), "mean": float(a.mean()),
            "p75": float(q[3]), "max": float(q[4])}


def _shares(ids: Sequence[str], category: Mapping[str, str]) -> Counter:
    return Counter(category[i] for i in ids)


def _text(rec: Mapping[str, Any], n: int = 160) -> dict[str, str]:
    if "messages" in rec:
        turns = rec["messages"]
        prompt = " | ".join(m["content"] for m in turns if m["role"] != "assistant")
        resp = " | ".join(m["content"] for m in turns if m["role"] == "assistant")
        out = {"instruction": prompt, "context": "", "response": resp}
    else:
        out = {k: str(rec.get(k) or "") for k in ("instruction", "context", "response")}
    return {k: (v if len(v) <= n else v[: n - 1] + "…") for k, v in out.items()}


def _response_chars(rec: Mapping[str, Any]) -> int:
    if "messages" in rec:
        return sum(len(m["content"]) for m in rec["messages"] if m["role"] == "assistant")
    return len(str(rec.get("response") or ""))


def explain_selection(
    selected: Sequence[str],
    pool: Sequence[Mapping[str, Any]],
    rows: Mapping[str, Mapping[str, Any]] | None = None,
    n_examples: int = 3,
    ranked_by: tuple[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """See the module doc. ``selected``: ids best first; ``pool``: canonical records of the whole pool
    (every selected id must be in it); ``rows``: ``{id: score-table row}`` (``score``, ``score/<task>``,
    ``n_tokens``), optional; ``ranked_by``: ``(label, {id: value})``, the key the selection ranked by (a rule's value:
    ``max`` of the task columns, ``balanced``'s standardised task score, ...), shown beside each example's
    ``score`` when it is not that column."""
    rows = rows or {}
    by_id = {r["id"]: r for r in pool}
    missing = [i for i in selected if i not in by_id]
    if missing:
        raise ValueError(f"explain_selection: {len(missing)} selected id(s) not in the pool, e.g. {missing[:3]}")
    category = {i: r.get("category") or "?" for i, r in by_id.items()}
    n_sel, n_pool = len(selected), len(by_id)
    sel_c, pool_c = _shares(selected, category), _shares(list(by_id), category)
    share = [
        {"category": c, "selected": sel_c.get(c, 0), "selected_share": sel_c.get(c, 0) / max(n_sel, 1),
         "pool_share": pool_c[c] / n_pool,
         "ratio": (sel_c.get(c, 0) / max(n_sel, 1)) / (pool_c[c] / n_pool)}
        for c in sorted(pool_c, key=lambda c: (-sel_c.get(c, 0), -pool_c[c], c))
    ]
    out: dict[str, Any] = {"count": n_sel, "pool_size": n_pool, "share_by_category": share}

    scored = [i for i in by_id if i in rows]
    tasks = sorted({k[len(TASK_PREFIX):] for r in rows.values() for k in r if k.startswith(TASK_PREFIX)})
    if tasks and scored and n_sel:
        per_task = {}
        for t in tasks:
            col = TASK_PREFIX + t
            top = sorted((i for i in scored if rows[i].get(col) is not None), key=lambda i: (-float(rows[i][col]), i))[:n_sel]
            c = _shares(top, category)
            per_task[t] = {k: v / len(top) for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))}
        out["per_task"] = per_task

    if scored and all(rows[i].get("n_tokens") is not None for i in scored):
        unit, length = "response tokens", {i: float(rows[i]["n_tokens"]) for i in scored}
    else:
        unit, length = "response characters", {i: float(_response_chars(r)) for i, r in by_id.items()}
    out["length"] = {"unit": unit, "selected": _dist([length[i] for i in selected if i in length]),
                     "pool": _dist(list(length.values()))}

    def example(i: str) -> dict[str, Any]:
        r = rows.get(i, {})
        ex = {"id": i, "category": category[i], **_text(by_id[i])}
        if ranked_by is not None and ranked_by[0] != "score" and i in ranked_by[1]:
            ex["ranked_by"], ex["rank_value"] = ranked_by[0], float(ranked_by[1][i])
        if "score" in r:
            ex["score"] = float(r["score"])
        ts = {k[len(TASK_PREFIX):]: float(v) for k, v in r.items() if k.startswith(TASK_PREFIX) and v is not None}
        if ts:
            ex["task_scores"] = ts
        return ex

    k = min(n_examples, n_sel)
    out["top"] = [example(i) for i in selected[:k]]
    out["bottom"] = [example(i) for i in selected[max(k, n_sel - k):]][::-1]
    return out


def format_selection(e: Mapping[str, Any], max_categories: int = 12) -> str:
    """Human-readable lines for :func:`explain_selection`'s dict."""
    lines = [f"selected {e['count']} of {e['pool_size']} pool examples ({e['count'] / max(e['pool_size'], 1):.1%})",
             f"  {'category':<24} {'selected':>8} {'share':>7} {'pool share':>10} {'ratio':>6}"]
    for s in e["share_by_category"][:max_categories]:
        lines.append(f"  {s['category'][:24]:<24} {s['selected']:>8} {s['selected_share']:>7.1%} {s['pool_share']:>10.1%} {s['ratio']:>6.2f}")
    if len(e["share_by_category"]) > max_categories:
        lines.append(f"  ... {len(e['share_by_category']) - max_categories} more categories")
    for t, shares in (e.get("per_task") or {}).items():
        top = ", ".join(f"{c} {v:.0%}" for c, v in list(shares.items())[:4])
        lines.append(f"  top {e['count']} by validation task {t!r}: {top}")
    ln = e["length"]
    if ln["selected"] and ln["pool"]:
        fmt = lambda d: f"median {d['median']:.1f}, mean {d['mean']:.1f}, p25-p75 {d['p25']:.0f}-{d['p75']:.0f}, max {d['max']:.0f}"
        lines.append(f"  length ({ln['unit']}): selected {fmt(ln['selected'])} | pool {fmt(ln['pool'])}")
    for label, key in (("top", "top"), ("bottom", "bottom")):
        for ex in e.get(key, []):
            sc = f"score {ex['score']:+.3f}" if "score" in ex else ""
            if "ranked_by" in ex:  # the key the selection ranked by first: the pooled score is not it
                sc = f"ranked by {ex['ranked_by']} {ex['rank_value']:+.3f}" + (f", pooled {sc}" if sc else "")
            ts = ", ".join(f"{t} {v:+.3f}" for t, v in ex.get("task_scores", {}).items())
            text = ex["instruction"] + (f" [{ex['context']}]" if ex["context"] else "") + f" -> {ex['response']}"
            lines.append(f"  {label:<6} {ex['id']} ({ex['category']}; {sc}{'; ' + ts if ts else ''}): {text!r}")
    return "\n".join(lines)
