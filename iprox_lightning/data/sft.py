"""``SFTDataModule``: instruction data -> the project's batch format, with the paper's splits.

Pipeline: :mod:`~iprox_lightning.data.sources` reads and validates records (files or a hub id,
field mapping, clear errors) -> :mod:`~iprox_lightning.data.splits` draws the warm-up / probe /
alignment subsets from one seed -> :mod:`~iprox_lightning.data.formatting` applies the chat (or
plain) template, masks the prompt and truncates -> :class:`SFTCollator` right-pads into the batch
format of :mod:`iprox_lightning.engine.batch` (``input_ids``, ``attention_mask``, ``labels``, ``id``,
``task``).

Splits served (``dataloader(split)``):

* ``pool`` — every pool example: the candidate pool that is scored (``predict_dataloader``);
* ``warmup`` — a random ``warmup_fraction`` of the pool;
* ``probe`` — ``probe_fraction`` of the random ``construction_fraction`` subset (IPSVD probe set);
* ``align`` — the rest of the construction subset (proxy alignment);
* ``construction`` — probe + align;
* ``fidelity`` — ``n`` further pool examples in none of the splits above (the held-out examples of
  Stage 2's ranking-fidelity check), served by ``fidelity_dataloader(n)``; empty until asked for;
* ``selected`` — the records of the file ``selected`` (the selection stage's Dolly JSONL);
* ``validation`` — the validation sets, a few examples per task, each with its task name; with
  ``val_train_fraction > 0`` only the examples that monitor (the rest of each task after ``val_train``);
* ``val_train`` — ``val_train_fraction`` of each task's validation examples, set apart for Stage 2 to train on
  (:func:`~iprox_lightning.data.splits.split_validation`: deterministic by ``seed``, spread over subtasks, at least
  one example per task left for monitoring; disjoint from ``validation``, recorded by
  :meth:`SFTDataModule.validation_split_record`). ``mix_val_train = c > 0`` adds ``c`` copies of them to the
  training loader (task-aware alignment on the examples themselves); :meth:`SFTDataModule.task_batches` serves them
  a few per task at a time (the per-task terms of ``ProxyAlignModule``). Empty (an error to ask for) when the
  fraction is 0 (default).
* ``validation`` — the validation sets, a few examples per task, each with its task name (with
  ``validation_subtasks``, ``<task>.<subtask>`` for records that name a subtask: the ``eval:`` suites' MMLU subject,
  BBH task, TyDiQA language — one score column each, so ``select --rule max --task <task>`` is LESS's max over them).

``"builtin"`` as ``pool`` / ``validation`` / ``tokenizer`` means the offline demo of
:mod:`~iprox_lightning.data.synthetic` (``builtin_size`` pool examples; ``val_per_task``
validation examples per validation family, 8 when not given). The built-in data are always
generated with data seed 0, so ``seed`` changes the splits, never the data.

Every split is read and tokenized on first use and cached; the numbers read / dropped / kept
are logged (python logging, and ``data/<split>_{read,dropped,kept,tokens}`` to the Trainer's
logger when one is attached) and kept in ``SFTDataModule.stats``.
"""
from __future__ import annotations

import itertools
import logging
import zlib
from typing import Any, Iterator, Sequence

import datasets
import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..engine.batch import IGNORE_INDEX
from ..errors import UserInputError
from ..io.records import records_digest
from ..io.selection import read_selection
from ..models.hub import check_dataset_source
from ..models.loading import load_tokenizer
from .eval_validation import eval_validation_records, parse_eval_source
from .formatting import PROMPT_TEMPLATES, TRUNCATIONS, TokenizedExample, tokenize_records
from .pool import describe, is_in_memory, read_pool
from .sources import is_hub_dataset, parse_hub_id, read_records
from .splits import PoolSplits, make_splits, sample_per_task, split_validation
from .synthetic import builtin_validation, generate_builtin_dataset

log = logging.getLogger(__name__)

