"""The variant grammar of the benchmarks: one string names a proxy and how it is built.

``le@ρ`` (Layer Extraction) or ``METHOD[/OPTION...]@ρ[+align]`` with METHOD ``ipsvd`` | ``svd`` |
``random`` and options ``core`` | ``exact``, ``abs<d>`` | ``rel<d>`` (damping), ``global`` (global rank
allocation), ``spare0`` (block 0's MLP kept dense), ``n<N>`` (probe tokens per layer); ``+align`` runs Stage 2 (with ``bench/fidelity_v2.py``'s
``--align-epochs``, ``--align-lr``); ``+align<EPOCHS>`` and ``+align[<EPOCHS>]:<LR>`` set
them for one variant (``+align2:1e-4``); ``drop<N>`` drops the N least important blocks (Layer Extraction's
importance) and spends the freed budget on IPSVD of the rest (no ``+align``); a trailing ``+fid<N>`` keeps the aligned
factors with the best ranking fidelity on N held-out pool examples (``monitor: val/fidelity_loss``) instead of the
best held-out alignment loss, ``+fidtask<N>`` those whose worst validation task ranks best (``fidelity_per_task``,
``monitor: val/fidelity_worst_loss``; the tasks are the validation file's, here the suite halves). Issue 22's levers:
``infw`` (with ``global``: ranks weighted by each layer's share of the per-task score signal, ``rank_weighting:
influence``; ``infw<λ>`` mixes λ of it with the unweighted allocation; the validation examples of the build stage,
``--align-val-per-task`` per task, give the weights), ``allprobe`` (probes of the loss over every non-pad token,
``probe_labels: all``), ``up<M>`` (ranks rounded up to a multiple of M, ``rank_rounding: up``).

Task-aware alignment suffixes (issue 22; after ``+align...``, any order, each at most once; every one of them sets
``val_train_fraction`` of the build's data, so a part of each validation task trains and the rest monitors):
``+val`` / ``+val<C>`` mixes C copies (default 1) of those validation examples into the alignment split
(``mix_val_train``); ``+valg<W>`` adds the per-task validation-gradient term with weight W (``val_grad_weight``);
``+score<W>`` the score-space term with weight W (``score_weight``, Pearson) and ``+scorelist<W>`` its listwise form
(``score_loss: listwise``); ``+data<N>`` aligns on N pool examples (``align_examples``: the probe split, and so
Stage 1, unchanged; the default alignment split is 90% of 1% of the pool, ~150 examples here); ``+kl<W>`` sets the
KL anchor's weight (``kl_weight``; ``+kl0``: none, the reference implementation's default, lever d); ``+worst`` reduces both terms by the worst task (``task_reduction: max``); ``+tv``
scores the proxy against the target's validation gradients inside Stage 2 (``proxy_validation: target``: the score
term's reference directions and the fidelity check; with ``+score<W>`` or ``+fid<N>``), as ``+tval`` scores it after; ``+vt<F>`` sets
the validation share F that trains (``val_train_fraction``, default 0.5). ``+valg`` / ``+score`` build only with
``+fidtask<N>`` (or ``+fid<N>``): ``keep_best`` refuses to judge the task terms by the held-out ``L_GA + KL``, which
does not contain them (the recorded ``+score1`` row, built before that check, kept its step-0 factors); or with
``+last``: no ``keep_best`` (``keep_best: false``), the factors of the last step, for a fixed number of steps — the
row to use when a fidelity monitor on a few held-out examples is inside its own noise. E.g.
``ipsvd/exact/rel1e-3/global@0.5+align:1e-3+val+valg1+score0.5+fidtask64``.
"""
from __future__ import annotations

import re
from typing import Any

