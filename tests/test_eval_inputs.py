"""Issue 14: evaluation inputs are checked before any prompt is built; TyDiQA without the GoldP dev file
is skipped with one line; relative TyDiQA file names resolve in the suite folder; hub ids fail fast."""
from __future__ import annotations

import json
import time

import pytest

from iprox_lightning.evaluation import EvalDataModule


def _eval_dir(root, goldp=False):
    (root / "mmlu" / "dev").mkdir(parents=True)
    (root / "mmlu" / "test").mkdir()
    (root / "mmlu" / "dev" / "anatomy_dev.csv").write_text("".join(f"q{i},a,b,c,d,A\n" for i in range(5)))
    (root / "mmlu" / "test" / "anatomy_test.csv").write_text("What?,a,b,c,d,B\n")
    (root / "tydiqa").mkdir()
    shot = {"english": [{"id": "e1", "lang": "english", "context": "Paris is in France.", "question": "Where is Paris?",
                         "answers": [{"text": "France", "answer_start": 12}]}]}
    (root / "tydiqa" / "tydiqa-one-shot.json").write_text(json.dumps(shot))
    return root


def test_tydiqa_skipped_with_one_line_without_goldp(tmp_path, capsys):
    d = _eval_dir(tmp_path)
    dm = EvalDataModule(data_dir=str(d), suites=["mmlu", "tydiqa"], tokenizer="builtin")
    out = capsys.readouterr().out
    assert dm.suites == ["mmlu"] and list(dm.skipped) == ["tydiqa"]
    assert out.count("\n") == 1 and out.startswith("[evaluate] tydiqa skipped:") and "tydiqa-goldp-v1.1-dev.json" in out
    dm.setup("test")
    assert list(dm.suite_data) == ["mmlu"] and len(dm.suite_data["mmlu"].records) == 1


def test_relative_tydiqa_file_resolves_in_suite_folder_and_is_labelled(tmp_path, monkeypatch):
    d = _eval_dir(tmp_path / "eval")
    monkeypatch.chdir(tmp_path)  # the file is not in the working directory
    dm = EvalDataModule(data_dir=str(d), suites=["tydiqa"], tokenizer="builtin", tydiqa={"eval_file": "tydiqa-one-shot.json"})
    dm.setup("test")
    info = dm.suite_data["tydiqa"].info
    assert info["eval_file"] == str(d / "tydiqa" / "tydiqa-one-shot.json")
    assert info["eval_set"].startswith("SMOKE SET: the 1 one-shot exemplars")


@pytest.mark.parametrize("opts, missing", [
    ({"suites": ["mmlu"], "mmlu": {"subjects": ["astronomy"]}}, "astronomy_test.csv"),
    ({"suites": ["bbh"]}, "bbh"),
    ({"suites": ["tydiqa"], "tydiqa": {"eval_file": "nope.json"}}, "nope.json"),
])
def test_missing_inputs_fail_at_construction(tmp_path, opts, missing):
    d = _eval_dir(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=missing):
        EvalDataModule(data_dir=str(d), tokenizer="builtin", **opts)
    assert time.perf_counter() - t0 < 1.0


def test_unreachable_hub_id_fails_fast(monkeypatch):
    from iprox_lightning.models import hub
    from iprox_lightning.models.loading import load_model

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (False, "huggingface.co"))
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError, match="'nobody/no-such-model' is not a local path, not in the Hugging Face cache"):
        load_model("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="outputs/nowhere/model': no such file or directory"):
        load_model("outputs/nowhere/model")
    assert time.perf_counter() - t0 < 1.0
