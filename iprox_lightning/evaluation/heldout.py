"""The selection's effect: a fine-tuned model on held-out examples of the validation tasks.

:func:`heldout_records` draws the evaluation examples: on the built-in data, fresh examples of the
validation families from a random stream independent of the pool's and of the validation set used
for scoring (so the number is not fitted to the scoring gradients); on other data, the validation
records themselves (labelled as such: they steered the selection, so this is an in-sample check), or with
``per_task`` at most that many per task, taken first from those that did not steer it (the scoring used a
``val_per_task`` sample), the description counting how many did.

:func:`heldout_metrics` scores a model on them in one teacher-forced forward pass per batch:

* ``loss`` — mean over examples of the mean response-token cross-entropy (lower is better);
* ``exact_match`` — share of examples whose every response token (end-of-sequence included) is the
  model's argmax given the correct prefix, which is exactly "greedy decoding reproduces the
  response" (higher is better);

overall and per task (``category``).
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Collection, Sequence

import torch

from ..data import SFTDataModule
from ..data.eval_readers import read_bbh, read_mmlu, sample_per_group
from ..data.eval_validation import LETTERS
from ..data.splits import sample_per_task
from ..data.synthetic import BUILTIN_VALIDATION_FAMILIES, builtin_validation
from ..engine.batch import example_means, model_device, resolve_device, scored_logits, to_device
from ..engine.model_modes import eval_mode
from ..errors import UserInputError
from ..models.loading import load_model
from ..progress import progress

HELDOUT_SEED_OFFSET = 1000


def heldout_records(pool: Any, validation: Any, n_per_task: int = 50, seed: int = 0,
                    validation_records: Sequence[dict] | None = None, per_task: int | None = None,
                    steered: Collection[str] | None = None) -> tuple[list[dict], str]:
    """``(records, description)``: see the module doc. ``per_task`` (data other than the built-in): keep at most this
    many validation records per task (``category``), drawn with ``seed`` from those whose id is not in ``steered``
    (the validation examples the scoring used; default: all of them), topped up from the steered ones."""
    if pool == "builtin" and validation == "builtin":
        recs = builtin_validation(n_per_task, seed=HELDOUT_SEED_OFFSET + seed)
        for r in recs:
            r["id"] = r["id"].replace("builtin-val-", "builtin-heldout-")
        return recs, (f"{len(recs)} fresh built-in examples of the validation families "
                      f"{list(BUILTIN_VALIDATION_FAMILIES)} (not in the pool or the scoring validation set)")
    if validation_records is None:
        raise ValueError("heldout_records: pass validation_records for non-built-in data")
    if per_task is None:
        return list(validation_records), (f"the {len(validation_records)} validation examples (they also steered the "
                                          "selection: an in-sample check, not a held-out one)")

    used = {r["id"] for r in validation_records} if steered is None else set(steered)
    by_task: dict[str, list[dict]] = {}
    for r in validation_records:
        by_task.setdefault(r["category"], []).append(r)
    keep: set[str] = set()
    for task, recs in by_task.items():
        for part in ([r["id"] for r in recs if r["id"] not in used], [r["id"] for r in recs if r["id"] in used]):
            room = per_task - sum(r["id"] in keep for r in recs)
            if part and room > 0:
                keep.update(sample_per_task(part, [task] * len(part), room, HELDOUT_SEED_OFFSET + seed)[task])
    out = [r for r in validation_records if r["id"] in keep]
    n_in = sum(r["id"] in used for r in out)
    how = ("none of them among those that steered the selection" if not n_in else
           "they also steered the selection: an in-sample check" if n_in == len(out) else
           f"{n_in} of them also steered the selection: partly in-sample")
    return out, f"{len(out)} validation examples, at most {per_task} per task ({how})"


def suite_heldout_records(eval_dir: str, suites: Sequence[str] = ("mmlu", "bbh"), per_subtask: int = 3,
                          seed: int = 0) -> list[dict]:
    """Held-out examples of the paper's suites that never steer a selection, ``per_subtask`` per MMLU subject /
    BBH task, drawn reproducibly from ``seed``: MMLU **test** questions (the validation set holds the dev shots)
    and BBH task examples (the validation set holds the CoT-prompt exemplars). Formatted like the validation
    records, zero-shot: MMLU question + lettered choices + ``Answer:``, response the gold letter; BBH the task
    input, response the gold answer. ``category`` is the suite, ``subtask`` the subject / task."""
    out: list[dict] = []
    for suite in suites:
        root = Path(eval_dir) / suite
        if suite == "mmlu":
            for subject, qs in read_mmlu(root, split="test").items():
                for q in sample_per_group(qs, per_subtask, seed, f"heldout:mmlu:{subject}"):
                    choices = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(q.choices))
                    out.append({"id": f"heldout-{q.id.replace('/', '-')}", "instruction": f"{q.question.strip()}\n{choices}\nAnswer:",
                                "context": "", "response": LETTERS[q.answer], "category": "mmlu", "subtask": subject})
        elif suite == "bbh":
            for task, (_, exs) in read_bbh(root).items():
                for j, ex in enumerate(sample_per_group(exs, per_subtask, seed, f"heldout:bbh:{task}")):
                    out.append({"id": f"heldout-{ex.id.replace('/', '-')}", "instruction": ex.input.strip(),
                                "context": "", "response": ex.target.strip(), "category": "bbh", "subtask": task})
        else:
            raise UserInputError(f"no held-out split for suite {suite!r} here (mmlu, bbh); TyDiQA's GoldP dev file "
                                 "is not shipped: hold out pool QA examples instead")
    return out


@torch.no_grad()
def heldout_metrics(model: torch.nn.Module, batches, per_example: bool = False, desc: str | None = None,
                    total: int | None = None) -> dict[str, Any]:
    """Loss and teacher-forced exact match on SFT ``batches`` (see the module doc), on the model's device;
    ``per_example`` adds ``examples``: ``[{"id", "task", "loss", "exact_match"}]`` (for paired statistics over
    examples). ``desc``: progress lines (:func:`iprox_lightning.progress.progress`) in examples, of ``total``."""
    per_task: dict[str, list[tuple[float, bool]]] = {}
    examples: list[dict] = []
    device = model_device(model)
    bar = progress(desc=desc or "held-out evaluation", total=total, unit="example", enabled=desc is not None)
    with eval_mode(model), bar:
        for b in batches:
            b = to_device(b, device)
            logits, scored = scored_logits(model, b)  # the LM head on the answer tokens only
            ce_sum, n = scored.ce_sums(logits)
            loss = example_means(ce_sum, n)
            wrong = torch.zeros_like(n).index_add(0, scored.rows, (logits.argmax(-1) != scored.targets).long())
            exact = (wrong == 0) & (n > 0)
            ids = b.get("id") or [None] * len(b["task"])
            for i, t, l, e in zip(ids, b["task"], loss.tolist(), exact.tolist()):
                per_task.setdefault(t, []).append((l, bool(e)))
                examples.append({"id": None if i is None else str(i), "task": t, "loss": l, "exact_match": bool(e)})
            bar.update(len(b["task"]))
    allv = [v for vs in per_task.values() for v in vs]
    if not allv:
        raise ValueError("heldout_metrics: no examples")
    mean = lambda vs, k: sum(v[k] for v in vs) / len(vs)
    out = {"n": len(allv), "loss": mean(allv, 0), "exact_match": mean(allv, 1),
           "per_task": {t: {"n": len(vs), "loss": mean(vs, 0), "exact_match": mean(vs, 1)} for t, vs in per_task.items()}}
    if per_example:
        out["examples"] = examples
    return out


def evaluate_heldout(model_dir: str, records: Sequence[dict], tokenizer: str, max_length: int = 128,
                     batch_size: int = 32, per_example: bool = False, device: str = "auto",
                     precision: str | None = None) -> dict[str, Any]:
    """Load ``model_dir`` onto ``device`` (``auto``: a GPU where one is visible) and run :func:`heldout_metrics` on
    ``records`` (tokenized like training), in ``precision`` (a Trainer precision, as the training stages ran:
    ``*-true`` casts the weights to that dtype, ``*-mixed`` runs the forward under ``torch.autocast``; ``None`` or
    ``32-true``: the weights as saved)."""
    dm = SFTDataModule(pool=list(records), validation=None, tokenizer=tokenizer, max_length=max_length)
    model, _ = load_model(model_dir, tokenizer=False)
    model.to(resolve_device(device))
    name = "32-true" if precision is None else str(precision)
    half = {"bf16": torch.bfloat16, "16": torch.float16}
    kind = name.split("-")[0]
    if name in ("32-true", "32"):
        context = nullcontext()
    elif name in ("64-true", "64"):
        model, context = model.double(), nullcontext()
    elif name.endswith("-true") and kind in half:
        model, context = model.to(half[kind]), nullcontext()
    elif kind in half and name in (kind, f"{kind}-mixed"):
        context = torch.autocast(next(model.parameters()).device.type, dtype=half[kind])
    else:
        raise UserInputError(f"precision {precision!r}: the held-out evaluation runs in 32-true, 64-true, bf16-true, "
                             "16-true, bf16-mixed or 16-mixed")
    with context:
        return heldout_metrics(model, dm.records_dataloader(records, batch_size=batch_size), per_example=per_example,
                               desc=f"held-out evaluation of {model_dir}", total=len(records))