SPARE0 = [r"layers\.0\.mlp\."]  # option spare0: block 0's MLP kept dense
TASK_SUFFIX = re.compile(r"\+(fidtask|fid|valg|val|scorelist|score|worst|vt|tv|data|kl|last)([0-9.]*(?:[eE]-?\d+)?)")
DEFAULT_VAL_TRAIN_FRACTION = 0.5
TARGET_VALIDATION = "+tval"  # score against the target's validation gradients (parse_variant)
# ``+align[EPOCHS][:LR]`` and the suffixes after it, at the end of a key: (epochs, lr, suffixes)
ALIGN_TAIL = re.compile(r"\+align(\d*)(?::([0-9.]+(?:[eE][+-]?\d+)?))?((?:\+[a-z]+[0-9.]*(?:[eE]-?\d+)?)*)$")


def parse_task_suffixes(spec: str, text: str) -> tuple[int | None, bool, dict[str, dict[str, Any]]]:
    """The suffixes after ``+align...`` (``+fid<N>`` / ``+fidtask<N>`` and the task-aware ones, module docstring) ->
    ``(fidelity, fidelity per task?, {"model": ProxyAlignModule init_args, "data": SFTDataModule init_args})``."""
    pos, seen, fidelity, fidelity_task = 0, set(), None, False
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    while pos < len(text):
        m = TASK_SUFFIX.match(text, pos)
        if m is None or (m.end() < len(text) and text[m.end()] != "+"):
            raise ValueError(f"variant {spec!r}: unknown alignment suffix {text[pos:]!r} (+fid<N>, +fidtask<N>, +val[<copies>], "
                             "+valg<W>, +score<W>, +scorelist<W>, +worst, +vt<F>, +tv, +data<N>, +kl<W>, +last)")
        name, val = m.group(1), m.group(2)
        key = {"scorelist": "score", "fidtask": "fid"}.get(name, name)
        if key in seen:
            raise ValueError(f"variant {spec!r}: +{key} given twice")
        seen.add(key)
        try:
            num = float(val) if val else None
        except ValueError:
            raise ValueError(f"variant {spec!r}: +{name}{val}: {val!r} is not a number") from None
        if name in ("fid", "fidtask"):
            if not val.isdigit():
                raise ValueError(f"variant {spec!r}: +{name} takes a number of examples, e.g. +{name}128")
            fidelity, fidelity_task = int(val), name == "fidtask"
            if fidelity == 0:
                raise ValueError(f"variant {spec!r}: +{name}0 checks nothing; leave out +{name}")
        elif name == "data":
            if not val.isdigit() or int(val) < 1:
                raise ValueError(f"variant {spec!r}: +data takes a number of alignment examples, e.g. +data600")
            data["align_examples"] = int(val)
        elif name == "val":
            if val and not val.isdigit():
                raise ValueError(f"variant {spec!r}: +val takes a number of copies, e.g. +val2")
            data["mix_val_train"] = int(val) if val else 1
            if not data["mix_val_train"]:
                raise ValueError(f"variant {spec!r}: +val0 mixes nothing; leave out +val")
        elif name == "kl":  # the KL anchor's weight (0: the reference implementation's default); not a task term
            if num is None or not num >= 0:
                raise ValueError(f"variant {spec!r}: +kl needs a weight >= 0, e.g. +kl0")
            model["kl_weight"] = num
        elif name == "last":  # no keep_best: the factors after the last step, whatever the held-out checks say
            if val:
                raise ValueError(f"variant {spec!r}: +last takes no value")
            model["keep_best"] = False
        elif name == "worst":
            if val:
                raise ValueError(f"variant {spec!r}: +worst takes no value")
            model["task_reduction"] = "max"
        elif name == "tv":  # Stage 2's proxy scores against the target's validation gradients
            if val:
                raise ValueError(f"variant {spec!r}: +tv takes no value")
            model["proxy_validation"] = "target"
        else:
            if num is None or not num > 0 or (name == "vt" and not num < 1):
                raise ValueError(f"variant {spec!r}: +{name} needs a value " + ("in (0, 1)" if name == "vt" else "> 0")
                                 + f", e.g. +{name}" + ("0.5" if name == "vt" else "1"))
            if name == "vt":
                data["val_train_fraction"] = num
            elif name == "valg":
                model["val_grad_weight"] = num
            else:
                model["score_weight"] = num
                if name == "scorelist":
                    model["score_loss"] = "listwise"
        pos = m.end()
    if "proxy_validation" in model and fidelity is None and "score_weight" not in model:
        raise ValueError(f"variant {spec!r}: +tv scores the proxy against the target's validation gradients in the "
                         "score term and the fidelity check; add +score<W> or +fid<N> / +fidtask<N>")
    if "keep_best" in model and fidelity is not None:
        raise ValueError(f"variant {spec!r}: +last keeps the last factors; +fid<N> / +fidtask<N> would choose others")
    terms = model.keys() - {"kl_weight", "proxy_validation", "keep_best"}  # what trains on the validation examples
    if "task_reduction" in model and not {"val_grad_weight", "score_weight"} & set(model):
        raise ValueError(f"variant {spec!r}: +worst reduces the task terms over tasks; add +valg<W> or +score<W>")
    if "val_train_fraction" in data and not (terms - {"task_reduction"} or "mix_val_train" in data):
        raise ValueError(f"variant {spec!r}: +vt sets the validation share that trains; add +val, +valg<W> or +score<W>")
    if terms or data.keys() - {"align_examples"}:
        data.setdefault("val_train_fraction", DEFAULT_VAL_TRAIN_FRACTION)
    return fidelity, fidelity_task, {"model": model, "data": data}


