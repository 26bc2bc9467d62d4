"""Issue 12: artifacts you can trust. Each case is hit the way a user hits it (public API or CLI) and the
exact outcome is asserted: the error names the file / field / difference, or the rows carry the flag, and
nothing stale or zeroed survives."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from iprox_lightning.cli import main
from iprox_lightning.io import FingerprintMismatch
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import ScoreTable, influence_scores, tracin_scores
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import SCORES_FILE, InfluenceWriter, shard_files

sys.path.insert(0, str(Path(__file__).parent))
from test_scoring_influence import TINY, batches, collate, make_examples  # noqa: E402

NAN_TOKEN = 2  # make_examples draws tokens from [3, vocab): token 2 appears only where a test puts it


def nan_model():
    """Tiny llama whose embedding of NAN_TOKEN is NaN: examples holding it get a NaN gradient (like an fp16
    overflow), every other example is untouched."""
    m = tiny_causal_lm("llama", seed=21, dtype=torch.float64, **TINY)
    with torch.no_grad():
        m.get_input_embeddings().weight[NAN_TOKEN] = float("nan")
    return m


def poison(examples, rows):
    out = []
    for j, e in enumerate(examples):
        e = dict(e, input_ids=e["input_ids"].clone())
        if j in rows:
            e["input_ids"][0] = NAN_TOKEN  # prompt token: the whole response is NaN downstream
        out.append(e)
    return out


# ------------------------------------------------------------------------------------------------ (3) non-finite
def test_nonfinite_validation_gradient_is_an_error_naming_the_task():
    pool = make_examples(6, seed=1)
    val = poison(make_examples(6, seed=2, tasks=["mmlu", "bbh"]), rows={0})  # row 0 is an mmlu example
    with pytest.raises(ValueError, match=r"validation gradient of task\(s\) \['mmlu'\] is not finite.*no scores"):
        tracin_scores(nan_model(), batches(pool, 3), batches(val, 3), progress=False)


@pytest.mark.parametrize("method", ["tracin", "kfac"])
def test_nonfinite_example_gradient_is_flagged_not_zeroed(method):
    clean = make_examples(9, seed=3, zero_every=4)
    pool = poison(clean, rows={1, 5})
    val = make_examples(4, seed=4, tasks=["mmlu", "bbh"])
    fac = batches(make_examples(6, seed=5), 3)  # K-FAC factors from clean examples
    table = influence_scores(nan_model(), batches(pool, 3), batches(val, 3), metric=method, kfac_examples=6,
                             factor_dataloader=fac, progress=False)
    flagged = [i for i, f in zip(table.ids, table.nonfinite) if f]
    assert flagged == [pool[1]["id"], pool[5]["id"]]
    j = [table.ids.index(i) for i in flagged]
    assert np.isnan(table.scores[j]).all() and np.isnan(table.task_scores[j]).all() and not table.zero_grad[j].any()
    # every other row is exactly what scoring the clean rows alone gives (nothing else contaminated)
    rest = [e for k, e in enumerate(clean) if k not in (1, 5)]
    ref = influence_scores(nan_model(), batches(rest, 3), batches(val, 3), metric=method, kfac_examples=6,
                           factor_dataloader=fac, progress=False)
    keep = [table.ids.index(i) for i in ref.ids]
    np.testing.assert_allclose(table.scores[keep], ref.scores, rtol=1e-12, atol=1e-12)
    assert not table.nonfinite[keep].any() and list(table.zero_grad[keep]) == list(ref.zero_grad)


def _score_table_with(tmp_path, values: dict, nonfinite=()):
    ids = sorted(values)
    t = ScoreTable(ids, [values[i] for i in ids], ["t"], [[values[i]] for i in ids], [3] * len(ids),
                   [False] * len(ids), nonfinite=[i in nonfinite for i in ids])
    d = tmp_path / "scores"
    d.mkdir()
    t.save(str(d / SCORES_FILE))
    return d


def test_select_refuses_nonfinite_rows_unless_told_to_skip(tmp_path, capsys):
    d = _score_table_with(tmp_path, {"a": 0.5, "b": float("nan"), "c": 0.9, "d": float("inf"), "e": 0.1},
                          nonfinite={"b"})
    out = tmp_path / "sel.jsonl"
    with pytest.raises(ValueError) as e:
        main(["select", "--scores_path", str(d), "--k", "2", "--output", str(out)])
    msg = str(e.value)
    assert "scores.parquet: 2 row(s) have a non-finite 'score' or are flagged 'nonfinite'" in msg
    assert "'b' -> nan" in msg and "'d' -> inf" in msg and "--skip_flagged true" in msg and not out.exists()
    main(["select", "--scores_path", str(d), "--k", "2", "--output", str(out), "--skip_flagged", "true"])
    assert [json.loads(l)["id"] for l in open(out)] == ["c", "a"]  # +inf is not ranked first
    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["skipped"] == {"zero_grad": 0, "nonfinite": 2} and meta["ranked"] == 3
    assert meta["schema_version"] == 1 and meta["records"] is False
    assert "select: skipped 2 row(s) flagged 'nonfinite' (NaN/inf), e.g. ['b', 'd']" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ (2) fingerprints
POOL_A = make_examples(10, seed=11, tasks=["x", "y"])
POOL_B = make_examples(4, seed=13, tasks=["x", "y"])
VAL_A = make_examples(4, seed=12, tasks=["mmlu", "bbh"])
VAL_B = make_examples(4, seed=14, tasks=["mmlu", "bbh"])


class DM(L.LightningDataModule):
    def __init__(self, pool=POOL_A, val=VAL_A):
        super().__init__()
        self.pool, self.val = pool, val

    def predict_dataloader(self):
        return DataLoader(self.pool, batch_size=3, collate_fn=collate)

    def validation_dataloader(self):
        return DataLoader(self.val, batch_size=3, collate_fn=collate)


def score(out, dm, *, model_seed=21, overwrite=False, **kw):
    model = tiny_causal_lm("llama", seed=model_seed, dtype=torch.float64, **TINY)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[InfluenceWriter(str(out), write_every_n_batches=1, overwrite=overwrite)])
    module = InfluenceScoringModule(model, **kw)
    trainer.predict(module, datamodule=dm, return_predictions=False)
    return module


@pytest.mark.parametrize("change,field", [
    (dict(dm=DM(pool=POOL_B)), "pool.content"),
    (dict(dm=DM(val=VAL_B)), "validation.content"),
    (dict(dm=DM(), method="kfac", kfac_examples=4), "settings.method: 'tracin' -> 'kfac'"),
    (dict(dm=DM(), damping=1e-2), "settings.damping: 0.001 -> 0.01"),
    (dict(dm=DM(), kfac_split="validation"), "settings.kfac_split: 'pool' -> 'validation'"),
    (dict(dm=DM(), model_seed=22), "model.weights"),
])
def test_scoring_into_a_directory_of_other_inputs_is_refused(tmp_path, change, field):
    score(tmp_path, DM())
    before = (tmp_path / SCORES_FILE).read_bytes()
    kw = dict(change)
    dm = kw.pop("dm")
    with pytest.raises(FingerprintMismatch) as e:
        score(tmp_path, dm, **kw)
    msg = str(e.value)
    assert f"{tmp_path} holds 4 shard(s) produced from different inputs" in msg and field in msg
    assert "--trainer.callbacks.overwrite true" in msg and "new output_dir" in msg
    assert (tmp_path / SCORES_FILE).read_bytes() == before  # the old table is untouched, not mixed


def test_the_fingerprinted_scoring_settings_keep_their_fields_and_values(tmp_path):
    """The settings part of the resume fingerprint: the model's name, the ScoringConfig, the factor split and the
    loading dtype, under the same names as before the ScoringConfig existed, so older score directories resume (a
    K-FAC one with ``kfac_dtype float64``, what K-FAC summed in then; today's float32 default is recorded, so it
    never resumes one of them)."""
    expected = {"model": "LlamaForCausalLM", "method": "kfac", "normalize": True, "per_task": True, "damping": 1e-3,
                "damping_mode": "relative", "kfac_examples": 4, "kfac_split": "pool", "feature_mode": "auto",
                "target_patterns": ["q_proj"], "dtype": "float32"}
    for dtype, recorded in (("float64", {}), ("float32", {"kfac_dtype": "float32"})):
        out = tmp_path / dtype
        module = score(out, DM(), method="kfac", kfac_examples=4, target_patterns=["q_proj"], kfac_dtype=dtype)
        assert module.scoring_config() == {**expected, **recorded}
        settings = json.loads((out / "settings.json").read_text())
        assert settings["fingerprint"]["settings"] == settings["config"] == {**expected, **recorded}
        assert settings["scoring"] == {k: v for k, v in {**expected, **recorded}.items()
                                       if k not in ("model", "kfac_split", "dtype")}


def test_overwrite_starts_fresh_with_only_the_new_pool(tmp_path):
    score(tmp_path, DM())
    score(tmp_path, DM(pool=POOL_B), overwrite=True)
    table = ScoreTable.load(str(tmp_path))
    assert sorted(table.ids) == sorted(e["id"] for e in POOL_B)  # 4 rows, none of the old pool's 10
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["fingerprint"]["pool"]["n"] == 4 and settings["schema_version"] == 2


def test_shards_without_a_fingerprint_are_refused(tmp_path):
    score(tmp_path, DM())
    (tmp_path / "settings.json").unlink()
    with pytest.raises(FingerprintMismatch, match=r"already holds 4 shard\(s\) but .*settings.json records no "
                                                  r"fingerprint"):
        score(tmp_path, DM(), method="kfac", kfac_examples=4)


def test_same_inputs_resume_and_corrupt_last_shard_is_rescored(tmp_path, caplog):
    score(tmp_path, DM())
    ref = ScoreTable.load(str(tmp_path))
    last = shard_files(tmp_path)[-1]
    last_ids = pq.read_table(last).column("id").to_pylist()
    data = Path(last).read_bytes()
    Path(last).write_bytes(data[: len(data) // 2])  # a crash mid-write of a non-atomic copy
    (tmp_path / SCORES_FILE).unlink()
    m = score(tmp_path, DM())
    assert m.n_scored == len(last_ids) == 1 and m.n_skipped == len(POOL_A) - 1  # only the lost ids re-scored
    table = ScoreTable.load(str(tmp_path))
    assert table.ids == ref.ids and np.array_equal(table.scores, ref.scores)
    settings = json.loads((tmp_path / "settings.json").read_text())
    (rep,) = settings["repairs"]
    assert rep["shard"] == last and rep["moved_to"].endswith(f"shards/corrupt/{Path(last).name}")
    assert f"score shard {last} is unreadable" in caplog.text and "scored again" in caplog.text


def test_done_ids_only_reads_and_the_resume_repairs_a_torn_shard_once(tmp_path):
    """``done_ids`` is a query: a torn shard is left where it is (the directory byte for byte as before) and its ids
    are not done; the resuming writer moves it aside (``repair_shards``, recorded in ``settings.json``) and scores its
    ids again, once (no duplicate merged, every other id skipped); a second ``repair_shards`` finds nothing."""
    from iprox_lightning.io.score_dir import done_ids, repair_shards

    score(tmp_path, DM())
    ref = ScoreTable.load(str(tmp_path))
    last = shard_files(tmp_path)[-1]
    last_ids = pq.read_table(last).column("id").to_pylist()
    Path(last).write_bytes(Path(last).read_bytes()[:100])
    (tmp_path / SCORES_FILE).unlink()
    tree = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert done_ids(tmp_path) == set(ref.ids) - set(last_ids)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == tree  # nothing moved
    m = score(tmp_path, DM())
    assert m.n_scored == len(last_ids) == 1 and m.n_skipped == len(POOL_A) - 1
    table = ScoreTable.load(str(tmp_path))
    assert table.ids == ref.ids and np.array_equal(table.scores, ref.scores)
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["merge"]["duplicates_dropped"] == 0 and [r["shard"] for r in settings["repairs"]] == [last]
    assert (tmp_path / "shards" / "corrupt" / Path(last).name).exists() and not Path(last).exists()
    assert repair_shards(tmp_path) == [] and done_ids(tmp_path) == set(ref.ids)


# ------------------------------------------------------------------------------------------------ (4) proxies
@pytest.fixture
def proxy_dir(tmp_path):
    from iprox_lightning import compress_model, save_proxy

    model = tiny_causal_lm("llama", seed=3, **TINY)
    compress_model(model, None, 0.5, method="svd", progress=False)
    return save_proxy(model, None, tmp_path / "proxy", target_model="tiny"), model


def test_saved_proxy_loads_exactly_and_plain_transformers_refuses_it(proxy_dir):
    from transformers import AutoModelForCausalLM

    from iprox_lightning import load_model

    path, model = proxy_dir
    loaded, _ = load_model(str(path), tokenizer=False)
    x = torch.randint(3, 64, (2, 7))
    assert torch.equal(loaded(x).logits, model.eval()(x).logits)
    with pytest.raises(ValueError, match=r"IProX proxy.*load_proxy.*export"):
        AutoModelForCausalLM.from_pretrained(path)  # never a model with random projections; says what to do
    assert "ipx.load_proxy" in (path / "README.md").read_text()
    # the attention kernel asked for reaches a proxy as it reaches any model (scoring asks for sdpa: a proxy scored
    # beside its target runs the same kernel); the same function either way
    assert loaded.config._attn_implementation == "eager"  # load_model's default
    sdpa, _ = load_model(str(path), tokenizer=False, attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    torch.testing.assert_close(sdpa(x).logits, loaded(x).logits, rtol=1e-5, atol=1e-5)


def test_the_same_proxy_saved_twice_is_the_same_bytes(proxy_dir, tmp_path):
    """The safetensors writer orders metadata by a hash map (a different header each save); sorted, the weights
    digest a downstream stage is fingerprinted with is the same for an identical re-built proxy."""
    import hashlib

    from safetensors import safe_open

    from iprox_lightning import save_proxy
    from iprox_lightning.io.gradient_store import save_tensors

    path, model = proxy_dir
    again = save_proxy(model, None, tmp_path / "again", target_model="tiny")
    first, second = (json.loads((d / "iprox_proxy.json").read_text())["weights"] for d in (path, again))
    assert first["sha256"] == second["sha256"]
    meta = {f"k{i}": str(i) for i in range(8)}
    files = [save_tensors(tmp_path / f"t{i}.safetensors", {"a": torch.arange(6.0)}, meta) for i in range(6)]
    assert len({hashlib.sha256(f.read_bytes()).hexdigest() for f in files}) == 1
    assert b'"__metadata__":{"k0":"0","k1":"1","k2":"2"' in files[0].read_bytes()[:200]
    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata() == meta  # (read back into a hash map: its order says nothing)
        assert torch.equal(f.get_tensor("a"), torch.arange(6.0))


def test_proxy_without_manifest_is_refused(proxy_dir):
    from safetensors.torch import load_file, save_file

    from iprox_lightning import load_model
    from iprox_lightning.io.proxy import ProxyFormatError

    path, _ = proxy_dir
    (path / "iprox_proxy.json").unlink()
    with pytest.raises(ProxyFormatError, match=r"holds iprox_proxy.safetensors but no iprox_proxy.json"):
        load_model(str(path))
    # a version-1 layout (factors in model.safetensors) without its manifest: transformers would load it randomly
    save_file(load_file(path / "iprox_proxy.safetensors"), path / "model.safetensors")
    (path / "iprox_proxy.safetensors").unlink()
    with pytest.raises(ProxyFormatError, match=r"model.safetensors: holds \d+ low-rank factor tensor\(s\) .*"
                                               r"model.layers.0.mlp.down_proj.A.*has no iprox_proxy.json: loading it as a plain model would "
                                               r"give randomly initialised projections"):
        load_model(str(path))


def test_proxy_tensors_must_match_the_manifest(proxy_dir):
    from safetensors.torch import load_file, save_file

    from iprox_lightning import load_proxy
    from iprox_lightning.io.proxy import ProxyFormatError

    path, _ = proxy_dir
    man_file = path / "iprox_proxy.json"
    man = json.loads(man_file.read_text())
    name = "model.layers.0.self_attn.q_proj"
    r = man["layers"][name]["rank"]
    man["layers"][name]["rank"] = r + 1
    man_file.write_text(json.dumps(man))
    with pytest.raises(ProxyFormatError, match=rf"layer '{name}' has rank {r + 1} in the manifest, but "
                                               rf"iprox_proxy.safetensors holds {name}.A with shape \[16, {r}\]"):
        load_proxy(path)
    man["layers"][name]["rank"] = r
    man_file.write_text(json.dumps(man))
    tensors = load_file(path / "iprox_proxy.safetensors")
    tensors.pop(f"{name}.B")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "iprox_proxy.safetensors")
    with pytest.raises(ProxyFormatError, match=rf"1 missing tensor\(s\) \['{name}.B'\]; 1 unexpected tensor\(s\) "
                                               r"\['model.layers.0.extra.weight'\]"):
        load_proxy(path)


# ------------------------------------------------------------------------------------------------ (5) bad inputs
def _records(n, long_prompt_every=0):
    out = []
    for j in range(n):
        ctx = "x" * 300 if long_prompt_every and j % long_prompt_every == 0 else ""
        out.append({"id": f"r{j}", "instruction": f"say {j}", "context": ctx, "response": f"ok {j}",
                    "category": "a" if j % 2 else "b"})
    return out


def _write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_non_utf8_data_names_file_line_and_byte_offset(tmp_path, suffix):
    from iprox_lightning.data.sft import SFTDataModule
    from iprox_lightning.data.sources import DataFormatError

    recs = _records(4)
    if suffix == ".jsonl":
        lines = [json.dumps(r).encode() + b"\n" for r in recs]
        lines[2] = lines[2].replace(b"say 2", b"say \xff2")
        data = b"".join(lines)
    else:
        data = json.dumps(recs, indent=1).encode().replace(b"say 2", b"say \xff2")
    (tmp_path / f"pool{suffix}").write_bytes(data)
    offset = data.index(b"\xff")
    line = data[:offset].count(b"\n") + 1
    dm = SFTDataModule(pool=str(tmp_path / f"pool{suffix}"), validation=None, tokenizer="builtin")
    with pytest.raises(DataFormatError) as e:
        dm.setup("predict")
        dm.dataset("pool")
    assert str(e.value) == (f"{tmp_path / f'pool{suffix}'}, line {line}: invalid UTF-8 at byte offset {offset} "
                            "(bytes ff: invalid start byte); re-encode the file as UTF-8")


def _bbh_dir(root: Path, tasks=("alpha", "beta", "gamma")):
    bbh = root / "bbh"
    (bbh / "cot-prompts").mkdir(parents=True)
    (bbh / "bbh-three-shot.json").write_text(json.dumps({"alpha": "metadata, not a task"}))
    for t in tasks:
        (bbh / f"{t}.json").write_text(json.dumps({"examples": [{"input": "1+1?", "target": "2"}]}))
        (bbh / "cot-prompts" / f"{t}.txt").write_text(f"{t} task\n\nQ: 1+1?\nA: One plus one. So the answer is 2.")
    return bbh


def test_partial_bbh_directory_lists_the_missing_pieces(tmp_path):
    from iprox_lightning.data.eval_readers import EvalDataError, bbh_dropped_tasks, list_bbh_tasks
    from iprox_lightning.data.sft import SFTDataModule

    bbh = _bbh_dir(tmp_path)
    assert list_bbh_tasks(bbh) == ["alpha", "beta", "gamma"]  # bbh-three-shot.json is not a task
    (bbh / "cot-prompts" / "beta.txt").unlink()
    (bbh / "gamma.json").unlink()
    dm = SFTDataModule(pool="builtin", validation=f"eval:{tmp_path}:bbh", tokenizer="builtin", builtin_size=20)
    with pytest.raises(EvalDataError) as e:
        dm.validation_records
    assert str(e.value) == (f"{bbh}: partial BBH directory, 2 task(s) incomplete: beta: cot-prompts/beta.txt missing; "
                            "gamma: bbh/gamma.json missing (restore the files, or pass allow_partial=True to use the "
                            "complete tasks only)")
    assert list_bbh_tasks(bbh, allow_partial=True) == ["alpha"]
    assert bbh_dropped_tasks(bbh) == ["beta: cot-prompts/beta.txt missing", "gamma: bbh/gamma.json missing"]


def test_unknown_suite_name_in_eval_source(tmp_path):
    from iprox_lightning.data.sft import SFTDataModule

    _bbh_dir(tmp_path)
    dm = SFTDataModule(pool="builtin", validation=f"eval:{tmp_path}:bbh,mmmlu", tokenizer="builtin", builtin_size=20)
    with pytest.raises(ValueError) as e:
        dm.validation_records
    assert str(e.value) == (f"'eval:{tmp_path}:bbh,mmmlu': unknown suite name(s) ['mmmlu'] after the directory "
                            f"'{tmp_path}'; choose from ['mmlu', 'bbh', 'tydiqa', 'bbh-direct'] (comma-separated, e.g. "
                            f"'eval:{tmp_path}:mmlu,bbh')")


def test_truncation_drops_are_counted_and_listed_in_the_score_settings(tmp_path):
    from iprox_lightning.data.sft import SFTDataModule

    pool = _write_jsonl(tmp_path / "pool.jsonl", _records(9, long_prompt_every=4))  # r0, r4, r8 have 300-char prompts
    val = _write_jsonl(tmp_path / "val.jsonl", _records(4))
    dm = SFTDataModule(pool=str(pool), validation=str(val), tokenizer="builtin", max_length=64, truncation="right",
                       batch_size=4)
    out = tmp_path / "scores"
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[InfluenceWriter(str(out))])
    trainer.predict(InfluenceScoringModule("builtin"), datamodule=dm, return_predictions=False)
    settings = json.loads((out / "settings.json").read_text())
    assert settings["data"]["pool"] == {"read": 9, "dropped": 3, "kept": 6, "dropped_ids": ["r0", "r4", "r8"],
                                        "max_length": 64, "truncation": "right"}
    assert settings["data"]["validation"]["dropped"] == 0
    assert sorted(ScoreTable.load(str(out)).ids) == ["r1", "r2", "r3", "r5", "r6", "r7"]


DDP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from test_artifacts import DM, POOL_A, VAL_A
from test_writer_scoring import build_model
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import InfluenceWriter

if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[InfluenceWriter({out!r})])
    trainer.predict(InfluenceScoringModule(build_model()), datamodule=DM(pool=POOL_A[:1]), return_predictions=False)
"""


