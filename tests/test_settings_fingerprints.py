"""Issue 62: one settings object per scoring run, and the fingerprints of unchanged settings unchanged.

``tests/data/settings_fingerprints.json`` was recorded by the code before the scoring settings became one object
(main at aef330d: ``InfluenceScoringModule`` / ``GradientStoreModule`` built from keywords, the metric rebuilt from
keywords in four places). For each recorded setting the code of today must compute the same scoring fingerprint
(``scoring_config`` and its digest: what a score directory's resume compares), the same factor-file fingerprint
(``fit_settings``) and the same store fingerprint (``settings``): a run recorded before the change resumes.

K-FAC / EK-FAC summed in float64 then; they sum in float32 by default since issue 64 (``kfac_dtype``). A K-FAC run
recorded then resumes with ``kfac_dtype: float64`` (the same computation: its fingerprints are the recorded ones), and
one with the new default does not reuse it (its fingerprints differ)."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest

from iprox_lightning.io.fingerprint import digest
from iprox_lightning.scoring.config import ScoringConfig
from iprox_lightning.scoring.metrics import InfluenceMetric
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.store import GradientStoreModule

RECORDED = json.loads((Path(__file__).parent / "data" / "settings_fingerprints.json").read_text())


def _as_recorded(options: dict) -> dict:
    """The options of a recorded case asking for the computation recorded then: K-FAC's float64 sums."""
    if "kfac_dtype" in InfluenceMetric.registry[options.get("method", "tracin")].uses:
        return {**options, "kfac_dtype": "float64"}
    return dict(options)


@pytest.mark.parametrize("case", RECORDED["scoring"], ids=lambda c: json.dumps(c["options"], sort_keys=True))
def test_a_scoring_run_recorded_before_resumes(case):
    options = _as_recorded(case["options"])
    module = InfluenceScoringModule("builtin", **options)
    config = module.scoring_config()
    assert config == case["scoring_config"] and digest(config) == case["digest"]
    assert module.metric.settings() == case["metric_settings"]
    assert module.metric.fit_settings() == case["fit_settings"]  # the saved factors are found again
    # the same settings given whole: one object, the same fingerprint
    whole = InfluenceScoringModule("builtin", scoring=ScoringConfig(**options))
    assert whole.scoring_config() == config
    if options != case["options"]:  # K-FAC at today's default (float32 sums): a new fingerprint, nothing reused
        today = InfluenceScoringModule("builtin", **case["options"])
        assert today.scoring_config()["kfac_dtype"] == "float32" and digest(today.scoring_config()) != case["digest"]
        assert today.metric.fit_settings() != case["fit_settings"]


@pytest.mark.parametrize("case", RECORDED["store"], ids=lambda c: json.dumps(c["options"], sort_keys=True))
def test_a_store_recorded_before_resumes_and_its_query_rebuilds_the_metric(case):
    options = _as_recorded(case["options"])
    precision = options.pop("precision", None)  # the Trainer's now (it reached the store twice before)
    module = GradientStoreModule("builtin", **options)
    if precision is not None:
        module.trainer = L.Trainer(precision=precision, accelerator="cpu", logger=False, enable_checkpointing=False,
                                   enable_progress_bar=False, enable_model_summary=False)
    settings = module.settings()
    assert settings == case["settings"] and digest(settings) == case["digest"]
    assert module.metric.fit_settings() == case["fit_settings"]
    # what query does with a store's recorded settings: the same metric, options and conventions
    again = ScoringConfig.from_settings(settings).build_metric()
    assert type(again) is type(module.metric) and again.settings() == module.metric.settings()
    assert again.fit_settings() == module.metric.fit_settings()
    if "kfac_dtype" in options:  # a K-FAC store at today's default (float32 sums): a new fingerprint, nothing reused
        today = GradientStoreModule("builtin", **{k: v for k, v in options.items() if k != "kfac_dtype"})
        assert digest(today.settings()) != case["digest"] and today.metric.fit_settings() != case["fit_settings"]
        back = ScoringConfig.from_settings(today.settings()).build_metric()
        assert back.config.kfac_dtype == "float32" and back.fit_settings() == today.metric.fit_settings()
