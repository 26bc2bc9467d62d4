"""Downstream evaluation of the paper (LESS / open-instruct conventions): MMLU 5-shot accuracy,
BBH 3-shot CoT exact match, TyDiQA GoldP 1-shot EM/F1 — as a Lightning test/validate loop with
torchmetrics (:class:`EvaluationModule` + :class:`EvalDataModule`, ``python train.py test --config
configs/evaluate.yaml``)."""
from .bbh import BBHConfig
from .datamodule import SUITES, EvalDataModule
from .metrics import (
    ExactMatch, PerTaskAccuracy, PerTaskMean, SquadF1, bbh_exact_match, extract_bbh_answer, squad_exact_match,
    squad_f1, squad_normalize,
)
from .mmlu import MMLUConfig
from .module import EvaluationModule
from .tydiqa import TyDiQAConfig

# public for the benchmarks (bench/effect.py): the one percentile bootstrap and paired gain over random, and the
# held-out evaluation a fine-tuned model is judged by
from .bootstrap import paired_gain, percentile_interval
from .heldout import evaluate_heldout, heldout_records, suite_heldout_records

__all__ = [
    "BBHConfig", "EvalDataModule", "EvaluationModule", "ExactMatch", "MMLUConfig", "PerTaskAccuracy",
    "PerTaskMean", "SUITES", "SquadF1", "TyDiQAConfig", "bbh_exact_match", "extract_bbh_answer",
    "squad_exact_match", "squad_f1", "squad_normalize",
    "paired_gain", "percentile_interval", "evaluate_heldout", "heldout_records", "suite_heldout_records",
]
