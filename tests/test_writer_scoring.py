"""InfluenceScoringModule + InfluenceWriter through a real Trainer: single process vs the function
API, resume after a crash, settings check, and DDP (2 gloo processes) vs single process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import ScoreTable, influence_scores
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import SCORES_FILE, InfluenceWriter, shard_files

sys.path.insert(0, str(Path(__file__).parent))
from test_scoring_influence import TINY, collate, make_examples  # noqa: E402

POOL = make_examples(17, seed=11, zero_every=6, tasks=["a", "b", "c"])
VAL = make_examples(5, seed=12, tasks=["mmlu", "bbh"])


class TinyDM(L.LightningDataModule):
    def __init__(self, bs: int = 3):
        super().__init__()
        self.bs = bs

    def dataloader(self, split: str):
        data = {"pool": POOL, "validation": VAL}[split]
        return DataLoader(data, batch_size=self.bs, collate_fn=collate)

    def predict_dataloader(self):
        return self.dataloader("pool")

    def validation_dataloader(self):
        return self.dataloader("validation")


def build_model():
    return tiny_causal_lm("llama", seed=21, dtype=torch.float64, **TINY)


def reference(method="tracin", kfac_examples=8):
    dm = TinyDM()
    return influence_scores(build_model(), dm.predict_dataloader(), dm.validation_dataloader(), metric=method,
                            kfac_examples=kfac_examples, progress=False)


def make_trainer(callbacks, **kw):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)


def assert_table_equal(table: ScoreTable, ref: ScoreTable, rtol=1e-9):
    assert sorted(table.ids) == sorted(ref.ids) and len(set(table.ids)) == len(table.ids)
    assert table.task_names == ref.task_names
    order = [table.ids.index(i) for i in ref.ids]
    np.testing.assert_allclose(table.scores[order], ref.scores, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(table.task_scores[order], ref.task_scores, rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(table.n_tokens[order], ref.n_tokens)
    np.testing.assert_array_equal(table.zero_grad[order], ref.zero_grad)
    assert [table.tasks[j] for j in order] == ref.tasks


@pytest.mark.parametrize("method,inference_mode", [("tracin", True), ("kfac", False)])
def test_module_and_writer_match_function(tmp_path, method, inference_mode):
    module = InfluenceScoringModule(build_model(), method=method, kfac_examples=8)
    writer = InfluenceWriter(str(tmp_path), write_every_n_batches=2)
    make_trainer([writer], inference_mode=inference_mode).predict(module, datamodule=TinyDM(), return_predictions=False)
    assert len(shard_files(tmp_path)) == 3  # 6 batches, a shard every 2
    table = ScoreTable.load(str(tmp_path / SCORES_FILE))
    assert_table_equal(table, reference(method))
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["config"]["method"] == method and settings["merge"]["rows"] == len(POOL)
    assert settings["scoring"] == {"method": method, "normalize": True, "per_task": True, "damping": 1e-3,
                                   "damping_mode": "relative", "kfac_examples": 8, "feature_mode": "auto",
                                   "target_patterns": None,  # the module's ScoringConfig, verbatim
                                   **({"kfac_dtype": "float32"} if method == "kfac" else {})}
    assert settings["scorer"]["task_names"] == ["bbh", "mmlu"] and settings["scorer"]["val_counts"] == [2, 3]
    cols = pq.read_table(tmp_path / SCORES_FILE).column_names
    assert cols == ["id", "score", "score_max", "score/bbh", "score/mmlu", "n_tokens", "zero_grad", "nonfinite", "task"]


class Crash(L.Callback):
    def __init__(self, after: int):
        self.after = after

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if batch_idx + 1 == self.after:
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize("flush_on_exception", [False, True])
def test_resume_after_crash_scores_each_id_once(tmp_path, flush_on_exception):
    m1 = InfluenceScoringModule(build_model())
    w1 = InfluenceWriter(str(tmp_path), write_every_n_batches=2, flush_on_exception=flush_on_exception)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer([w1, Crash(after=3)]).predict(m1, datamodule=TinyDM(), return_predictions=False)
    written = 9 if flush_on_exception else 6  # 3 batches of 3; without the flush the 3rd batch is lost
    assert w1.rows_written == written and not (tmp_path / SCORES_FILE).exists()

    m2 = InfluenceScoringModule(build_model())
    w2 = InfluenceWriter(str(tmp_path), write_every_n_batches=2)
    make_trainer([w2]).predict(m2, datamodule=TinyDM(), return_predictions=False)
    assert m2.n_skipped == written and m2.n_scored == len(POOL) - written  # nothing scored twice
    table = ScoreTable.load(str(tmp_path / SCORES_FILE))
    assert_table_equal(table, reference())  # nothing lost
    assert json.loads((tmp_path / "settings.json").read_text())["merge"]["duplicates_dropped"] == 0


def test_resume_with_other_settings_is_refused(tmp_path):
    make_trainer([InfluenceWriter(str(tmp_path))]).predict(InfluenceScoringModule(build_model()), datamodule=TinyDM(),
                                                           return_predictions=False)
    with pytest.raises(ValueError, match=r"produced from different inputs(.|\n)*settings.method: 'tracin' -> 'kfac'"):
        make_trainer([InfluenceWriter(str(tmp_path))]).predict(
            InfluenceScoringModule(build_model(), method="kfac"), datamodule=TinyDM(), return_predictions=False)


def test_proxy_scored_against_a_saved_target_through_the_trainer(tmp_path):
    """``validation_model`` as a directory (the CLI's form): the written table equals the function API's, the
    fingerprint holds the validation model, and resuming with another one is refused."""
    from test_scoring_influence import make_proxy

    from iprox_lightning.models.loading import load_model

    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    target.save_pretrained(tmp_path / "target")
    dm = TinyDM()
    loaded, _ = load_model(str(tmp_path / "target"), dtype="float32", tokenizer=False)  # as the module loads it
    ref = influence_scores(make_proxy("llama", seed=0), dm.predict_dataloader(), dm.validation_dataloader(),
                           progress=False, validation_model=loaded)
    out = tmp_path / "scores"
    module = InfluenceScoringModule(make_proxy("llama", seed=0), validation_model=str(tmp_path / "target"))
    make_trainer([InfluenceWriter(str(out))]).predict(module, datamodule=TinyDM(), return_predictions=False)
    # float32 validation model: the loader's attention kernel may differ from the reference's (rounding only)
    assert_table_equal(ScoreTable.load(str(out / SCORES_FILE)), ref, rtol=1e-6)
    settings = json.loads((out / "settings.json").read_text())
    assert settings["scorer"]["validation_model"] == "other"
    assert settings["config"]["validation_model"] == str(tmp_path / "target")
    other = tmp_path / "other"
    tiny_causal_lm("llama", seed=1, dtype=torch.float64, **TINY).save_pretrained(other)
    with pytest.raises(ValueError, match=r"produced from different inputs(.|\n)*validation_model"):
        make_trainer([InfluenceWriter(str(out))]).predict(
            InfluenceScoringModule(make_proxy("llama", seed=0), validation_model=str(other)),
            datamodule=TinyDM(), return_predictions=False)


DDP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from test_writer_scoring import TinyDM, build_model
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import InfluenceWriter

if __name__ == "__main__":
    method = sys.argv[1]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[InfluenceWriter({out!r}, write_every_n_batches=1)])
    trainer.predict(InfluenceScoringModule(build_model(), method=method, kfac_examples=8), datamodule=TinyDM(),
                    return_predictions=False)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["kfac"])
def test_ddp_two_processes_equal_single_process(tmp_path, method):
    out = tmp_path / "scores"
    script = tmp_path / "ddp_score.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    r = subprocess.run([sys.executable, str(script), method], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = {Path(f).name[:7] for f in shard_files(out)}
    assert ranks == {"rank000", "rank001"}  # both ranks scored a share
    table = ScoreTable.load(str(out / SCORES_FILE))
    assert_table_equal(table, reference(method), rtol=1e-5)


def test_checkpoint_pass_shards_are_read_back_count_for_the_fingerprint_and_are_cleared(tmp_path):
    """``checkpoints_in_turn``'s pass shards (``io/score_dir.py``): read back one row per id (the first written), in
    the run's task columns (others refused); a directory holding only them is still checked against its fingerprint
    (none recorded: refused); ``overwrite`` clears them with the rest."""
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.io.fingerprint import FingerprintMismatch
    from iprox_lightning.io.ownership import make_owned_dir
    from iprox_lightning.io.score_dir import (
        PASSES_DIR, check_fingerprint, checkpoint_pass_dir, clear_output, read_pass_rows, write_pass_shard,
    )

    def rows(ids, base):
        n = len(ids)
        return {"id": ids, "score": base + np.arange(n, dtype=np.float64), "task_names": ["a", "b"],
                "task_scores": base + np.arange(2 * n, dtype=np.float64).reshape(n, 2), "n_tokens": np.ones(n, int),
                "zero_grad": np.array([False] * (n - 1) + [True]), "nonfinite": np.zeros(n, bool), "task": None}

    make_owned_dir(tmp_path, "scores")
    d = checkpoint_pass_dir(tmp_path, 2)
    write_pass_shard(d, [rows(["x", "y"], 0.0)], 0, "r1", 0)
    write_pass_shard(d, [rows(["y", "z"], 10.0)], 1, "r1", 0)  # "y" again (another rank's repeated example)
    got = read_pass_rows(d, ["a", "b"])
    assert got["ids"] == ["x", "y", "z"]
    np.testing.assert_array_equal(got["score"], [0.0, 1.0, 11.0])
    np.testing.assert_array_equal(got["task_scores"], [[0, 1], [2, 3], [12, 13]])
    np.testing.assert_array_equal(got["zero_grad"], [False, True, True])
    with pytest.raises(UserInputError, match="other score columns than this run's tasks"):
        read_pass_rows(d, ["a"])
    with pytest.raises(FingerprintMismatch, match="2 shard"):
        check_fingerprint(tmp_path, {"model": "m"}, hint="start fresh")
    clear_output(tmp_path)
    assert not (tmp_path / PASSES_DIR).exists()
    check_fingerprint(tmp_path, {"model": "m"}, hint="start fresh")  # nothing left to resume


def test_an_unreadable_checkpoint_pass_shard_is_skipped_and_left_in_place(tmp_path, caplog):
    """A pass shard truncated by a stop: its rows are not read back (scored again), the file stays where it is (every
    rank reads the directory: none moves a file another may be reading), with a warning naming it."""
    from iprox_lightning.io.score_dir import SHARD_DIR, checkpoint_pass_dir, read_pass_rows

    d = checkpoint_pass_dir(tmp_path, 1)
    (d / SHARD_DIR).mkdir(parents=True)
    bad = d / SHARD_DIR / "rank000-r-00000.parquet"
    bad.write_bytes(b"PAR1 truncated")
    with caplog.at_level("WARNING"):
        got = read_pass_rows(d, ["a"])
    assert got["ids"] == [] and got["task_scores"].shape == (0, 1) and bad.exists()
    assert str(bad) in caplog.text
