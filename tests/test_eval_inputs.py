"""Issue 14: evaluation inputs are checked before any prompt is built; TyDiQA without the GoldP dev file
is skipped with one line; relative TyDiQA file names resolve in the suite folder; hub ids fail fast."""
from __future__ import annotations

import json
import time
from typing import Optional

import pytest

from iprox_lightning.evaluation import EvalDataModule
from iprox_lightning.data.eval_readers import EvalDataError


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


# ------------------------------------------------------------------------------------- partial BBH (issue 12)
def _partial_bbh(root):
    """A BBH folder with 3 tasks: alpha complete, beta without its CoT prompt, gamma without its task file."""
    bbh = root / "bbh"
    (bbh / "cot-prompts").mkdir(parents=True)
    for t in ("alpha", "beta", "gamma"):
        (bbh / f"{t}.json").write_text(json.dumps({"examples": [{"input": f"{t} {i}?", "target": "yes"} for i in range(2)]}))
        (bbh / "cot-prompts" / f"{t}.txt").write_text(f"{t}\n\nQ: 1+1?\nA: Add. So the answer is 2.")
    (bbh / "cot-prompts" / "beta.txt").unlink()
    (bbh / "gamma.json").unlink()
    return bbh


def _test_args(d, out, *extra):
    return ["test", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out),  # not the checkout
            "--model", "iprox_lightning.evaluation.EvaluationModule", "--model.model", "builtin",
            "--model.output_dir", str(out),
            "--data", "iprox_lightning.evaluation.EvalDataModule", "--data.data_dir", str(d),
            "--data.suites", "[bbh]", "--data.batch_size", "4", "--data.bbh.max_new_tokens", "2", *extra]


def test_partial_bbh_is_an_error_naming_the_missing_files_and_the_option(tmp_path):
    from iprox_lightning.cli import main

    bbh = _partial_bbh(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(EvalDataError) as e:  # the data module's own error, not jsonargparse's Union wrapper
        main(_test_args(tmp_path, tmp_path / "out"))
    assert time.perf_counter() - t0 < 30  # at construction: no model run, no prompt built
    assert str(e.value) == (
        f"{bbh}: partial BBH directory, 2 task(s) incomplete: beta: cot-prompts/beta.txt missing; gamma: bbh/gamma.json "
        "missing (restore the files, name the tasks with bbh.tasks, or set bbh.allow_partial: true — "
        "--data.bbh.allow_partial true — to evaluate the complete tasks only; the skipped ones are recorded in the metrics)")
    assert e.value.__cause__ is None and e.value.__suppress_context__  # nothing of the wrapper is printed
    assert not (tmp_path / "out").exists()


def test_missing_tydiqa_file_through_the_cli_is_the_data_modules_error(tmp_path):
    from iprox_lightning.cli import main

    d = _eval_dir(tmp_path / "eval")
    args = _test_args(d, tmp_path / "out", "--data.suites", "[tydiqa]", "--data.tydiqa.eval_file", "nope.json")
    with pytest.raises(FileNotFoundError) as e:
        main(args)
    assert str(e.value) == (f"evaluation input not found: {d / 'tydiqa' / 'nope.json'} (set by tydiqa.eval_file; "
                            f"relative names are looked up in {d / 'tydiqa'} first)")
    assert e.value.__cause__ is None and "Union subtypes" not in str(e.value)


class Refuses:
    def __init__(self, x: int = 0):
        try:
            {}["key"]
        except KeyError as low_level:
            raise ValueError(f"x={x} is refused") from low_level  # our message, with its own cause


def test_construction_error_unwraps_only_jsonargparse_layers():
    from jsonargparse import ArgumentParser

    from iprox_lightning.commands.lightning import construction_error

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--thing", type=Optional[Refuses])
    with pytest.raises(ValueError) as e:
        parser.instantiate_classes(parser.parse_args(["--thing", f"{__name__}.Refuses", "--thing.x", "3"]))
    assert "Union subtypes" in str(e.value)  # what jsonargparse raises ...
    root = construction_error(e.value)
    assert str(root) == "x=3 is refused" and isinstance(root.__cause__, KeyError)  # ... and what the user sees
    plain = ValueError("no cause")
    assert construction_error(plain) is plain


def test_partial_bbh_opt_in_from_the_cli_records_the_skipped_tasks(tmp_path):
    from iprox_lightning.cli import main

    out = tmp_path / "out"
    _partial_bbh(tmp_path)
    main(_test_args(tmp_path, out, "--data.bbh.allow_partial", "true"))
    metrics = json.loads((out / "test_metrics.json").read_text())
    assert metrics["suites"]["bbh"]["skipped_tasks"] == ["beta: cot-prompts/beta.txt missing",
                                                          "gamma: bbh/gamma.json missing"]
    assert metrics["suites"]["bbh"]["config"]["allow_partial"] is True
    assert metrics["n_questions"] == {"bbh": 2}  # alpha's 2 questions, nothing from beta or gamma
    preds = [json.loads(l) for l in open(out / "test_predictions" / "bbh.jsonl")]
    assert sorted({p["task"] for p in preds}) == ["alpha"] and len(preds) == 2


def test_complete_bbh_records_no_skipped_task(tmp_path):
    bbh = _partial_bbh(tmp_path)
    (bbh / "gamma.json").write_text(json.dumps({"examples": [{"input": "g?", "target": "yes"}]}))
    (bbh / "cot-prompts" / "beta.txt").write_text("beta\n\nQ: 1+1?\nA: Add. So the answer is 2.")
    dm = EvalDataModule(data_dir=str(tmp_path), suites=["bbh"], tokenizer="builtin", bbh={"allow_partial": True})
    dm.setup("test")
    assert dm.suite_data["bbh"].info["skipped_tasks"] == [] and dm.suite_data["bbh"].tasks == ["alpha", "beta", "gamma"]
