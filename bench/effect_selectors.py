"""The downstream-effect benchmark's selector grammar (``bench/effect.py``): its tasks, default selectors and their
sources, and what a selector string says (``~ft<seed>``, ``~short<m>``, ``~fresh``, ``:<rule>``, ``store:``, ``rds``, a
form), with the small digests and host keys its records use."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from variants import TARGET_VALIDATION  # bench/

from iprox_lightning.data import VALIDATION_FORMS
from iprox_lightning.selection import RULES


TASKS = ("mmlu", "bbh", "tydiqa")


# the best proxy per ρ by the worst task of the per-task fidelity table (docs/BENCHMARKS.md), LE at ρ = 0.5, and ρ = 0.7
# with ρ = 0.5's settings (the cost row: scoring at ρ = 0.7 measured 0.59 of the target's on the CPU, bench/speed.py)
DEFAULT_SOURCES = {
    "target": "target",
    "iprox@0.3": "ipsvd/exact/rel1e-3/global@0.3+align2:1e-4",
    "iprox@0.5": "ipsvd/exact/rel1e-3/global@0.5+align2:3e-4",
    "iprox@0.7": "ipsvd/exact/rel1e-3/global@0.7+align2:3e-4",
    "layer_extraction@0.5": "le@0.5",
    "target_unwarmed": "target_unwarmed",
    # the same proxies scored against the warmed target's validation gradients (variant suffix +tval: no build of
    # their own; through a store, the proxy's store queried with ``query --validation_model <warmed target>``)
    "tval@0.3": "ipsvd/exact/rel1e-3/global@0.3+align2:1e-4" + TARGET_VALIDATION,
    "tval@0.5": "ipsvd/exact/rel1e-3/global@0.5+align2:3e-4" + TARGET_VALIDATION,
}


DEFAULT_SELECTORS = ["target", "iprox@0.3", "iprox@0.5", "rds", "length", "layer_extraction@0.5"]


FT_SUFFIX = "~ft"  # "<key>~ft<seed>": the same selection fine-tuned with another seed (--finetune-seeds)


SHORT_SUFFIX = "~short"  # "<selector>~short<m>": its rule among the m·k shortest responses (select's within_shortest)


# "<selector>~fresh": its rule among the candidates outside the pool categories the task's held-out examples come from
# (select's exclude_categories; TyDiQA: XQuAD); a task-free one (random:<seed>~fresh) leaves out every task's
FRESH_SUFFIX = "~fresh"


TASK_FREE = ("length",)  # selectors whose subset does not depend on the task (random:<seed> too)


METRICS = {"loss": False, "exact_match": True}  # metric -> higher is better


def task_free(selector: str) -> bool:
    return selector in TASK_FREE or selector.startswith("random:")


def split_shortlist(selector: str) -> tuple[str, float | None]:
    """``"store+balanced~short2"`` -> ``("store+balanced", 2.0)``: the selector ranking only among the ``2·k`` shortest
    responses (``select(within_shortest=2)``); ``(selector, None)`` without the suffix."""
    head, sep, m = selector.rpartition(SHORT_SUFFIX)
    if not sep:
        return selector, None
    try:
        return head, float(m)
    except ValueError:
        raise ValueError(f"selector {selector!r}: expected <selector>{SHORT_SUFFIX}<multiple of k>") from None


def split_fresh(selector: str) -> tuple[str, bool]:
    """``"store+balanced~fresh"`` -> ``("store+balanced", True)``: the selector ranking only the candidates outside its
    task's held-out source (``select(exclude_categories=...)``); ``(selector, False)`` without the suffix. It does not
    combine with ``~short<m>``."""
    head, sep, rest = selector.rpartition(FRESH_SUFFIX)
    if not sep:
        return selector, False
    if rest or SHORT_SUFFIX in head:
        raise ValueError(f"selector {selector!r}: expected <selector>{FRESH_SUFFIX} (last, without {SHORT_SUFFIX})")
    return head, True


def split_rule(selector: str, default_rule: str) -> tuple[str, str]:
    """``"store+max"`` -> ``("store", "max")``: a selector may name its own selection rule after ``+`` (rows of
    several rules side by side); without one it uses ``--rule``. A ``~short<m>`` or ``~fresh`` suffix is left out."""
    selector = split_shortlist(split_fresh(selector)[0])[0]
    base, _, rule = selector.partition("+")
    return (base, rule) if rule in RULES else (selector, default_rule)


def lenmatch_reference(selector: str) -> tuple[str, int] | None:
    """``"lenmatch:<seed>"`` -> ``("target", seed)``; ``"lenmatch-<selector>:<seed>"`` -> ``(selector, seed)``: the
    length-matched control of that selector's per-task selection; ``None`` for any other selector."""
    if not selector.startswith("lenmatch"):
        return None
    head, _, seed = selector.rpartition(":")
    ref = "target" if head == "lenmatch" else head[len("lenmatch-"):] if head.startswith("lenmatch-") else ""
    if not ref or not seed.isdigit():
        raise ValueError(f"selector {selector!r}: expected lenmatch:<seed> or lenmatch-<selector>:<seed>")
    return ref, int(seed)


