"""Issue 23.4: output a user can act on — an unreachable hub id is one line, a proxy build without alignment runs no
sanity validation and no scheduler, evaluation results are one table, a selection never silently replaces another
selector's file. (The pipeline's own output: tests/test_pipeline.py::test_pipeline_output_is_one_line_per_stage.)"""
from __future__ import annotations

import json
import warnings

import lightning as L
import pytest
from pathlib import Path

from iprox_lightning.cli import main


# ------------------------------------------------------------------------------------------------ hub ids
@pytest.fixture
def offline(monkeypatch):
    import iprox_lightning.models.hub as hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (False, "huggingface.co"))
    return hub


@pytest.mark.parametrize("flag,first", [
    ("--pool", "error: pool 'foo/bar': data set 'foo/bar' is not a local file or directory, not in the Hugging Face "
               "cache, and huggingface.co cannot be reached within 3 s: pass a local JSONL / JSON / Parquet file"),
    ("--target", "error: target model 'foo/bar' is not a local path, not in the Hugging Face cache, and "
                 "huggingface.co cannot be reached within 3 s: pass a local directory, a `.gguf` file or `builtin`"),
])
def test_unreachable_hub_id_is_one_line(offline, tmp_path, capsys, flag, first):
    with pytest.raises(SystemExit) as e:
        main(["pipeline", "--workdir", str(tmp_path / "w"), flag, "foo/bar"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(first) and err.count("\n") == 1 and "Traceback" not in err
    assert "HF_HUB_OFFLINE=1" in err and err.rstrip().endswith("(--debug shows the traceback)")
    assert not (tmp_path / "w").exists()  # refused before anything ran
    with pytest.raises(offline.SourceUnreachable):  # --debug: the exception itself, with its traceback
        main(["pipeline", "--workdir", str(tmp_path / "w"), flag, "foo/bar", "--debug"])


def test_unreachable_hub_id_in_a_stage_config_is_one_line(offline, capsys, tmp_path, monkeypatch):
    config = Path(__file__).resolve().parents[1] / "configs" / "warmup.yaml"
    monkeypatch.chdir(tmp_path)  # the config's relative output dirs land here, not in the checkout
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(config), "--model.model", "foo/bar", "--data.tokenizer", "builtin",
              "--trainer.logger", "false"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model 'foo/bar' is not a local path") and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ align=False
def test_proxy_build_without_alignment_runs_no_validation_and_no_scheduler(tmp_path):
    from test_alignment_module import SVDCompress, loader

    from iprox_lightning.models.tiny import tiny_causal_lm
    from iprox_lightning.modules import ProxyAlignModule

    module = ProxyAlignModule(target=tiny_causal_lm("llama", seed=3), align=False, lr_schedule="linear",
                              warmup_ratio=0.05, save_dir=str(tmp_path / "proxy"))
    calls = []
    module.validation_step = lambda *a, **k: calls.append(1)
    tr = L.Trainer(accelerator="cpu", devices=1, callbacks=[SVDCompress()], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, max_epochs=1)  # sanity steps: default 2
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        tr.fit(module, loader(3), val_dataloaders=loader(2, offset=100))
    assert calls == [] and tr.num_sanity_val_steps == 0
    assert not [w for w in shown if "lr_scheduler" in str(w.message)]
    assert tr.lr_scheduler_configs == []
    assert (tmp_path / "proxy" / "iprox_proxy.json").exists()


# ------------------------------------------------------------------------------------------------ evaluation table
def test_evaluation_results_are_one_table_with_full_names():
    from iprox_lightning.evaluation.metrics import format_results

    text = format_results({"mmlu/acc": 20.0, "mmlu/acc/abstract_algebra": 40.0, "mmlu/acc_micro": 20.0,
                           "bbh/em": 0.0, "bbh/em/boolean_expressions": 12.5}, "evaluation (m)")
    assert text.splitlines() == [
        "evaluation (m):",
        "  metric                         value",
        "  bbh/em                          0.00",
        "    bbh/em/boolean_expressions   12.50",
        "  mmlu/acc                       20.00",
        "  mmlu/acc_micro                 20.00",
        "    mmlu/acc/abstract_algebra    40.00",
    ]


# ------------------------------------------------------------------------------------------------ select
def test_select_never_replaces_another_selectors_file(tmp_path, capsys):
    import numpy as np

    from iprox_lightning.selection.select import select
    from iprox_lightning.scoring import ScoreTable

    ids = [f"ex-{i:03d}" for i in range(20)]
    tables = {}
    for who, seed in (("proxy", 0), ("target", 1)):
        s = np.random.default_rng(seed).normal(size=20)
        tables[who] = ScoreTable(ids, s, [], np.zeros((20, 0)), np.full(20, 5), np.zeros(20, bool)).save(
            str(tmp_path / "scores" / who / "scores.parquet"))
    out = tmp_path / "selected" / "proxy.jsonl"
    select(tables["proxy"], k=5, output=str(out))
    before = out.read_text()
    select(tables["proxy"], k=3, output=str(out))  # the same selector again: its own file, replaced
    assert len(out.read_text().splitlines()) == 3
    before = out.read_text()
    with pytest.raises(FileExistsError) as e:
        select(tables["target"], k=5, output=str(out))
    assert str(e.value) == (f"output {out} already holds the selection from {tables['proxy']}, not from "
                            f"{tables['target']}: not overwritten. Pass --output {tmp_path / 'selected' / 'target.jsonl'} "
                            "(a file of its own), or --overwrite true to replace it")
    assert out.read_text() == before
    select(tables["target"], k=5, output=str(out), overwrite=True)
    assert json.loads((tmp_path / "selected" / "proxy.jsonl.meta.json").read_text())["scores"] == tables["target"]
    # a file of unknown origin is not replaced either
    other = tmp_path / "mine.jsonl"
    other.write_text("keep me\n")
    with pytest.raises(FileExistsError, match="a file of unknown origin"):
        select(tables["proxy"], k=5, output=str(other))
    assert other.read_text() == "keep me\n"


# ------------------------------------------------------------------------------------------------ build_store
def test_build_store_prints_its_summary_line_only(tmp_path):
    """``python train.py build_store`` on the happy path: one line on stdout saying what was stored and its size,
    nothing on stderr (no Lightning "GPU available" / "TPU available" lines, no tips, no bars with --progress false),
    and ``store.json`` records the size: the shard files' bytes, per example."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{j}", "instruction": f"Reverse {'ab' * (j + 1)}", "context": "",
                                        "response": "ba" * (j + 1)}) + "\n" for j in range(5)))
    store = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run([sys.executable, "train.py", "build_store", "--model", "builtin", "--output_dir", str(store),
                        "--pool", str(pool), "--max_length", "32", "--batch_size", "2", "--method", "kfac",
                        "--kfac_examples", "3", "--progress", "false"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_store: 5 pool examples, "), r.stdout
    for noise in ("GPU available", "TPU available", "LOCAL_RANK", "Tip:", "K-FAC factors"):
        assert noise not in r.stdout
    info = json.loads((store / "store.json").read_text())
    shards = sorted((store / "shards").glob("rank*.safetensors"))
    assert info["bytes"] == sum(f.stat().st_size for f in shards) > 0
    assert info["bytes_per_example"] == info["bytes"] / 5 == info["bytes"] / info["rows"]
    assert f"({info['dtype']}; {info['bytes_per_example'] / 1024:.1f} KiB per example, " in lines[0]


# ------------------------------------------------------------------------------------------------ user errors
def _bad_pool_selection(tmp_path):
    """A score table and a pool whose second line lacks its response: what ``select --pool`` reads."""
    import numpy as np

    from iprox_lightning.scoring import ScoreTable

    ScoreTable(["a", "b", "c"], np.array([0.3, 0.2, 0.1]), [], np.zeros((3, 0)), np.full(3, 5),
               np.zeros(3, bool)).save(str(tmp_path / "scores" / "scores.parquet"))
    rows = [{"id": i, "instruction": "x", "context": "", "response": "y"} for i in "abc"]
    del rows[1]["response"]
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["select", "--scores_path", str(tmp_path / "scores"), "--k", "2", "--pool", str(pool), "--output",
            str(tmp_path / "out.jsonl")], pool


def test_a_bad_input_file_is_one_error_line_naming_file_line_and_field(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    args, pool = _bad_pool_selection(tmp_path)
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "IPROX_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "train.py", *args], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: {pool}, line 2: missing field 'response'; the record has fields "
                                     "['context', 'id', 'instruction'] (--debug shows the traceback)"]
    assert not (tmp_path / "out.jsonl").exists()


def test_user_errors_keep_their_traceback_with_debug_and_bugs_always(tmp_path, monkeypatch, capsys):
    """On the command line (``main()`` reading ``sys.argv``): a user error is one line; ``--debug`` or
    ``IPROX_DEBUG=1`` raise it (the traceback); a plain ``ValueError`` — a bug, not an input check — is never
    turned into a line. From Python (``main([...])``) a user error is raised to the caller."""
    import sys

    from importlib import import_module

    select_command = import_module("iprox_lightning.selection.select")  # the module (the package exports the function)
    from iprox_lightning.errors import UserError, UserInputError
    from iprox_lightning.io.records import DataFormatError

    args, pool = _bad_pool_selection(tmp_path)
    monkeypatch.delenv("IPROX_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {pool}, line 2: missing field 'response'") and err.count("\n") == 1
    monkeypatch.setattr(sys, "argv", ["train.py", *args, "--debug"])
    with pytest.raises(DataFormatError, match="line 2: missing field 'response'"):
        main()
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.setenv("IPROX_DEBUG", "1")
    with pytest.raises(DataFormatError):
        main()
    monkeypatch.delenv("IPROX_DEBUG")
    with pytest.raises(DataFormatError):  # from Python: raised to the caller
        main(args)
    assert issubclass(DataFormatError, UserInputError) and issubclass(UserInputError, ValueError)

    def buggy(scores_path: str, k: int = 1, pool: str = "", output: str = ""):
        """A selection with a bug.

        Args:
            scores_path: the score table.
            k: how many.
            pool: the pool.
            output: the output.
        """
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(select_command, "select", buggy)
    with pytest.raises(ValueError, match="an internal invariant broke") as e:
        main()
    assert not isinstance(e.value, UserError)
    assert capsys.readouterr().err == ""