def parse_variant(spec: str) -> dict[str, Any]:
    """``le@ρ`` or ``METHOD[/OPTION...]@ρ[+align[EPOCHS][:LR][+SUFFIX...]][+tval]`` -> ``{"key", "kind", "rho",
    "align", "align_epochs", "align_lr", "fidelity", "task_align", "ipsvd": {...}}`` (``align_epochs`` / ``align_lr``
    None: ``--align-epochs`` / ``--align-lr``; ``task_align``: the ``model`` / ``data`` init_args of the task-aware
    suffixes, empty without them). A trailing ``+tval`` scores the proxy built without it (``"build_key"``) against
    the warmed target's validation gradients (``InfluenceScoringModule(validation_model=<target>)``;
    ``"target_validation": True``)."""
    s = spec.strip()
    if s.endswith(TARGET_VALIDATION):
        out = parse_variant(s[: -len(TARGET_VALIDATION)])
        if out["kind"] != "proxy" or out["ipsvd"].get("drop_blocks"):
            raise ValueError(f"variant {spec!r}: +tval needs the target's layers at the proxy's paths (not Layer "
                             "Extraction or dropped blocks)")
        return {**out, "key": s, "build_key": out["key"], "target_validation": True}
    m = ALIGN_TAIL.search(s)
    align = m is not None
    fidelity, fidelity_task, task_align = (parse_task_suffixes(spec, m.group(3)) if m else
                                           (None, False, {"model": {}, "data": {}}))
    align_epochs = int(m.group(1)) if m and m.group(1) else None
    try:
        align_lr = float(m.group(2)) if m and m.group(2) else None
    except ValueError:
        raise ValueError(f"variant {spec!r}: alignment learning rate {m.group(2)!r} is not a number") from None
    if align_lr is not None and not align_lr > 0:
        raise ValueError(f"variant {spec!r}: alignment learning rate must be > 0")
    if align_epochs == 0:
        raise ValueError(f"variant {spec!r}: +align0 aligns nothing; leave out +align")
    body, _, rho_s = (s[: m.start()] if m else s).partition("@")
    try:
        rho = float(rho_s)
    except ValueError:
        raise ValueError(f"variant {spec!r}: expected ...@RHO, e.g. 'ipsvd/exact/global@0.5+align'") from None
    if not 0 < rho < 1:
        raise ValueError(f"variant {spec!r}: sparsity must be in (0, 1)")
    method, *opts = body.split("/")
    if method == "le":
        if opts or align:
            raise ValueError(f"variant {spec!r}: Layer Extraction takes no options and has no factors to align")
        return {"key": s, "kind": "le", "rho": rho, "align": False, "align_epochs": None, "align_lr": None,
                "fidelity": None, "task_align": task_align, "ipsvd": {}}
    if method not in ("ipsvd", "svd", "random"):
        raise ValueError(f"variant {spec!r}: method must be le, ipsvd, svd or random")
    cb: dict[str, Any] = {"sparsity": rho, "method": method}
    for o in opts:
        if o in ("core", "exact"):
            cb["mode"] = o
        elif o[:3] in ("abs", "rel") and len(o) > 3:
            cb["damping_mode"] = "absolute" if o.startswith("abs") else "relative"
            cb["damping"] = float(o[3:])
        elif o == "global":
            cb["allocation"] = "global"
        elif o == "spare0":
            cb["keep_dense"] = SPARE0
        elif o[:1] == "n" and o[1:].isdigit():
            cb["num_probe_tokens"] = int(o[1:])
        elif o[:4] == "drop" and o[4:].isdigit() and int(o[4:]) > 0:
            cb["drop_blocks"] = int(o[4:])
        elif o[:4] == "infw" and (o == "infw" or re.fullmatch(r"(0?\.\d+|1(\.0*)?|0)", o[4:])):
            cb["rank_weighting"] = "influence"
            if o != "infw":
                cb["rank_weight_mix"] = float(o[4:])
        elif o == "allprobe":
            cb["probe_labels"] = "all"
        elif o[:2] == "up" and o[2:].isdigit() and int(o[2:]) > 0:
            cb.update(rank_multiple=int(o[2:]), rank_rounding="up")
        else:
            raise ValueError(f"variant {spec!r}: unknown option {o!r} (core, exact, abs<d>, rel<d>, global, spare0, "
                             "n<probe tokens>, drop<blocks>, infw[<mix>], allprobe, up<multiple>)")
    if "rank_weighting" in cb and cb.get("allocation") != "global":
        raise ValueError(f"variant {spec!r}: infw weights the global rank allocation: add /global")
    if "drop_blocks" in cb and align:
        raise ValueError(f"variant {spec!r}: a proxy with dropped blocks cannot be aligned (Stage 2 pairs proxy and "
                         "target layers by path)")
    if method == "ipsvd" and cb.get("mode", "exact") == "exact" and "allocation" not in cb:
        cb["allocation"] = "uniform"  # the variant says what it is: without /global, the same ρ in every layer
    out = {"key": s, "kind": "proxy", "rho": rho, "align": align, "align_epochs": align_epochs, "align_lr": align_lr,
           "fidelity": fidelity, "task_align": task_align, "ipsvd": cb}
    if fidelity_task:  # only when asked: the other rows' dicts (and fingerprints) stay as they were
        out["fidelity_task"] = True
    return out


def build_key(v: dict[str, Any]) -> str:
    """The key of the proxy a variant scores (its own, or the one it shares: ``+tval``)."""
    return v.get("build_key", v["key"])


def lever_base(key: str) -> str | None:
    """The row a Stage-2 lever row changes: ``key`` without its suffixes after ``+align[EPOCHS][:LR]`` (a trailing
    ``+tval`` kept), or None when it has none (``…+align2:3e-4+valg1+last+tval`` -> ``…+align2:3e-4+tval``)."""
    tval = key.endswith(TARGET_VALIDATION)
    k = key[: -len(TARGET_VALIDATION)] if tval else key
    m = ALIGN_TAIL.search(k)
    return None if m is None or not m.group(3) else k[: m.start(3)] + (TARGET_VALIDATION if tval else "")


def dir_name(key: str) -> str:
    return key.replace("/", "_").replace("@", "-at-").replace("+", "-").replace(":", "_")