def split_finetune_seed(key: str) -> tuple[str, int | None]:
    """``"mmlu/target~ft1"`` -> ``("mmlu/target", 1)``; a key without the suffix was fine-tuned with ``--seed``."""
    base, sep, s = key.rpartition(FT_SUFFIX)
    return (base, int(s)) if sep and s.isdigit() else (key, None)


def is_store(selector: str) -> bool:
    """A gradient-store selector: ``store`` (the target's) or ``store:<model>[@<form>]``."""
    return selector == "store" or selector.startswith("store:")


def is_less(selector: str) -> bool:
    """LESS (issue 66): ``less`` — its own LoRA warm-up of the model (``configs/less/warmup.yaml``: 4 epochs on the
    warm-up split, a checkpoint with its Adam moments per epoch), ``method: less`` over the 4 checkpoints weighted by
    their epochs' mean learning rates (``configs/less/score.yaml``), per subtask; with ``+max``, LESS's max."""
    return selector == "less"


def is_rds(selector: str) -> bool:
    """The RDS+ baseline: ``rds`` or ``rds@<form>``."""
    return selector == "rds" or selector.startswith("rds@")


def store_source(selector: str) -> str:
    """``"store"`` -> ``"target"``, ``"store:iprox@0.5"`` -> ``"iprox@0.5"``: whose gradient store a selector queries
    (with its validation form, if any: ``"store:target@bbh-direct"`` -> ``"target@bbh-direct"``)."""
    return selector.partition(":")[2] or "target"


def split_store_source(source: str) -> tuple[str, str | None]:
    """``"target@bbh-direct"`` -> ``("target", "bbh-direct")``: the model whose store is queried and the validation
    form the query uses instead of its suite's default (``None``: the suites as the fidelity run scored them). The
    store is built once per model; each form is one more query of it."""
    head, form = split_form(source)
    if form is not None:
        return head, form
    _, sep, last = source.rpartition("@")
    if sep and not last.replace(".", "", 1).isdigit():  # "iprox@0.5" is a proxy's name, not a form
        raise ValueError(f"store:{source}: unknown validation form {last!r}; forms: {list(VALIDATION_FORMS)}")
    return source, None


def store_model(sources: Mapping[str, str], model: str) -> str:
    """The selector whose gradient store ``model``'s queries read: itself, or for a ``+tval`` source the selector of
    the proxy it scores (``tval@0.5`` -> ``iprox@0.5``: one store, queried with either validation side)."""
    v = sources.get(model, model)
    if not v.endswith(TARGET_VALIDATION):
        return model
    base = v.removesuffix(TARGET_VALIDATION)
    return next((s for s, sv in sources.items() if sv == base), model)


def split_form(text: str) -> tuple[str, str | None]:
    """``"x@bbh-direct"`` -> ``("x", "bbh-direct")``; ``(text, None)`` when it ends in no validation form."""
    head, sep, form = text.rpartition("@")
    return (head, form) if sep and form in VALIDATION_FORMS else (text, None)


def proxy_weights_digest(proxy_dir: Path) -> str | None:
    """The weights digest a saved proxy's manifest records (``iprox_proxy.json``: ``weights.sha256``; Layer
    Extraction's saved model: ``None``)."""
    from iprox_lightning.io import PROXY_MANIFEST, read_manifest

    return read_manifest(proxy_dir).get("weights", {}).get("sha256") if (proxy_dir / PROXY_MANIFEST).is_file() else None


def host_key(rec: dict) -> tuple | None:
    """``(accelerator, cpus)`` of the host a stage record ran on (what makes two runs' seconds comparable); ``None``
    for a record made before hosts were recorded."""
    h = rec.get("host")
    return (h["accelerator"], h["cpus"]) if h else None


def run_on_host(rec: dict, like: dict) -> dict:
    """The run of a stage on ``like``'s host: ``rec`` itself, or one of its ``rebuilt`` runs (a stage re-made on
    another host from the same fingerprint, because its output stayed where it first ran, keeps each run's record);
    ``rec`` when none matches (the cost then says the hosts differ)."""
    want = host_key(like)
    return next((r for r in [rec, *rec.get("rebuilt", [])] if want is not None and host_key(r) == want), rec)


def json_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
