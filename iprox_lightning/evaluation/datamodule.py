"""``EvalDataModule``: the evaluation suites as (one per suite) test / validation dataloaders.

The data module reads the public-format files (:mod:`iprox_lightning.data.eval_readers`), builds
each suite's prompts and tokenizes them with the *evaluated model's* tokenizer: pass
``tokenizer`` (a name resolved by :func:`iprox_lightning.models.loading.load_tokenizer`) or leave
it ``None`` to take ``trainer.lightning_module.tokenizer`` at ``setup`` (the
:class:`~iprox_lightning.evaluation.module.EvaluationModule` loads it in ``__init__``).

Batches are evaluation batches (left padded, see :mod:`iprox_lightning.evaluation.suite`),
ordered longest-first within a suite so padding is small and memory peaks show up at once.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any, Optional

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from ..errors import InputNotFoundError, UserInputError
from ..models.loading import load_tokenizer
from . import bbh, mmlu, tydiqa
from .bbh import BBHConfig
from .common import pad_token_id
from .inputs import check_inputs
from .mmlu import MMLUConfig
from .suite import EvalCollator, SuiteData
from .tydiqa import TyDiQAConfig

log = logging.getLogger(__name__)

SUITES = {"mmlu": mmlu, "bbh": bbh, "tydiqa": tydiqa}
_CONFIGS = {"mmlu": MMLUConfig, "bbh": BBHConfig, "tydiqa": TyDiQAConfig}
DEFAULT_SUITES = ("mmlu", "bbh", "tydiqa")


def _as_config(name: str, cfg: Any):
    cls = _CONFIGS[name]
    if cfg is None:
        return cls()
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, dict):
        unknown = set(cfg) - set(cls.__dataclass_fields__)
        if unknown:
            raise UserInputError(f"EvalDataModule: unknown {name} option(s) {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
        return cls(**cfg)
    raise TypeError(f"EvalDataModule: {name} must be a {cls.__name__} or a dict, got {type(cfg).__name__}")


class EvalDataModule(LightningDataModule):
    """MMLU / BBH / TyDiQA as Lightning test and validation dataloaders (one per suite).

    Args:
        data_dir: root holding ``mmlu/``, ``bbh/`` and ``tydiqa/`` (default: ``$IPROX_EVAL_DIR``);
            each suite's ``path`` overrides it.
        suites: which suites to run, in order (default all three).
        tokenizer: tokenizer name/path; ``None`` = the evaluated module's tokenizer.
        batch_size: prompts per batch (forward passes for MMLU, generation for BBH/TyDiQA).
        num_workers: DataLoader worker processes.
        mmlu: MMLU options (:class:`MMLUConfig` or a dict of its fields): caps, shots, chat template.
        bbh: BBH options (:class:`BBHConfig` or a dict of its fields): caps, shots, generated tokens.
        tydiqa: TyDiQA options (:class:`TyDiQAConfig` or a dict of its fields): evaluation file, caps, tokens.
        sort_by_length: order the prompts longest first, so prompts of similar length share a batch (less padding).
    """

    def __init__(
        self,
        data_dir: Optional[str] = None,
        suites: Optional[list[str]] = None,
        tokenizer: Optional[str] = None,
        batch_size: int = 4,
        num_workers: int = 0,
        mmlu: Optional[MMLUConfig] = None,
        bbh: Optional[BBHConfig] = None,
        tydiqa: Optional[TyDiQAConfig] = None,
        sort_by_length: bool = True,
    ):
        super().__init__()
        self.data_dir = data_dir if data_dir is not None else os.environ.get("IPROX_EVAL_DIR")
        self.suites = list(suites) if suites is not None else list(DEFAULT_SUITES)
        unknown = [s for s in self.suites if s not in SUITES]
        if unknown or not self.suites:
            raise UserInputError(f"EvalDataModule: unknown suite(s) {unknown}; choose from {list(SUITES)}")
        if batch_size < 1:
            raise UserInputError(f"EvalDataModule: batch_size must be >= 1, got {batch_size}")
        self.tokenizer_name = tokenizer
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.configs = {"mmlu": _as_config("mmlu", mmlu), "bbh": _as_config("bbh", bbh), "tydiqa": _as_config("tydiqa", tydiqa)}
        self.sort_by_length = sort_by_length
        self.skipped: dict[str, str] = {}
        if self.data_dir is not None or all(getattr(self.configs[s], "path", None) for s in self.suites):
            self._check_inputs()  # missing files fail here, before a model is loaded or a prompt built
        self._tokenizer: Any = None
        self._built_for: Any = None  # the tokenizer the records were built with
        self.suite_data: dict[str, SuiteData] = {}

    def _check_inputs(self) -> None:
        requested = self.__dict__.setdefault("_requested_suites", list(self.suites))
        self.suites, self.skipped = check_inputs(requested, self.configs, self.data_dir)
        for name, why in self.skipped.items():
            print(f"[evaluate] {name} skipped: {why}")
        if not self.suites:
            raise InputNotFoundError(f"EvalDataModule: every requested suite was skipped: {self.skipped}")

    # ------------------------------------------------------------------ tokenizer
    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use this tokenizer object (instead of a name or the module's)."""
        self._tokenizer = tokenizer
        self.suite_data = {}

    def _resolve_tokenizer(self) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer
        if self.tokenizer_name is not None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
            return self._tokenizer
        lm = self.trainer.lightning_module if self.trainer is not None else None
        tok = getattr(lm, "tokenizer", None)
        if tok is None:
            raise ValueError(
                "EvalDataModule has no tokenizer: pass tokenizer=<name>, call set_tokenizer(), or attach it to a "
                "Trainer whose LightningModule has a .tokenizer (e.g. EvaluationModule)"
            )
        return tok

    # ------------------------------------------------------------------ lightning hooks
    def setup(self, stage: Optional[str] = None) -> None:
        tok = self._resolve_tokenizer()
        if self.suite_data and self._built_for is tok:
            return
        self.suite_data = {}
        for name in self.suites:
            cfg = self.configs[name]
            if getattr(cfg, "path", None) is None and self.data_dir is None:
                raise UserInputError(f"EvalDataModule: no data_dir (or {name}.path) given and $IPROX_EVAL_DIR is unset")
        if "_requested_suites" not in self.__dict__:
            self._check_inputs()
        for name in self.suites:
            cfg = self.configs[name]
            data = SUITES[name].build(cfg, tok, self.data_dir)
            if not data.records:
                raise UserInputError(f"EvalDataModule: suite {name!r} has no questions after sampling")
            if self.sort_by_length:
                data.records.sort(key=lambda r: -len(r["input_ids"]))
            data.info["config"] = asdict(cfg)
            self.suite_data[name] = data
            lengths = [len(r["input_ids"]) for r in data.records]
            log.info("%s: %d questions over %d task(s), prompt tokens max %d / mean %.0f",
                     name, len(lengths), len(data.tasks), max(lengths), sum(lengths) / len(lengths))
        self._pad_id = pad_token_id(tok)
        self._built_for = tok

    @property
    def tasks(self) -> dict[str, list[str]]:
        """``{suite: task names}`` (after ``setup``)."""
        return {s: d.tasks for s, d in self.suite_data.items()}

    def _loaders(self) -> list[DataLoader]:
        if not self.suite_data:
            self.setup()
        return [
            DataLoader(
                data.records,
                batch_size=self.batch_size,
                shuffle=False,
                num_workers=self.num_workers,
                collate_fn=EvalCollator(name, self._pad_id, data.constants),
            )
            for name, data in self.suite_data.items()
        ]

    def test_dataloader(self) -> list[DataLoader]:
        return self._loaders()

    def val_dataloader(self) -> list[DataLoader]:
        return self._loaders()