SPLITS = ("pool", "warmup", "probe", "align", "construction", "fidelity", "selected", "validation", "val_train")
NOT_TRAINABLE = ("validation", "fidelity", "val_train")  # splits train_split may not name
BUILTIN = "builtin"
BUILTIN_VAL_PER_TASK = 8


class SFTDataset(Dataset):
    """Map-style dataset over :class:`TokenizedExample`; items are dicts with ``input_ids`` (int32),
    ``prompt_len``, ``id`` and ``task``."""

    def __init__(self, examples: Sequence[TokenizedExample]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        return {"input_ids": ex.input_ids, "prompt_len": ex.prompt_len, "id": ex.id, "task": ex.task}

    @property
    def ids(self) -> list[str]:
        return [ex.id for ex in self.examples]


class SFTCollator:
    """Right-pad items of :class:`SFTDataset` into the project's batch format.

    ``input_ids`` are padded with ``pad_token_id``; ``attention_mask`` is 1 on real tokens;
    ``labels`` equal ``input_ids`` on response tokens and ``-100`` on prompt and padding. The
    padded length is the longest item, rounded up to ``pad_to_multiple_of`` when given.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: Sequence[dict]) -> dict[str, Any]:
        if not items:
            raise ValueError("SFTCollator: empty batch")
        lengths = [len(it["input_ids"]) for it in items]
        T = max(lengths)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            T = (T + m - 1) // m * m
        B = len(items)
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        for b, (it, n) in enumerate(zip(items, lengths)):
            ids = torch.as_tensor(it["input_ids"], dtype=torch.long)
            input_ids[b, :n] = ids
            attention_mask[b, :n] = 1
            labels[b, it["prompt_len"] : n] = ids[it["prompt_len"] :]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "id": [it["id"] for it in items],
            "task": [it["task"] for it in items],
        }


def read_validation_sets(
    sources: str | Sequence[str],
    field_map: dict[str, str] | None = None,
    per_task: int | None = None,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """Validation records grouped by task: ``{task: [record, ...]}``.

    The task of a record is its ``category`` field (mapped with ``field_map``; the source's name
    when absent). ``per_task`` keeps at most that many records per task, drawn reproducibly with
    :func:`~iprox_lightning.data.splits.sample_per_task`.
    """
    records = read_records(sources, field_map)
    by_id = {r["id"]: r for r in records}
    groups = sample_per_task([r["id"] for r in records], [r["category"] for r in records], per_task, seed)
    return {task: [by_id[i] for i in ids] for task, ids in groups.items()}


class SFTDataModule(L.LightningDataModule):
    """Instruction data for every IProX stage (see the module doc for splits and the data schema).

    Args:
        pool: candidate pool — ``"builtin"``, a JSONL/JSON/Parquet file, a directory of them, a
            Hugging Face dataset id (``"owner/name"`` or ``"owner/name:split"``), or a list of these;
            in Python also an in-memory ``datasets.Dataset`` or list of record dicts.
        validation: validation sets (same kinds of source; task = ``category``), or ``None``.
        tokenizer: ``"builtin"``, a hub id, a local directory or a ``.gguf`` file
            (``iprox_lightning.models.loading.load_tokenizer``).
        field_map: canonical field -> source column, e.g. ``{"response": "output"}``.
        prompt_template: ``"auto"`` (chat template when the tokenizer has one), ``"chat"``, ``"plain"``.
        max_length: maximum tokens per example (longer ones are cut by the ``truncation`` rule).
        truncation: ``"prompt_left"`` (cut the prompt's start, keep the response tokens) or ``"right"`` (cut the end).
        batch_size: batch size of ``train_dataloader`` (and ``align_dataloader``).
        eval_batch_size: batch size of the other loaders (default ``batch_size``).
        seed: seed of the splits and of the training shuffle.
        num_workers: DataLoader worker processes.
        warmup_fraction: share of the pool in the warm-up split (paper: 5%).
        construction_fraction: share of the pool in the proxy-construction split (probe + alignment; paper: 1%).
        probe_fraction: share of the construction split used as IPSVD probes (paper: 10%; the rest aligns).
        align_examples: the alignment split's size, instead of the rest of the construction split (``None``); the
            probe split keeps its ids, so a larger alignment set leaves Stage 1 unchanged and holds the smaller one's
            examples first (the paper's 1% of a 270k pool is ~2,700 examples; 1% of a 16k pool, 150).
        val_per_task: keep at most this many validation examples per task (builtin default 8).
        validation_subtasks: name each validation record that has a ``subtask`` (the ``eval:`` suites: MMLU subject,
            BBH task, TyDiQA language) ``<task>.<subtask>``, so scoring gives one column per subtask and
            ``select --rule max --task <task>`` is LESS's max over the task's subtasks. ``val_per_task`` still counts
            per task. The exact scorer keeps one gradient-sized vector per column.
        train_split: what ``train_dataloader`` serves: ``warmup``, ``align``, ``probe``, ``pool``,
            ``construction`` or ``selected``.
        selected: JSONL of selected records (Dolly schema, ids kept), for ``train_split="selected"``.
        builtin_size: number of examples of the built-in pool.
        pad_to_multiple_of: round padded lengths up to a multiple of this.
        trust_remote_code: let the tokenizer (and Hugging Face data sets) run code from their repository.
        val_train_fraction: share of each task's validation examples set apart as the ``val_train`` split (Stage 2
            may train on them); the ``validation`` split (monitoring, ``keep_best``, the fidelity check) keeps the
            rest. ``0`` (default): every validation example monitors, nothing is set apart.
        mix_val_train: ``c > 0`` → the training loader serves the ``train_split`` examples plus ``c`` copies of the
            ``val_train`` examples, shuffled together (needs ``val_train_fraction > 0``); ``0`` (default): off.
    """

    def __init__(
        self,
        pool: str | list[str] = BUILTIN,
        validation: str | list[str] | None = BUILTIN,
        tokenizer: str = BUILTIN,
        field_map: dict[str, str] | None = None,
        prompt_template: str = "auto",
        max_length: int = 512,
        truncation: str = "prompt_left",
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        warmup_fraction: float = 0.05,
        construction_fraction: float = 0.01,
        probe_fraction: float = 0.1,
        val_per_task: int | None = None,
        validation_subtasks: bool = False,
        train_split: str = "pool",
        selected: str | None = None,
        builtin_size: int = 2000,
        pad_to_multiple_of: int | None = None,
        trust_remote_code: bool = False,
        val_train_fraction: float = 0.0,
        mix_val_train: int = 0,
        align_examples: int | None = None,
    ):
        super().__init__()
        if prompt_template not in PROMPT_TEMPLATES:
            raise UserInputError(f"prompt_template must be one of {PROMPT_TEMPLATES}, got {prompt_template!r}")
        if truncation not in TRUNCATIONS:
            raise UserInputError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if max_length < 2:
            raise UserInputError(f"max_length must be >= 2, got {max_length}")
        if batch_size < 1 or (eval_batch_size is not None and eval_batch_size < 1):
            raise UserInputError(f"batch sizes must be >= 1, got {batch_size}, {eval_batch_size}")
        if train_split not in SPLITS or train_split in NOT_TRAINABLE:
            raise UserInputError(f"train_split must be one of {[s for s in SPLITS if s not in NOT_TRAINABLE]}, "
                             f"got {train_split!r}")
        if not 0 <= val_train_fraction < 1:
            raise UserInputError(f"val_train_fraction must be in [0, 1), got {val_train_fraction}")
        if isinstance(mix_val_train, bool) or not isinstance(mix_val_train, int) or mix_val_train < 0:
            raise UserInputError(f"mix_val_train must be an int >= 0 (copies of the val_train examples), got {mix_val_train!r}")
        if mix_val_train and not val_train_fraction:
            raise UserInputError("mix_val_train > 0 needs val_train_fraction > 0: the validation examples to train on are "
                             "set apart from the ones that monitor")
        if train_split == "selected" and not selected:
            raise UserInputError("train_split='selected' needs `selected`: the JSONL file written by the selection stage")

        self._pool_in_memory = pool if is_in_memory(pool) else None
        self.save_hyperparameters(ignore=(["tokenizer"] if not isinstance(tokenizer, str) else [])
                                  + (["pool"] if self._pool_in_memory is not None else []))
        self.pool_sources = [] if self._pool_in_memory is not None else [pool] if isinstance(pool, str) else list(pool)
        self.validation_sources = None if validation is None else ([validation] if isinstance(validation, str) else list(validation))
        self.tokenizer_name = tokenizer
        self.field_map = field_map
        self.prompt_template = prompt_template
        self.max_length = max_length
        self.truncation = truncation
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.fractions = (warmup_fraction, construction_fraction, probe_fraction)
        self.align_examples = align_examples
        self.fidelity_examples = 0  # size of the "fidelity" split, set by fidelity_dataloader(n)
        if val_per_task is not None and (isinstance(val_per_task, bool) or val_per_task < 1):
            raise UserInputError(f"SFTDataModule: val_per_task must be >= 1 (or None: every validation example), "
                                 f"got {val_per_task!r}")
        self.val_per_task = val_per_task
        self.validation_subtasks = validation_subtasks
        self.train_split = train_split
        self.selected = selected
        if isinstance(builtin_size, bool) or not isinstance(builtin_size, int) or builtin_size < 1:
            raise UserInputError(f"builtin_size (the built-in pool's size) must be an integer >= 1, got {builtin_size!r}")
        self.builtin_size = builtin_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.trust_remote_code = trust_remote_code
        self.val_train_fraction = float(val_train_fraction)
        self.mix_val_train = mix_val_train
        self._val_split: tuple[list[str], list[str]] | None = None
        self._tokenizer = None if isinstance(tokenizer, str) else tokenizer
        self._pool_records: list[dict] | None = None
        self._splits: PoolSplits | None = None
        self._validation_records: list[dict] | None = None
        self._datasets: dict[str, SFTDataset] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.dropped_ids: dict[str, list[str]] = {}

    # ------------------------------------------------------------------ resolution
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.tokenizer_name, self.trust_remote_code)
        return self._tokenizer

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        for cand in (tok.pad_token_id, tok.eos_token_id):
            if cand is not None:
                return int(cand)
        return 0

    def _read(self, sources: list[str], builtin: Any) -> list[dict]:
        records: list[dict] = []
        for src in sources:
            records.extend(builtin() if src == BUILTIN else read_records(src, self.field_map))
        ids = [r["id"] for r in records]
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            dup = next(i for i in ids if i in seen or seen.add(i))
            raise UserInputError(f"duplicate id {dup!r} across the sources {sources}")
        return records

    @property
    def pool_records(self) -> list[dict]:
        """Canonical records of the candidate pool (in read order)."""
        if self._pool_records is None and self._pool_in_memory is not None:
            self._pool_records = read_pool(self._pool_in_memory, self.field_map)
        if self._pool_records is None:
            self._pool_records = self._read(self.pool_sources, lambda: generate_builtin_dataset(self.builtin_size, seed=0))
        return self._pool_records

    @property
    def splits(self) -> PoolSplits:
        """Ids of the warm-up / probe / align (/ fidelity) subsets and of the pool (same seed -> same ids)."""
        if self._splits is None:
            self._splits = make_splits([r["id"] for r in self.pool_records], self.seed, *self.fractions,
                                       fidelity_examples=self.fidelity_examples, align_examples=self.align_examples)
            s = self._splits
            log.info("splits (seed %d) of %d pool examples: warmup %d, probe %d, align %d, fidelity %d",
                     self.seed, len(s.pool), len(s.warmup), len(s.probe), len(s.align), len(s.fidelity))
        return self._splits

    @property
    def validation_records(self) -> list[dict]:
        """Canonical validation records, grouped by task (each ``category`` is its task name)."""
        if self.validation_sources is None:
            return []
        if self._validation_records is None:
            records: list[dict] = []
            for src in self.validation_sources:
                if src == BUILTIN:
                    records.extend(builtin_validation(self.val_per_task or BUILTIN_VAL_PER_TASK, seed=0))
                elif src.startswith("eval:"):  # the paper's suites: "eval:<dir>[:mmlu,bbh,tydiqa]"
                    eval_dir, suites = parse_eval_source(src)
                    recs = eval_validation_records(eval_dir, suites)
                    if self.val_per_task:
                        groups = sample_per_task([r["id"] for r in recs], [r["category"] for r in recs],
                                                 self.val_per_task, self.seed)
                        keep = {i for ids in groups.values() for i in ids}
                        recs = [r for r in recs if r["id"] in keep]
                    records.extend(recs)
                else:
                    for recs in read_validation_sets(src, self.field_map, self.val_per_task, self.seed).values():
                        records.extend(recs)
            ids = [r["id"] for r in records]
            if len(set(ids)) != len(ids):
                raise UserInputError(f"duplicate ids across the validation sources {self.validation_sources}")
            if self.validation_subtasks:  # after the sampling: val_per_task counts per task
                if not any(r.get("subtask") for r in records):
                    raise UserInputError(f"validation_subtasks: no validation record of {self.validation_sources} names a "
                                     "subtask (the eval:<dir> suites do: MMLU subject, BBH task, TyDiQA language)")
                records = [{**r, "category": f"{r['category']}.{r['subtask']}"} if r.get("subtask") else r
                           for r in records]
            self._validation_records = records
        return self._validation_records

    @property
    def validation_tasks(self) -> list[str]:
        return list(dict.fromkeys(r["category"] for r in self.validation_records))

    @property
    def validation_split(self) -> tuple[list[str], list[str]]:
        """``(val_train ids, monitoring ids)`` of the validation records, before tokenization drops any
        (:func:`~.splits.split_validation` with ``val_train_fraction`` and ``seed``; subtasks from the records'
        ``subtask`` field, which ``eval:`` sources keep and file sources do not — their split is then random within each
        task)."""
        if self._val_split is None:
            recs = self.validation_records
            self._val_split = split_validation([r["id"] for r in recs], [r["category"] for r in recs],
                                               self.val_train_fraction, self.seed, [r.get("subtask") for r in recs])
            if self.val_train_fraction:
                log.info("validation examples (seed %d): %d set apart for Stage 2 to train on (val_train), %d monitor",
                         self.seed, len(self._val_split[0]), len(self._val_split[1]))
        return self._val_split

    def validation_split_record(self) -> dict[str, Any]:
        """Which validation examples Stage 2 may train on and which monitor it (for the proxy manifest): the rule,
        ``fraction``, ``seed``, ``val_train_ids`` and ``monitor_ids`` (empty / every id when the fraction is 0), and
        ``mix_val_train``."""
        train, monitor = self.validation_split
        return {"fraction": self.val_train_fraction, "seed": self.seed, "mix_val_train": self.mix_val_train,
                "rule": "per task: min(n-1, max(1, round(fraction*n))) train, spread over subtasks "
                        "(iprox_lightning.data.splits.split_validation)",
                "val_train_ids": list(train), "monitor_ids": list(monitor)}

    def records(self, split: str) -> list[dict]:
        """Canonical records of ``split`` (the order of its ids)."""
        if split in ("validation", "val_train"):
            if split == "val_train" and not self.val_train_fraction:
                raise ValueError("split 'val_train' is empty: set val_train_fraction > 0 (the share of each task's "
                                 "validation examples Stage 2 may train on)")
            if not self.val_train_fraction:
                return list(self.validation_records)
            keep = set(self.validation_split[0 if split == "val_train" else 1])
            return [r for r in self.validation_records if r["id"] in keep]
        if split == "selected":
            if not self.selected:
                raise UserInputError("split 'selected' needs `selected`: the JSONL file written by the selection stage")
            return self._selected_records()
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; one of {SPLITS}")
        if split == "pool":
            return list(self.pool_records)
        if split == "fidelity" and not self.fidelity_examples:
            raise UserInputError("split 'fidelity' is empty: ask for it with fidelity_dataloader(n) "
                                 "(ProxyAlignModule(fidelity_examples=n) does)")
        by_id = {r["id"]: r for r in self.pool_records}
        return [by_id[i] for i in self.splits.get(split)]

    def _selected_records(self) -> list[dict]:
        """The selection file (:mod:`iprox_lightning.io.selection`): its records, or its ids resolved
        against this module's pool."""
        return read_selection(self.selected, lambda: self.pool_records, self.pool_sources)

    def pool_provenance(self) -> dict[str, Any]:
        """What the pool is, for the score table's settings (``"pool"``): its sources, the digest of its records
        (:func:`~iprox_lightning.io.records.records_digest`), and how to read it again (``builtin_size``,
        ``field_map``); ``select`` checks the pool it copies records from against it."""
        return {"source": describe(self._pool_in_memory if self._pool_in_memory is not None else
                                   (self.pool_sources[0] if len(self.pool_sources) == 1 else self.pool_sources)),
                "records": records_digest(self.pool_records), "builtin_size": self.builtin_size,
                "field_map": self.field_map}

    def dropped_report(self, splits: Sequence[str] = SPLITS) -> dict[str, Any]:
        """``{split: {"read", "dropped", "kept", "dropped_ids", "rule"}}`` for the tokenized splits among
        ``splits``: the examples left without a response token after truncation, by id."""
        rule = {"max_length": self.max_length, "truncation": self.truncation}
        return {sp: {**{k: self.stats[sp][k] for k in ("read", "dropped", "kept")},
                     "dropped_ids": list(self.dropped_ids.get(sp, [])), **rule}
                for sp in splits if sp in self.stats}

    def ids(self, split: str) -> list[str]:
        """Ids served by ``split`` after tokenization (dropped examples excluded)."""
        return self.dataset(split).ids

    # ------------------------------------------------------------------ datasets
    def dataset(self, split: str) -> SFTDataset:
        """The tokenized :class:`SFTDataset` of ``split`` (built once, then cached)."""
        if split not in self._datasets:
            recs = self.records(split)
            if not recs:
                where = f"the selection file {self.selected}" if split == "selected" else f"split {split!r}"
                raise UserInputError(f"{where} holds no examples: nothing to " + (
                    "train on (select kept none? check its .meta.json)" if split == "selected" else "serve"))
            examples, dropped = tokenize_records(
                recs, self.tokenizer, max_length=self.max_length, prompt_template=self.prompt_template,
                truncation=self.truncation, progress=len(recs) > 5000, desc=f"tokenizing {split}",
            )
            if not examples:
                raise UserInputError(
                    f"split {split!r}: all {len(recs)} examples were dropped (no response token left after "
                    f"truncation to max_length={self.max_length}, truncation={self.truncation!r})")
            if split == "validation" and dropped:
                self._check_no_task_vanished(recs, examples)
            self.dropped_ids[split] = list(dropped)
            self.stats[split] = {"read": len(recs), "dropped": len(dropped), "kept": len(examples),
                                 "tokens": int(sum(len(e.input_ids) for e in examples))}
            msg = "split %s: read %d, dropped %d (no response token left after truncation to %d tokens), kept %d"
            log.info(msg, split, len(recs), len(dropped), self.max_length, len(examples))
            if dropped:
                log.warning("split %s: dropped ids (first 10): %s", split, dropped[:10])
            self._log_stats(split)
            self._datasets[split] = SFTDataset(examples)
        return self._datasets[split]

    def _check_no_task_vanished(self, recs: list[dict], examples) -> None:
        """A validation task all of whose examples were dropped by truncation would leave the scoring objective without
        it (and its score column) silently: refused naming the task(s)."""
        kept = {e.task for e in examples}
        gone = sorted({str(r.get("category")) for r in recs} - kept)
        if gone:
            raise UserInputError(
                f"validation task(s) {gone}: every example was dropped (no response token left after truncation to "
                f"max_length={self.max_length}, truncation={self.truncation!r}), so the scores would leave the task "
                "out; raise max_length or use truncation='left' / shorter validation examples")

    def _log_stats(self, split: str) -> None:
        trainer = getattr(self, "trainer", None)
        logger = getattr(trainer, "logger", None) if trainer is not None else None
        if logger is None:
            return
        try:
            if trainer.is_global_zero:
                logger.log_metrics({f"data/{split}_{k}": float(v) for k, v in self.stats[split].items()}, step=0)
        except Exception as e:  # logging must never break data loading
            log.debug("could not log data stats to %s: %s", type(logger).__name__, e)

    def prepare_data(self) -> None:
        """Download hub datasets once (rank 0); local files need nothing."""
        srcs = self.pool_sources + (self.validation_sources or [])
        hub = [s for s in srcs if s != BUILTIN and not s.startswith("eval:") and is_hub_dataset(s)]
        if hub:
            for s in hub:
                name, split = parse_hub_id(s)
                check_dataset_source(name, f"data source {s!r}: data set")
                datasets.load_dataset(name, split=split)

    def setup(self, stage: str | None = None) -> None:
        """Build what ``stage`` needs: fit -> train split (+ validation), validate -> validation,
        predict -> pool; ``None`` -> all of them."""
        need = {
            "fit": [self.train_split] + (["validation"] if self.validation_sources else [])
                   + (["val_train"] if self.validation_sources and self.val_train_fraction else []),
            "validate": ["validation"] if self.validation_sources else [],
            "test": ["validation"] if self.validation_sources else [],
            "predict": ["pool"],
        }
        splits = need.get(stage, None) if stage is not None else sorted({s for v in need.values() for s in v})
        for split in splits or []:
            self.dataset(split)

    # ------------------------------------------------------------------ loaders
    def dataloader(self, split: str, shuffle: bool = False, batch_size: int | None = None) -> DataLoader:
        """A DataLoader over ``split`` in the batch format (seeded shuffle when ``shuffle``)."""
        ds = self.dataset(split)
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            ds,
            batch_size=batch_size or self.eval_batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            collate_fn=SFTCollator(self.pad_token_id, self.pad_to_multiple_of),
            persistent_workers=False,
        )

    def records_dataloader(self, records: Sequence[dict], max_length: int | None = None,
                           batch_size: int | None = None) -> DataLoader:
        """Batches of arbitrary canonical ``records`` (e.g. a fixed sample for a benchmark), tokenized
        with this module's tokenizer, template and truncation rule (``max_length`` overrides the
        module's); not shuffled. Examples left without response tokens are dropped and logged."""
        max_length = max_length or self.max_length
        examples, dropped = tokenize_records(records, self.tokenizer, max_length=max_length,
                                             prompt_template=self.prompt_template, truncation=self.truncation)
        if dropped:
            log.warning("dropped %d example(s) without response tokens: %s", len(dropped), dropped[:5])
        if not examples:
            raise UserInputError(f"no example left after tokenization to {max_length} tokens")
        return DataLoader(SFTDataset(examples), batch_size=batch_size or self.eval_batch_size, shuffle=False,
                          collate_fn=SFTCollator(self.pad_token_id, self.pad_to_multiple_of))

    def train_dataloader(self) -> DataLoader:
        if self.mix_val_train:
            return self.mixed_train_dataloader()
        return self.dataloader(self.train_split, shuffle=True, batch_size=self.batch_size)

    def mixed_train_dataloader(self) -> DataLoader:
        """The ``train_split`` examples plus ``mix_val_train`` copies of the ``val_train`` examples, shuffled together
        (seeded), batches of ``batch_size``."""
        examples = self.dataset(self.train_split).examples + self.dataset("val_train").examples * self.mix_val_train
        return DataLoader(SFTDataset(examples), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(self.seed), num_workers=self.num_workers,
                          collate_fn=SFTCollator(self.pad_token_id, self.pad_to_multiple_of), persistent_workers=False)

    def val_train_dataloader(self, batch_size: int | None = None) -> DataLoader:
        """Every ``val_train`` example (not shuffled): the validation examples Stage 2 trains on."""
        return self.dataloader("val_train", batch_size=batch_size)

    def task_batches(self, per_task: int) -> Iterator[dict]:
        """Endless batches of the ``val_train`` examples, each with ``per_task`` examples of every task (fewer when a
        task has fewer), cycling through each task's examples in an order drawn from
        ``numpy.random.default_rng([seed, crc32(task)])``: deterministic by ``seed``."""
        if per_task < 1:
            raise ValueError(f"task_batches: per_task must be >= 1, got {per_task}")
        ds = self.dataset("val_train")
        by_task: dict[str, list[int]] = {}
        for k, ex in enumerate(ds.examples):
            by_task.setdefault(ex.task, []).append(k)
        orders = {t: [idx[j] for j in np.random.default_rng([self.seed, zlib.crc32(str(t).encode("utf-8"))])
                      .permutation(len(idx))] for t, idx in by_task.items()}
        collate = SFTCollator(self.pad_token_id, self.pad_to_multiple_of)
        for step in itertools.count():
            items = []
            for t, order in orders.items():
                take = min(per_task, len(order))
                items.extend(ds[order[(step * take + j) % len(order)]] for j in range(take))
            yield collate(items)

    def val_dataloader(self):
        return self.dataloader("validation") if self.validation_sources else []

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.dataloader("pool")

    def probe_dataloader(self) -> DataLoader:
        return self.dataloader("probe")

    def align_dataloader(self, shuffle: bool = True) -> DataLoader:
        return self.dataloader("align", shuffle=shuffle, batch_size=self.batch_size)

    def fidelity_dataloader(self, n: int, batch_size: int | None = None) -> DataLoader:
        """The ``fidelity`` split: ``n`` pool examples in no other split (warm-up, probe, align), drawn from the
        same seeded permutation right after the construction subset (:func:`~.splits.make_splits`), so the other
        splits' ids do not change; not shuffled. Examples left without a response token are dropped as in every
        split. Stage 2's ranking-fidelity check (``ProxyAlignModule(fidelity_examples=n)``) reads it."""
        if n < 1:
            raise UserInputError(f"fidelity_dataloader: n must be >= 1, got {n}")
        if n != self.fidelity_examples:
            self.fidelity_examples = n
            self._splits = None  # recomputed with the fidelity slice; the other splits' ids stay the same
            self._datasets.pop("fidelity", None)
        return self.dataloader("fidelity", batch_size=batch_size)

    def validation_dataloader(self) -> DataLoader:
        """The validation sets' loader, for code that needs them (scoring, ``check``, ``report``): Lightning's
        :meth:`val_dataloader` hook returns ``[]`` without validation sets (``fit`` then skips validation), this
        one says so as an error."""
        if not self.validation_sources:
            raise UserInputError("SFTDataModule: no validation sets configured (validation=None)")
        return self.dataloader("validation")


def pool_sample_datamodule(pool: str, tokenizer: str, fraction: float, *, max_length: int, batch_size: int,
                           seed: int) -> "SFTDataModule":
    """An ``SFTDataModule`` set up for ``predict`` on ``pool`` (no validation sets) whose ``construction``
    split is a random ``fraction`` of the pool: the sample the baselines measure or fit on."""
    dm = SFTDataModule(pool=pool, validation=None, tokenizer=tokenizer, max_length=max_length,
                       batch_size=batch_size, seed=seed, construction_fraction=fraction)
    dm.setup("predict")
    return dm


def _load_tokenizer(name: str, trust_remote_code: bool = False):
    return load_tokenizer(name, trust_remote_code=trust_remote_code)
