"""``EvaluationModule``: runs the suites of an :class:`EvalDataModule` as a Lightning test or
validate loop.

Each batch is scored by its suite (``mmlu``: answer-letter log-likelihood; ``bbh``/``tydiqa``:
greedy generation), the suite's torchmetrics are updated, and at the end of the epoch the
metrics are logged to the Lightning logger as ``<stage>/<suite>/<metric>`` (macro average over
tasks), ``<stage>/<suite>/<metric>_micro`` and ``<stage>/<suite>/<metric>/<task>``, and written as
JSON to ``<output_dir>/<stage>_metrics.json`` with one JSONL file of predictions per suite in
``<output_dir>/<stage>_predictions/``.

Run it on one device: Lightning's distributed sampler pads evaluation data with duplicates, which
the torchmetrics would count (predictions written to disk are de-duplicated by id).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..io.atomic import open_atomic
from ..io.jsonfile import write_json
from ..io.ownership import make_owned_dir
from ..models.loading import load_model, load_tokenizer
from .datamodule import SUITES
from .metrics import flatten_results, format_results

log = logging.getLogger(__name__)
_STAGE_PREFIX = {"test": "test", "validate": "val", "fit": "val", "sanity_check": "val"}


class EvaluationModule(LightningModule):
    """Evaluate a causal LM on MMLU / BBH / TyDiQA.

    Args:
        model: a name for :func:`iprox_lightning.models.loading.load_model` (``"builtin"``, hub id,
            directory, ``.gguf`` file, IProX proxy directory) or an ``nn.Module``.
        tokenizer: tokenizer name/path or object; default: the one loaded with ``model`` (required
            when ``model`` is an ``nn.Module``).
        dtype: weights dtype when ``model`` is loaded by name.
        attn_implementation: attention kernel when ``model`` is loaded by name (``"sdpa"``, ``"eager"``).
        trust_remote_code: let a model loaded by name run code from its repository.
        output_dir: where results go (default ``<trainer.log_dir>/eval``).
        save_predictions: also write the per-question predictions.
    """

    def __init__(
        self,
        model: Union[str, nn.Module] = "builtin",
        tokenizer: Optional[Any] = None,
        dtype: str = "float32",
        attn_implementation: Optional[str] = "sdpa",
        trust_remote_code: bool = False,
        output_dir: Optional[str] = None,
        save_predictions: bool = True,
    ):
        super().__init__()

        self.model_name = model if isinstance(model, str) else type(model).__name__
        self.save_hyperparameters({"model": self.model_name, "dtype": dtype, "attn_implementation": attn_implementation})
        if isinstance(model, nn.Module):
            lm, tok = model, None
        else:
            lm, tok = load_model(
                model, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
            )
        if isinstance(tokenizer, str):
            tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
        elif tokenizer is not None:
            tok = tokenizer
        if tok is None:
            raise ValueError("EvaluationModule: pass tokenizer=... when model is an nn.Module")
        self.model = lm  # the test/validate loops run it in eval mode under inference_mode
        self.tokenizer = tok
        self.output_dir = output_dir
        self.save_predictions = save_predictions
        self.metrics = nn.ModuleDict()
        self.results: dict[str, dict[str, float]] = {}
        self._predictions: dict[str, dict[str, list[dict[str, Any]]]] = {}

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "suite_data"):
            raise ValueError("EvaluationModule needs an EvalDataModule: trainer.test(module, datamodule=EvalDataModule(...))")
        if not dm.suite_data:
            dm.setup(stage)
        if self.trainer.world_size > 1:
            rank_zero_warn(
                "EvaluationModule on several processes: the distributed sampler pads the data with duplicates "
                "that the metrics count; evaluate on one device for exact numbers."
            )
        prefix = _STAGE_PREFIX.get(stage, stage)
        prefixes = {"val", "test"} if stage == "fit" else {prefix}
        for p in prefixes:
            self.metrics[p] = nn.ModuleDict(
                {suite: nn.ModuleDict(SUITES[suite].make_metrics(data.tasks)) for suite, data in dm.suite_data.items()}
            )

    # ------------------------------------------------------------------ loop
    def _step(self, batch: dict[str, Any], prefix: str) -> None:
        suite = batch["suite"]
        records = SUITES[suite].evaluate_batch(self.model, self.tokenizer, batch, self.metrics[prefix][suite])
        self._predictions.setdefault(prefix, {}).setdefault(suite, []).extend(records)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step(batch, "test")

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step(batch, "val")

    def on_test_epoch_start(self) -> None:
        self._start("test")

    def on_validation_epoch_start(self) -> None:
        self._start("val")

    def on_test_epoch_end(self) -> None:
        self._finish("test")

    def on_validation_epoch_end(self) -> None:
        self._finish("val")

    def _start(self, prefix: str) -> None:
        self._predictions[prefix] = {}
        for suite_metrics in self.metrics[prefix].values():
            for m in suite_metrics.values():
                m.reset()

    def _finish(self, prefix: str) -> None:
        if self.trainer.sanity_checking:  # a few batches before fit: not a result
            self._start(prefix)
            return
        results: dict[str, float] = {}
        for suite, suite_metrics in self.metrics[prefix].items():
            for name, m in suite_metrics.items():
                if int(m.count.sum()) > 0:
                    results.update(flatten_results(suite, name, m.compute()))
                m.reset()
        self.results[prefix] = results
        self.log_dict({f"{prefix}/{k}": v for k, v in results.items()}, sync_dist=False, add_dataloader_idx=False)
        preds = self._gather_predictions(self._predictions.get(prefix, {}))
        if self.trainer.is_global_zero:
            self._write(prefix, results, preds)

    def _gather_predictions(self, preds: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
        if self.trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, preds)
            merged: dict[str, dict[str, dict[str, Any]]] = {}
            for part in gathered:
                for suite, recs in part.items():
                    for r in recs:
                        merged.setdefault(suite, {})[r["id"]] = r
            return {s: list(d.values()) for s, d in merged.items()}
        return preds

    def _out_dir(self) -> Path:
        if self.output_dir:
            return Path(self.output_dir)
        base = self.trainer.log_dir or self.trainer.default_root_dir
        return Path(base) / "eval"

    def _write(self, prefix: str, results: dict[str, float], preds: dict[str, list[dict[str, Any]]]) -> None:
        out = self._out_dir()
        make_owned_dir(out, "evaluation")
        dm = self.trainer.datamodule
        info = {s: {k: v for k, v in d.info.items()} for s, d in dm.suite_data.items()}
        summary = {
            "model": self.model_name,
            "stage": prefix,
            "metrics": results,
            "n_questions": {s: len(p) for s, p in preds.items()},
            "suites": info,
            "skipped": dict(getattr(dm, "skipped", {})),
        }

        write_json(out / f"{prefix}_metrics.json", summary, ensure_ascii=False)
        if self.save_predictions:
            pdir = out / f"{prefix}_predictions"
            pdir.mkdir(exist_ok=True)
            for suite, recs in preds.items():
                with open_atomic(pdir / f"{suite}.jsonl") as f:
                    for r in sorted(recs, key=lambda r: r["id"]):
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")

        rank_zero_info(format_results(results, f"evaluation ({self.model_name})"))
        rank_zero_info(f"EvaluationModule: saved the metrics to {out / f'{prefix}_metrics.json'}"
                       + (f" and the predictions to {out / f'{prefix}_predictions'}" if self.save_predictions else ""))