@pytest.mark.distributed
def test_ddp_with_fewer_examples_than_processes_says_why(tmp_path):
    import os
    import subprocess
    import textwrap

    script = tmp_path / "ddp_one.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "s"))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    # a UserInputError since issue 61 (python train.py prints it as one line; here, from Python, its traceback)
    assert ("UserInputError: the pool to score has 1 example(s) but the run has 2 processes: distributed scoring needs "
            "at least one example per process; run with at most 1 device(s) (--devices 1; for predict "
            "--trainer.devices 1)") in r.stderr
    assert "AssertionError" not in r.stderr


# ------------------------------------------------------------------------------------------------ (1) one selection format
def test_selection_file_has_one_format_read_by_its_meta(tmp_path):
    from iprox_lightning.data.sft import SFTDataModule
    from iprox_lightning.data.sources import DataFormatError

    pool = _write_jsonl(tmp_path / "pool.jsonl", _records(6))
    d = _score_table_with(tmp_path, {f"r{j}": float(j) for j in range(6)})
    with_pool, ids_only = tmp_path / "sel.jsonl", tmp_path / "ids.jsonl"
    main(["select", "--scores_path", str(d), "--k", "2", "--pool", str(pool), "--output", str(with_pool)])
    main(["select", "--scores_path", str(d), "--k", "2", "--output", str(ids_only)])
    lines = [json.loads(l) for l in open(with_pool)]
    assert [(r["id"], r["score"]) for r in lines] == [("r5", 5.0), ("r4", 4.0)] and lines[0]["response"] == "ok 5"
    assert [json.loads(l) for l in open(ids_only)] == [{"id": "r5", "score": 5.0}, {"id": "r4", "score": 4.0}]
    for path, records in ((with_pool, True), (ids_only, False)):
        meta = json.loads(Path(f"{path}.meta.json").read_text())
        assert meta["schema_version"] == 1 and meta["records"] is records
        dm = SFTDataModule(pool=str(pool), validation=None, tokenizer="builtin", selected=str(path),
                           train_split="selected")
        assert [r["instruction"] for r in dm.records("selected")] == ["say 5", "say 4"]
    # the meta says records: a line without one is an error naming the line, not a guess
    with_pool.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"id": "r4", "score": 4.0}) + "\n")
    dm = SFTDataModule(pool=str(pool), validation=None, tokenizer="builtin", selected=str(with_pool),
                       train_split="selected")
    with pytest.raises(DataFormatError, match=r"sel.jsonl, line 2: sel.jsonl.meta.json says the lines carry records, "
                                              r"but this line has no 'instruction'/'response'"):
        dm.records("selected")
