"""Issue 24: inputs a careful or a hostile user gives that used to exit 0 with wrong, lost or mislabelled output,
or stop with a raw traceback. Each test goes through the command line (``iprox_lightning.cli.main``) or the public
Python API, as a user hits it."""
from __future__ import annotations

import json
import re
import logging
import sys
from pathlib import Path

import pytest

from iprox_lightning.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(n, prefix="r"):
    return [{"id": f"{prefix}{j}", "instruction": f"say {j}", "context": "", "response": f"ok {j}",
             "category": "a" if j % 2 else "b"} for j in range(n)]


def _write_jsonl(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ------------------------------------------------------------------------------------------------ hidden files
def test_directory_pool_skips_hidden_files_and_folders_and_says_how_many(tmp_path, caplog):
    """A Jupyter checkpoint (``.ipynb_checkpoints/``) or a dotfile next to the data is not data."""
    from iprox_lightning.data.sft import SFTDataModule

    pool = tmp_path / "pool"
    _write_jsonl(pool / "data.jsonl", _records(4))
    _write_jsonl(pool / ".ipynb_checkpoints" / "data-checkpoint.jsonl", _records(2))  # an older copy: same ids
    _write_jsonl(pool / ".scratch.jsonl", _records(3, prefix="x"))
    dm = SFTDataModule(pool=str(pool), validation=None, tokenizer="builtin")
    with caplog.at_level(logging.WARNING):
        recs = dm.pool_records
    assert [r["id"] for r in recs] == ["r0", "r1", "r2", "r3"]
    assert "skipped 2 hidden file(s)" in caplog.text and ".ipynb_checkpoints/data-checkpoint.jsonl" in caplog.text


# ------------------------------------------------------------------------------------------------ one scoring run per dir
ROOT = Path(__file__).resolve().parents[1]


def _score_args(out, tmp_path):
    return ["predict", "--config", str(ROOT / "configs/score.yaml"), "--config", str(ROOT / "configs/builtin/score.yaml"),
            "--model.init_args.model", "builtin", "--data.init_args.tokenizer", "builtin",
            "--data.init_args.builtin_size", "24", "--data.init_args.batch_size", "12",
            "--data.init_args.val_per_task", "1", "--trainer.logger", "false",
            "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks.output_dir", str(out), "--trainer.callbacks.write_every_n_batches", "1"]


def paused_scoring(args):
    """Run ``python train.py <args>`` and pause after the first written shard until stdin gets a line (a scoring
    run caught in the middle)."""
    import sys

    from iprox_lightning.scoring.writer import InfluenceWriter

    write = InfluenceWriter.write_on_batch_end

    def pausing(self, *a, **k):
        write(self, *a, **k)
        if not getattr(self, "_paused", False):
            self._paused = True
            print("\n<paused>", flush=True)
            sys.stdin.readline()

    InfluenceWriter.write_on_batch_end = pausing
    main(args)


def test_two_scoring_runs_into_one_directory(tmp_path):
    """Two writers into one score directory: a run started while another is scoring there stops naming the
    directory and the other's pid (before: both exited 0 and merged each other's shards); once the first has died
    (killed mid-run, its lock file left on disk) the directory is free again and the run resumes its shards."""
    import os
    import subprocess
    import sys

    from iprox_lightning.io.score_dir import OutputLocked
    from iprox_lightning.scoring import ScoreTable

    out = tmp_path / "scores"
    args = _score_args(out, tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                               f"from test_hostile_inputs import paused_scoring; paused_scoring({args!r})"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in first.stdout:  # the progress bar writes to stdout too
            if line.strip() == "<paused>":
                break
        else:
            pytest.fail("the first scoring run ended before it paused")
        with pytest.raises(OutputLocked, match=rf"^{out} is being written by another scoring run \(pid {first.pid} on "
                                               rf"host .*lock file {out}/.scoring.lock\).*another output_dir"):
            main(args)
        assert not (out / "scores.parquet").exists()
    finally:
        first.kill()  # a crash: the kernel releases its lock, its lock file stays
        first.wait(timeout=60)
    assert json.loads((out / ".scoring.lock").read_text())["pid"] == first.pid
    main(args)
    settings = json.loads((out / "settings.json").read_text())
    assert len(ScoreTable.load(str(out)).ids) == 24 and settings["merge"]["duplicates_dropped"] == 0
    assert (out / ".scoring.lock").read_text() == ""  # released


# ------------------------------------------------------------------------------------------------ one huge record
def _counting_tokenizer():
    """The built-in tokenizer, recording the longest text it was asked to tokenize or render."""
    from iprox_lightning.models.builtin import builtin_tokenizer

    tok = builtin_tokenizer()
    base = type(tok)

    class Counting(base):
        longest = 0

        def __call__(self, text, *a, **k):
            texts = [text] if isinstance(text, str) else list(text)
            Counting.longest = max([Counting.longest] + [len(t) for t in texts])
            return base.__call__(self, text, *a, **k)

        def apply_chat_template(self, conversation, *a, **k):
            Counting.longest = max([Counting.longest] + [len(m["content"]) for m in conversation])
            return base.apply_chat_template(self, conversation, *a, **k)

    tok.__class__ = Counting
    return tok


@pytest.mark.parametrize("template,truncation", [("chat", "prompt_left"), ("plain", "right")])
def test_a_huge_record_is_cut_before_it_is_tokenized(tmp_path, monkeypatch, template, truncation):
    """One 400 kB field (a 50 MB line used to peak at ~19 GB): the tokenizer never sees more than max_length × 64
    characters of it, and the kept tokens are those of the uncut text."""
    from iprox_lightning.data import formatting
    from iprox_lightning.data.sft import SFTDataModule

    big = "".join("abcdefghij klmnopqrst"[j % 21] for j in range(400_000))
    recs = _records(3)
    recs[0]["context"] = big + " END OF CONTEXT"
    recs[1]["response"] = "START OF RESPONSE " + big
    recs.append({"id": "chat", "category": "b", "messages": [{"role": "user", "content": big + " question?"},
                                                              {"role": "assistant", "content": "answer " + big}]})
    pool = _write_jsonl(tmp_path / "pool.jsonl", recs)

    def tokenized(bound):
        monkeypatch.setattr(formatting, "CHARS_PER_TOKEN_BOUND", bound)
        tok = _counting_tokenizer()
        type(tok).longest = 0
        dm = SFTDataModule(pool=str(pool), validation=None, tokenizer=tok, max_length=128, prompt_template=template,
                           truncation=truncation)
        ds = dm.dataset("pool")
        return {ex.id: (ex.input_ids.tolist(), ex.prompt_len) for ex in ds.examples}, type(tok).longest

    got, longest = tokenized(64)
    assert longest <= 128 * 64 + 100  # the field's bound plus the template's own text
    want, longest_uncut = tokenized(10**9)
    assert longest_uncut > 400_000
    assert got == want
    # "right" keeps the prompt's start: a 400 kB prompt leaves no room for the response
    assert set(got) == ({"r0", "r1", "r2", "chat"} if truncation == "prompt_left" else {"r1", "r2"})


# ------------------------------------------------------------------------------------------------ endless chat template
def test_a_chat_template_that_never_ends_stops_naming_the_tokenizer(tmp_path, monkeypatch):
    from iprox_lightning.data import formatting
    from iprox_lightning.data.sft import SFTDataModule
    from iprox_lightning.models.builtin import builtin_tokenizer

    monkeypatch.setattr(formatting, "CHAT_TEMPLATE_SECONDS", 1.0)
    tok = builtin_tokenizer()
    tok.name_or_path = "my-org/looping-template"
    tok.chat_template = ("{% for i in range(99999) %}{% for j in range(99999) %}{% for k in range(99999) %}"
                         "{% endfor %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}")
    pool = _write_jsonl(tmp_path / "pool.jsonl", _records(3))
    dm = SFTDataModule(pool=str(pool), validation=None, tokenizer=tok, max_length=64)
    with pytest.raises(ValueError, match=r"the chat template of tokenizer 'my-org/looping-template' did not finish "
                                         r"rendering example 'r0' within 1 s .*prompt_template='plain'"):
        dm.dataset("pool")
    # the plain template is the way out; a well-behaved template renders as before
    assert SFTDataModule(pool=str(pool), validation=None, tokenizer=tok, max_length=64,
                         prompt_template="plain").dataset("pool").ids == ["r0", "r1", "r2"]


def test_the_chat_template_time_limit_also_holds_outside_the_main_thread():
    import threading

    from iprox_lightning.data.formatting import call_with_time_limit

    out = {}

    def worker():
        try:
            call_with_time_limit(lambda: threading.Event().wait(30), 0.2, "took too long")
        except ValueError as e:
            out["error"] = str(e)
        out["value"] = call_with_time_limit(lambda: 42, 5, "unused")

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert out == {"error": "took too long", "value": 42}


# ------------------------------------------------------------------------------------------------ proxy weights
@pytest.fixture
def proxy(tmp_path):
    import torch

    from iprox_lightning import compress_model, save_proxy
    from iprox_lightning.models.tiny import tiny_causal_lm
    from test_scoring_influence import TINY

    model = tiny_causal_lm("llama", seed=3, **TINY)
    compress_model(model, None, 0.5, method="svd", progress=False)
    return save_proxy(model, None, tmp_path / "proxy", target_model="tiny"), torch


def test_proxy_weights_replaced_after_saving_are_refused(proxy):
    """Same tensor names, shapes and dtype, other values (another proxy's weights copied in, a bit flipped): the
    manifest's sha256 of the weights file is checked."""
    from safetensors.torch import load_file, save_file

    from iprox_lightning import load_model
    from iprox_lightning.io.proxy import ProxyFormatError

    path, torch = proxy
    man = json.loads((path / "iprox_proxy.json").read_text())
    tensors = load_file(path / "iprox_proxy.safetensors")
    name = "model.layers.0.self_attn.q_proj.A"
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, path / "iprox_proxy.safetensors", metadata={"format": "pt", "iprox_proxy": "2"})
    with pytest.raises(ProxyFormatError, match=rf"iprox_proxy.safetensors: sha256 [0-9a-f]+ differs from "
                                               rf"{man['weights']['sha256']} recorded in iprox_proxy.json"):
        load_model(str(path), tokenizer=False)
    data = (path / "iprox_proxy.safetensors").read_bytes()
    (path / "iprox_proxy.safetensors").write_bytes(data[: len(data) // 2])  # cut short
    with pytest.raises(ProxyFormatError, match=r"iprox_proxy.safetensors: not a readable safetensors file"):
        load_model(str(path), tokenizer=False)


def test_proxy_factors_stored_in_another_dtype_are_refused(proxy):
    from safetensors.torch import load_file, save_file

    from iprox_lightning import load_proxy
    from iprox_lightning.io.proxy import ProxyFormatError

    path, torch = proxy
    tensors = load_file(path / "iprox_proxy.safetensors")
    for k in tensors:
        if k.endswith((".A", ".B")):
            tensors[k] = tensors[k].to(torch.bfloat16)
    save_file(tensors, path / "iprox_proxy.safetensors", metadata={"format": "pt", "iprox_proxy": "2"})
    man = json.loads((path / "iprox_proxy.json").read_text())
    man.pop("weights")  # even without the digest (an older manifest) the dtype is checked
    (path / "iprox_proxy.json").write_text(json.dumps(man))
    with pytest.raises(ProxyFormatError, match=r"iprox_proxy.safetensors: 14 tensor\(s\) stored as another dtype "
                                               r"than the iprox_proxy.json records \(float32\), e.g. "
                                               r"model.layers.0.mlp.down_proj.A: bfloat16"):
        load_proxy(path)


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "float99", r"'dtype' is 'float99'; a proxy's weights are one of \['float32', "),
    ("dtype", "nn", r"'dtype' is 'nn'"),
    ("format_version", "two", r"'format_version' is 'two', not an integer"),
    ("layers.model.layers.0.self_attn.q_proj.rank", "eight", r"layer 'model.layers.0.self_attn.q_proj': "
                                                             r"\{'rank': 'eight'\} must be positive integers"),
])
def test_a_manifest_with_a_nonsense_field_names_file_and_field(proxy, field, value, message):
    from iprox_lightning import load_model
    from iprox_lightning.io.proxy import ProxyFormatError

    path, _ = proxy
    man = json.loads((path / "iprox_proxy.json").read_text())
    if field.startswith("layers."):
        man["layers"]["model.layers.0.self_attn.q_proj"]["rank"] = value
    else:
        man[field] = value
    (path / "iprox_proxy.json").write_text(json.dumps(man))
    with pytest.raises(ProxyFormatError, match=rf"^{path}/iprox_proxy.json: {message}"):
        load_model(str(path), tokenizer=False)


# ------------------------------------------------------------------------------------------------ truncated GGUF
def _gguf(path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.add_tensor("output.weight", np.ones((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("keep,message", [(-40, r"not a readable GGUF file, truncated or damaged \(472 bytes; "),
                                          (100, r"the GGUF header counts 2 tensors and 3 key-values, more than its "
                                                r"100 bytes can hold"),
                                          (300, r"not a readable GGUF file, truncated or damaged \(300 bytes; "),
                                          (0, r"not a GGUF file \(starts with b'', not b'GGUF'; 0 bytes\)")])
def test_a_truncated_gguf_file_is_named(tmp_path, monkeypatch, keep, message):
    pytest.importorskip("gguf")
    from iprox_lightning import load_model

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "cache"))
    data = _gguf(tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "model.gguf"
    cut.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    with pytest.raises(ValueError, match=rf"^{cut}: {message}"):
        load_model(str(cut))


def test_a_gguf_without_tensors_or_with_absurd_counts_is_refused_before_reading(tmp_path, monkeypatch):
    """Issue 57: a 914-byte GGUF with no tensors built a 7B-size default Llama (23.9 GB before the kernel killed it);
    header counts are bounded by the file's size before any reader allocates for them."""
    import struct

    gguf = pytest.importorskip("gguf")
    from iprox_lightning import load_model

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(str(empty), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=rf"^{empty}: the GGUF file holds no tensors"):
        load_model(str(empty))
    data = bytearray(_gguf(tmp_path / "full.gguf").read_bytes())
    data[8:16] = struct.pack("<Q", 10**12)  # a trillion tensors in a few hundred bytes
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{huge}: the GGUF header counts 1000000000000 tensors"):
        load_model(str(huge))


# ------------------------------------------------------------------------------------------------ bad tables / records
@pytest.mark.parametrize("scores,message", [
    (["0.5", "high", "0.1"], r"column 'score' holds string values, not numbers \(e.g. row 0: '0.5'\)"),
    ([0.5, None, 0.1], r"row 1 \(id 'b'\) has a null 'score'; 1 null\(s\) in that column"),
])
def test_select_on_a_score_table_with_non_numeric_or_null_scores_names_file_and_row(tmp_path, scores, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "score": scores}), table)
    with pytest.raises(ValueError, match=rf"^{table}: {message}"):
        main(["select", "--scores_path", str(table), "--k", "2", "--output", str(tmp_path / "sel.jsonl")])
    assert not (tmp_path / "sel.jsonl").exists()


@pytest.mark.parametrize("line,message", [('{"id": "b", "score": "high"}', r"id 'b' has a str 'score' \('high'\)"),
                                          ('{"id": "b", "score": [1]}', r"id 'b' has a list 'score' \('\[1\]'\)")])
def test_a_jsonl_score_table_with_a_non_numeric_score_names_file_and_line(tmp_path, line, message):
    from iprox_lightning.io.scores import read_scores

    path = tmp_path / "scores.jsonl"
    path.write_text('{"id": "a", "score": 0.5}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"^{path}, line 2: {message}, not a number"):
        read_scores(path)


def test_fine_tuning_on_an_empty_selection_file_names_the_file(tmp_path):
    empty = tmp_path / "selected.jsonl"
    empty.write_text("")
    args = ["fit", "--config", str(ROOT / "configs/finetune.yaml"), "--config", str(ROOT / "configs/builtin/finetune.yaml"),
            "--model.init_args.model", "builtin", "--model.init_args.save_dir", str(tmp_path / "model"),
            "--data.init_args.tokenizer", "builtin", "--data.init_args.selected", str(empty),
            "--trainer.logger", "false", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(ValueError, match=rf"^the selection file {empty} holds no examples: nothing to train on"):
        main(args)
    assert not (tmp_path / "model").exists()


def test_a_truncated_stage_record_is_refused_naming_it(tmp_path):
    from iprox_lightning.commands.pipeline import pipeline
    from iprox_lightning.io import FingerprintMismatch

    (tmp_path / "warmup" / "model").mkdir(parents=True)
    (tmp_path / "warmup" / "model" / "config.json").write_text("{}")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "warmup.json").write_text('{"stage": "warmup", "fingerp')  # cut short by a full disk
    # (issue 61: the message comes from the one JSON reader, io/jsonfile.read_json, which every small file now uses)
    with pytest.raises(FingerprintMismatch, match=rf"^stage warmup: {tmp_path}/stages/warmup.json \(stage record\): "
                                                  r"malformed JSON \(Unterminated string .* the file is cut short\), so "
                                                  r"what produced .*config.json is unknown .*--force true"):
        pipeline(workdir=str(tmp_path))


# ------------------------------------------------------------------------------------------------ class_path imports
@pytest.fixture
def side_effect_module(tmp_path, monkeypatch):
    """A module that, when imported, writes a file (any code could run there)."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "not_our_module.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nimport lightning\nclass Module(lightning.LightningModule):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.delenv("IPROX_ALLOW_IMPORTS", raising=False)
    sys.modules.pop("not_our_module", None)
    yield marker
    sys.modules.pop("not_our_module", None)


@pytest.mark.parametrize("where", ["flag", "config"])
def test_a_class_path_outside_the_cli_packages_is_refused_before_it_is_imported(tmp_path, side_effect_module, capsys,
                                                                                where):
    args = ["fit", "--config", str(ROOT / "configs/warmup.yaml"), "--trainer.logger", "false"]
    if where == "flag":
        args += ["--model", "not_our_module.Module"]
    else:
        cfg = tmp_path / "evil.yaml"
        cfg.write_text("model:\n  class_path: not_our_module.Module\n")
        args += ["--config", str(cfg)]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code != 0 and not side_effect_module.exists()
    err = capsys.readouterr().err
    assert "import path 'not_our_module.Module' (a class_path?) is outside the packages the command line may import " \
           "(iprox_lightning, lightning, " in err and "IPROX_ALLOW_IMPORTS=not_our_module" in err


def test_a_class_path_of_an_allowed_package_is_imported(tmp_path, side_effect_module, monkeypatch, capsys):
    """The opt-in: IPROX_ALLOW_IMPORTS names the package (here only --print_config runs, nothing is trained)."""
    monkeypatch.setenv("IPROX_ALLOW_IMPORTS", "not_our_module")
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(ROOT / "configs/warmup.yaml"), "--model", "not_our_module.Module",
              "--print_config"])
    assert e.value.code in (0, None) and side_effect_module.read_text() == "ran"
    assert "class_path: not_our_module.Module" in capsys.readouterr().out


def test_a_class_path_in_a_plain_command_argument_is_not_imported(tmp_path, side_effect_module):
    """The function commands (pipeline, select, ...) parse free-form dicts (``data_args``), where jsonargparse used to
    import and build any ``class_path``: it stays a plain dict now."""
    with pytest.raises(FileNotFoundError, match="stage configs not found"):  # stops right after parsing
        main(["pipeline", "--workdir", str(tmp_path / "wd"), "--config_dir", str(tmp_path / "none"), "--data_args",
              '{"field_map": {"class_path": "not_our_module.Module"}}'])
    assert not side_effect_module.exists()


# ------------------------------------------------------------------------------------------------ stage outputs by content
def test_a_stage_output_replaced_by_hand_reruns_the_stages_that_read_it(tmp_path, capsys):
    """Replace the proxy by another one by hand: the proxy's scores are computed again from it (they used to be
    reused from the old proxy); the stages that do not read it are reused."""
    import torch

    from iprox_lightning import load_proxy, save_proxy
    from iprox_lightning.io.scores import read_scores
    from iprox_lightning.commands.pipeline import pipeline
    from iprox_lightning.io.proxy import read_manifest

    wd = tmp_path / "wd"
    kw = dict(workdir=str(wd), finetune=False, data_args={"builtin_size": 300}, select_rule="pooled")  # one subset
    pipeline(**kw)
    before = read_scores(wd / "scores" / "proxy" / "scores.parquet")
    proxy_dir = wd / "proxy" / "model"
    model, tok = load_proxy(proxy_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".A"):
                p.mul_(-1.0).add_(0.05)  # another proxy of the same shape
    extra = {k: v for k, v in read_manifest(proxy_dir).items()
             if k not in ("format_version", "layers", "dtype", "params_after", "weights")}
    save_proxy(model, tok, proxy_dir, **extra)
    capsys.readouterr()
    again = pipeline(**kw)
    out = capsys.readouterr().out
    assert {k: v["status"] for k, v in again["stages"].items()} == {
        "warmup": "reused", "build_proxy": "reused", "score:target": "reused", "score:proxy": "ran"}
    note = "[pipeline] build_proxy: note: its output changed since it was recorded (used as it is now): "
    assert note in out and "iprox_proxy.safetensors: '" in out.split(note)[1].splitlines()[0]
    again_line = "[pipeline] score:proxy: runs again: the output of a stage it reads changed: "
    assert again_line in out
    assert "upstream_outputs.build_proxy.iprox_proxy.safetensors: '" in out.split(again_line)[1].splitlines()[0]
    assert read_scores(wd / "scores" / "proxy" / "scores.parquet") != before
    assert again["selection"]["proxy"]["pool_size"] == 300  # explained against the built-in pool as scored
    third = pipeline(**kw)  # now everything matches again
    assert {v["status"] for v in third["stages"].values()} == {"reused"}


def test_a_stage_whose_input_file_another_stage_rewrote_runs_again(tmp_path):
    """The selection a fine-tune reads is rewritten by select (new scores, another k): the fine-tune runs again,
    told why, instead of stopping the pipeline; a changed option still stops it."""
    from iprox_lightning.io import FingerprintMismatch
    from iprox_lightning.io.stages import StageLedger

    cfg = tmp_path / "finetune.yaml"
    cfg.write_text("seed_everything: 0\n")
    sel = tmp_path / "selected.jsonl"
    sel.write_text('{"id": "a"}\n')
    done = tmp_path / "finetune" / "config.json"

    def ledger(overlay=None):
        led = StageLedger(tmp_path, {"target": "builtin"})
        led.prepare("finetune:proxy", [cfg], overlay or {"lr": 1}, files=(sel,))
        return led

    first = ledger()
    assert first.reuse("finetune:proxy", done) is False
    done.parent.mkdir()
    done.write_text("{}")
    first.record("finetune:proxy")
    assert ledger().reuse("finetune:proxy", done) is True
    sel.write_text('{"id": "b"}\n')
    again = ledger()
    assert again.reuse("finetune:proxy", done) is False
    assert again.notes["finetune:proxy"].startswith(f"an input file changed: files.{sel}.sha256: ")
    with pytest.raises(FingerprintMismatch, match=r"overlay.lr: 1 -> 2"):
        ledger({"lr": 2}).reuse("finetune:proxy", done)


# ------------------------------------------------------------------------------------------------ pipeline arguments
def test_a_second_pipeline_into_the_same_workdir_is_refused(tmp_path):
    """Two pipelines into one workdir would train into the same model directories: the second stops at once."""
    import os

    from iprox_lightning.io.score_dir import OutputLocked, ScoreDirLock

    wd = tmp_path / "wd"
    with ScoreDirLock(wd, ".pipeline.lock", "pipeline run"):  # another pipeline holds it
        with pytest.raises(OutputLocked, match=rf"^{wd} is being written by another pipeline run \(pid {os.getpid()} "
                                               r".*use another --workdir"):
            main(["pipeline", "--workdir", str(wd)])
    assert sorted(p.name for p in wd.iterdir()) == [".pipeline.lock"]


@pytest.mark.parametrize("flag,message", [
    (["--select_fraction", "0"], r"select_fraction must be a fraction in \(0, 1\], got 0"),
    (["--sparsity", "1.5"], r"sparsity must be in \[0, 1\), got 1.5"),
    (["--method", "bogus"], r"method: method must be one of \('tracin', 'kfac', 'ekfac', 'less'\), got 'bogus'"),
    (["--method", "less"], r"method: less scores a LoRA checkpoint's adapter gradients"),
])
def test_pipeline_arguments_a_late_stage_would_refuse_stop_before_any_stage_runs(tmp_path, flag, message):
    """They used to stop only after warm-up and proxy building (sparsity) or scoring (select_fraction) ran."""
    wd = tmp_path / "wd"
    with pytest.raises(ValueError, match=rf"^{message}"):
        main(["pipeline", "--workdir", str(wd)] + flag)
    assert not wd.exists()


# ------------------------------------------------------------------------------------------------ select vs the scored pool
def _predict(tmp_path, out, *extra):
    main(["predict", "--config", str(ROOT / "configs/score.yaml"), "--config", str(ROOT / "configs/builtin/score.yaml"),
          "--model.init_args.model", "builtin", "--data.init_args.tokenizer", "builtin",
          "--data.init_args.val_per_task", "2", "--trainer.logger", "false", "--trainer.accelerator", "cpu",
          "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks.output_dir", str(out), *extra])
    return out


@pytest.fixture(scope="module")
def scored_file_pool(tmp_path_factory):
    """A pool file whose ids are row numbers (no id field), scored through the CLI."""
    tmp = tmp_path_factory.mktemp("scored_pool")
    recs = [{k: v for k, v in r.items() if k != "id"} for r in _records(24)]
    pool = _write_jsonl(tmp / "pool.jsonl", recs)
    return pool, _predict(tmp, tmp / "scores", "--data.init_args.pool", str(pool))


def _select(scores, pool, output, *extra):
    return main(["select", "--scores_path", str(scores), "--k", "4", "--pool", str(pool), "--output", str(output),
                 "--quiet", "true", *extra])


def test_select_refuses_a_pool_other_than_the_scored_one(scored_file_pool, tmp_path):
    """The pool re-sorted (ids are row numbers, so every id now names another example) or one record edited: the
    selection would hold records that did not earn the scores. Refused, with the way to override."""
    pool, scores = scored_file_pool
    lines = pool.read_text().splitlines(keepends=True)
    resorted = tmp_path / "pool.jsonl"
    resorted.write_text("".join(reversed(lines)))
    edited = tmp_path / "edited" / "pool.jsonl"
    edited.parent.mkdir()
    edited.write_text("".join(lines).replace('"response": "ok 5"', '"response": "changed"'))
    for other in (resorted, edited):
        with pytest.raises(ValueError, match=rf"^{scores}/scores.parquet was scored on pool '{pool}' \(24 records, "
                                             rf"digest [0-9a-f]+\), but the pool {other} holds other records \(24 "
                                             r"records, .*--allow_pool_mismatch true"):
            _select(scores, other, tmp_path / "sel.jsonl")
    assert not (tmp_path / "sel.jsonl").exists()
    _select(scores, resorted, tmp_path / "sel.jsonl", "--allow_pool_mismatch", "true")
    assert json.loads((tmp_path / "sel.jsonl.meta.json").read_text())["pool_check"] == "mismatch allowed"
    _select(scores, pool, tmp_path / "ok.jsonl")  # the scored pool itself
    assert json.loads((tmp_path / "ok.jsonl.meta.json").read_text())["pool_check"] == "match"


def test_select_refuses_to_overwrite_its_inputs(scored_file_pool, tmp_path):
    pool, scores = scored_file_pool
    before = pool.read_bytes(), (scores / "scores.parquet").read_bytes()
    with pytest.raises(ValueError, match=rf"^output {pool} is the pool file {pool}: writing it would "
                                         r"replace the pool"):
        _select(scores, pool, pool)
    with pytest.raises(ValueError, match=rf"^output {scores}/scores.parquet is the score table being read"):
        _select(scores, pool, scores / "scores.parquet")
    with pytest.raises(ValueError, match=r"is inside the pool directory .*the next read of the pool would take it "
                                         r"for pool data"):
        pool_dir = tmp_path / "pool_dir"
        _write_jsonl(pool_dir / "pool.jsonl", [json.loads(line) for line in pool.read_text().splitlines()])
        _select(scores, pool_dir, pool_dir / "selected.jsonl")
    with pytest.raises(IsADirectoryError, match=rf"^output {tmp_path} is a directory; name a file"):
        _select(scores, pool, tmp_path)
    assert (pool.read_bytes(), (scores / "scores.parquet").read_bytes()) == before


def test_select_refuses_an_empty_selection(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "score": [0.1, 0.2], "zero_grad": [True, True]}), table)
    with pytest.raises(ValueError, match=rf"^{table}: nothing to select: 0 example\(s\) left to rank of 2 scored "
                                         r"\(2 without gradient, 0 non-finite skipped\)"):
        main(["select", "--scores_path", str(table), "--output", str(tmp_path / "sel.jsonl")])
    assert not (tmp_path / "sel.jsonl").exists()


def test_select_reads_the_builtin_pool_at_the_size_that_was_scored(tmp_path):
    """A built-in pool of 2010 examples: select used to read 2000 and stop on 'scored ids not found'."""
    scores = _predict(tmp_path, tmp_path / "scores", "--data.init_args.builtin_size", "2010",
                      "--data.init_args.validation", "builtin")
    _select(scores, "builtin", tmp_path / "sel.jsonl")
    meta = json.loads((tmp_path / "sel.jsonl.meta.json").read_text())
    assert meta["pool_check"] == "match" and meta["builtin_size"] == 2010
    assert meta["explanation"]["pool_size"] == 2010


def test_proxy_validation_is_checked_once_with_the_same_message_everywhere():
    """``check_choice`` / ``PROXY_VALIDATIONS``: one check of the choice of validation model, named in the error."""
    from iprox_lightning.errors import PROXY_VALIDATIONS, UserInputError, check_choice
    from iprox_lightning.alignment.module import AlignConfig

    assert PROXY_VALIDATIONS == ("target", "proxy")
    for v in PROXY_VALIDATIONS:
        check_choice("proxy_validation", v, PROXY_VALIDATIONS)
        assert AlignConfig(proxy_validation=v).proxy_validation == v
    msg = "proxy_validation must be 'target' or 'proxy', got 'teacher'"
    with pytest.raises(UserInputError, match=re.escape(msg)):
        check_choice("proxy_validation", "teacher", PROXY_VALIDATIONS)
    with pytest.raises(UserInputError, match=re.escape(msg)):
        AlignConfig(proxy_validation="teacher")
    with pytest.raises(UserInputError, match=re.escape("x must be 1, 2 or 3, got 4")):
        check_choice("x", 4, (1, 2, 3))


def test_round_three_inputs_refused_before_any_work(tmp_path, capsys):
    """Issue 57: ``val_per_task=0`` was read as the default; a selection file with an id twice was read as 11 examples
    for a count of 10; ``query --neighbours -1`` failed only after the validation gradients were computed."""
    import json

    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.io.records import DataFormatError
    from iprox_lightning.io.selection import read_selection

    with pytest.raises(UserInputError, match="val_per_task must be >= 1"):
        SFTDataModule(pool="builtin", validation="builtin", tokenizer="builtin", val_per_task=0)
    rows = [{"id": f"ex-{i}", "instruction": f"q{i}", "response": f"a{i}"} for i in range(3)]
    sel = tmp_path / "sel.jsonl"
    sel.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
    with pytest.raises(DataFormatError, match="selected more than once: 'ex-0'"):
        read_selection(sel)
    sel.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sel.jsonl.meta.json").write_text(json.dumps({"count": 2}))
    with pytest.raises(DataFormatError, match="holds 3 examples, its sel.jsonl.meta.json says count 2"):
        read_selection(sel)
    (tmp_path / "sel.jsonl.meta.json").write_text(json.dumps({"count": 3}))
    assert [r["id"] for r in read_selection(sel)] == ["ex-0", "ex-1", "ex-2"]
    from iprox_lightning.cli import main

    with pytest.raises(UserInputError, match="neighbours must be an integer >= 0, got -1"):
        main(["query", "--store", str(tmp_path / "no-store"), "--validation", "builtin", "--output_dir",
              str(tmp_path / "q"), "--neighbours", "-1"])
    assert not (tmp_path / "q").exists()


def test_a_config_file_cannot_opt_in_to_running_code(tmp_path, monkeypatch):
    """Issue 57: ``trust_remote_code: true`` or ``weights_only: false`` in a (shared) config ran the model directory's
    Python or a checkpoint's pickles; the opt-in must be the user's own act: the command line or IPROX_ALLOW_CODE.
    (Issue 61 moved the check from a scan of argv to the resolved configuration, ``check_code_opt_ins``; this test now
    goes through the command line and stops where the classes would be built.)"""
    from iprox_lightning.commands.lightning import IProXCLI
    from iprox_lightning.errors import UserInputError

    class Built(Exception):
        pass

    def stop(self):
        raise Built

    monkeypatch.setattr(IProXCLI, "instantiate_classes", stop)
    monkeypatch.delenv("IPROX_ALLOW_CODE", raising=False)
    cfg = tmp_path / "shared.yaml"
    cfg.write_text("data:\n  init_args:\n    trust_remote_code: true\n")
    ckpt = tmp_path / "ckpt.yaml"
    ckpt.write_text("ckpt_path: null\nweights_only: false\n")
    warmup = ["fit", "--config", "configs/warmup.yaml"]
    with pytest.raises(UserInputError, match=rf"^{cfg}: data.init_args.trust_remote_code: true would run code"):
        main([*warmup, "--config", str(cfg)])
    with pytest.raises(UserInputError, match=rf"^{ckpt}: weights_only: false would run code"):
        main([*warmup, f"--config={ckpt}"])
    with pytest.raises(Built):  # the user's act
        main([*warmup, "--config", str(cfg), "--data.init_args.trust_remote_code", "true"])
    monkeypatch.setenv("IPROX_ALLOW_CODE", "weights_only")
    with pytest.raises(Built):
        main([*warmup, "--config", str(ckpt)])
    with pytest.raises(UserInputError, match="trust_remote_code"):
        main([*warmup, "--config", str(cfg)])
    monkeypatch.delenv("IPROX_ALLOW_CODE")
    safe = tmp_path / "safe.yaml"
    safe.write_text("data:\n  init_args:\n    trust_remote_code: false\nweights_only: true\n")
    with pytest.raises(Built):
        main([*warmup, "--config", str(safe)])
    monkeypatch.undo()  # through the whole command line, before anything is built
    with pytest.raises(UserInputError, match="a config file cannot opt in"):
        main(["fit", "--config", "configs/warmup.yaml", "--config", str(cfg)])


def test_a_validation_task_whose_every_example_is_dropped_is_refused(tmp_path):
    """Issue 57: when every example of one validation task was longer than max_length, scoring exited 0 with only the
    other task's column; the data module refuses it naming the task."""
    import json

    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.errors import UserInputError

    rows = [{"id": f"a{i}", "instruction": "add 1 and 2", "response": "3", "category": "short"} for i in range(2)]
    rows += [{"id": f"b{i}", "instruction": "word " * 400, "response": "yes", "category": "long"} for i in range(2)]
    rows += [{"id": "b-ok", "instruction": "word", "response": "yes", "category": "mixed"},
             {"id": "b-cut", "instruction": "word " * 400, "response": "yes", "category": "mixed"}]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = SFTDataModule(pool="builtin", validation=str(val), tokenizer="builtin", max_length=64, builtin_size=20,
                       truncation="right")
    with pytest.raises(UserInputError, match=r"validation task\(s\) \['long'\]: every example was dropped"):
        dm.dataset("validation")
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows[4:]))
    dm = SFTDataModule(pool="builtin", validation=str(val), tokenizer="builtin", max_length=64, builtin_size=20,
                       truncation="right")
    assert sorted({e.task for e in dm.dataset("validation").examples}) == ["mixed", "short"]  # one of 'mixed' kept


def test_check_names_the_model_option_and_select_says_why_rows_are_not_ranked(tmp_path, capsys):
    """Issue 55: ``check --target`` with a typo named the *tokenizer* path; ``select`` printed "100 of 1991 ranked"
    beside "of 2000" without saying where 9 went."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from iprox_lightning.errors import InputNotFoundError

    with pytest.raises(InputNotFoundError, match=r"^check: --target '.*nope': no such file"):
        main(["check", "--target", str(tmp_path / "nope"), "--proxy", "builtin", "--sample", "4"])
    table = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "a"], "score": [0.3, 0.2, 0.1, 0.05],
                             "zero_grad": [False, True, False, False]}), table)
    main(["select", "--scores_path", str(table), "--k", "1", "--output", str(tmp_path / "s.jsonl")])
    out = capsys.readouterr().out
    assert "select: wrote 1 of 2 ranked examples" in out
    assert "select: 2 of the table's 4 rows not ranked: 1 without a gradient (no response token), 1 repeated" in out


def test_score_commands_never_overwrite_a_pool_or_another_selectors_table(tmp_path):
    """Issue 57: ``random_scores`` with its output set to the pool file replaced the pool; ``random_scores`` and
    ``rds_scores`` pointed at another selector's score directory replaced its table; ``rds_scores`` recorded no pool
    digest, so a re-sorted pool was later selected from silently."""
    import json

    from iprox_lightning.errors import OutputExistsError, UserInputError
    from iprox_lightning.io.scores import read_scores, read_settings

    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "instruction": f"say {i}", "response": str(i)}) + "\n"
                            for i in range(12)))
    before = pool.read_text()
    with pytest.raises(UserInputError, match=r"is the pool file .*would replace the pool"):
        main(["random_scores", "--output", str(pool), "--pool", str(pool)])
    assert pool.read_text() == before
    out = tmp_path / "r.parquet"
    main(["random_scores", "--output", str(out), "--pool", str(pool), "--seed", "1"])
    first = read_scores(out)
    main(["random_scores", "--output", str(out), "--pool", str(pool), "--seed", "1"])  # the same again: fine
    with pytest.raises(OutputExistsError, match="holds other scores"):
        main(["random_scores", "--output", str(out), "--pool", str(pool), "--seed", "2"])
    assert read_scores(out) == first
    main(["random_scores", "--output", str(out), "--pool", str(pool), "--seed", "2", "--overwrite", "true"])
    assert read_scores(out) != first
    # rds_scores into another run's score directory: refused; its own run records the pool's records digest
    other = tmp_path / "exact"
    other.mkdir()
    (other / "settings.json").write_text(json.dumps({"method": "tracin", "fingerprint": {"settings": {"m": 1}}}))
    with pytest.raises(OutputExistsError, match="holds another run's scores"):
        main(["rds_scores", "--model", "builtin", "--output_dir", str(other), "--pool", str(pool),
              "--max_length", "32"])
    rds = tmp_path / "rds"
    main(["rds_scores", "--model", "builtin", "--output_dir", str(rds), "--pool", str(pool), "--max_length", "32"])
    assert read_settings(rds)["pool"]["records"]
    lines = before.splitlines(keepends=True)
    pool.write_text("".join(lines[1:] + lines[:1]).replace('"say 3"', '"say three"'))  # another pool, same ids
    with pytest.raises(UserInputError, match="pool"):
        main(["select", "--scores_path", str(rds / "scores.parquet"), "--pool", str(pool), "--k", "2",
              "--output", str(tmp_path / "sel.jsonl")])


def test_check_store_and_query_outputs_never_land_in_the_pool(tmp_path):
    """Issue 57: ``check --output`` pointed at the pool replaced the pool; store/query outputs written inside a
    directory pool broke it (its next read took them for pool data)."""
    import json

    from iprox_lightning.errors import UserInputError

    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    pool = pool_dir / "part.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "instruction": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(8)))
    before = pool.read_text()
    with pytest.raises(UserInputError, match="is the pool file"):
        main(["check", "--target", "builtin", "--proxy", "builtin", "--pool", str(pool), "--sample", "4",
              "--output", str(pool)])
    with pytest.raises(UserInputError, match="inside the pool directory"):
        main(["build_store", "--model", "builtin", "--pool", str(pool_dir), "--output_dir", str(pool_dir / "store")])
    with pytest.raises(UserInputError, match="inside the pool directory"):
        main(["check", "--target", "builtin", "--proxy", "builtin", "--pool", str(pool_dir), "--sample", "4",
              "--output_dir", str(pool_dir / "check")])
    assert pool.read_text() == before and sorted(p.name for p in pool_dir.iterdir()) == ["part.jsonl"]


# ------------------------------------------------------------------------------------------------ issue 57, round 2
def test_the_proxy_module_command_line_answers_a_user_error_in_one_line(tmp_path):
    """``python -m iprox_lightning.io.proxy`` printed a 20-line traceback for a directory that is no proxy; now one
    ``error:`` line (exit 2), the traceback with ``--debug``, as ``train.py`` does."""
    import os
    import subprocess

    from iprox_lightning.errors import InputNotFoundError, run_command_line
    from iprox_lightning.io.proxy import _main

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("IPROX_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "iprox_lightning.io.proxy", "export", str(tmp_path / "nothing"),
                        str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: {tmp_path / 'nothing' / 'iprox_proxy.json'} not found: "
                                     f"{tmp_path / 'nothing'} is not an IProX proxy directory (--debug shows the "
                                     "traceback)"]
    with pytest.raises(InputNotFoundError):  # --debug: the exception itself
        run_command_line(_main, ["upgrade", str(tmp_path / "nothing"), "--debug"])


def _edit_json(path, edit):
    path.write_text(edit(path.read_text()) if callable(edit) else edit)


def _set(*keys_value):
    """An edit of a JSON text: the value at the dotted path (``None`` as the last key's value deletes it)."""
    *keys, value = keys_value

    def edit(text):
        d = json.loads(text)
        o = d
        for k in keys[:-1]:
            o = o[k] if not isinstance(o, list) else o[int(k)]
        if value is None:
            del o[keys[-1]]
        else:
            o[keys[-1]] = value
        return json.dumps(d)
    return edit


@pytest.mark.parametrize("file,edit,message", [
    ("config.json", lambda t: t[: len(t) // 2], r"config.json \(the proxy's architecture\): malformed JSON \(.* the "
                                                r"file is cut short\)"),
    ("config.json", "[]", r"config.json \(the proxy's architecture\): holds a JSON array, not an object"),
    ("config.json", _set("model_type", None), r"config.json: field 'model_type' is missing"),
    ("config.json", _set("hidden_size", "64"), r"config.json: not a config transformers can build \(.*'hidden_size'"),
    # sizes are checked against the weights file's header before a model of that size is allocated (64 TB)
    ("config.json", _set("vocab_size", 10**12), r"iprox_proxy.safetensors: tensor model.embed_tokens.weight has shape "
                                                r"\[64, 16\], the model built from config.json expects \[1000000000000, "),
    ("iprox_proxy.json", lambda t: t[: len(t) // 2], r"iprox_proxy.json \(proxy manifest\): malformed JSON"),
    ("iprox_proxy.json", _set("layers", "model.layers.0.self_attn.q_proj", "bias", "no"),
     r"iprox_proxy.json: field 'layers.model.layers.0.self_attn.q_proj.bias' is 'no' \(a JSON string\), not true or "
     r"false"),
    ("iprox_proxy.json", _set("weights", "sha256", ""), r"iprox_proxy.json: field 'weights.sha256' is '', not a hex "
                                                        r"SHA-256 digest"),  # was: the digest check skipped
    ("iprox_proxy.json", _set("weights", []), r"iprox_proxy.json: field 'weights' is \[\] \(a JSON array\)"),
    ("iprox_proxy.json", _set("weights", "size", "x"), r"iprox_proxy.json: field 'weights.size' is 'x'"),
    ("iprox_proxy.json", _set("format_version", 0), r"iprox_proxy.json: field 'format_version' is 0, must be >= 1"),
])
def test_a_cut_or_edited_proxy_config_or_manifest_names_file_and_field(proxy, file, edit, message):
    """Issue 57: a cut config.json gave transformers' OSError, a wrong-typed field its validation traceback, a huge
    vocab_size tried to allocate 64 TB; manifest fields of the wrong type raised ValueError/TypeError or were
    ignored (an empty sha256 or a 'weights' list skipped the digest check; format_version 0 loaded)."""
    from iprox_lightning import load_model
    from iprox_lightning.io.proxy import ProxyFormatError

    path, _ = proxy
    _edit_json(path / file, edit)
    with pytest.raises(ProxyFormatError, match=rf"^{path}/{message}"):
        load_model(str(path), tokenizer=False)


@pytest.fixture(scope="module")
def built_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store57")
    pool, val = _write_jsonl(d / "pool.jsonl", _records(6)), _write_jsonl(d / "val.jsonl", _records(4, "v"))
    main(["build_store", "--model", "builtin", "--output_dir", str(d / "store"), "--pool", str(pool), "--max_length",
          "32", "--batch_size", "3", "--k", "4", "--progress", "false"])
    return d / "store", val


@pytest.mark.parametrize("edit,message", [
    (lambda t: t[:-40], r"\(gradient store record\): malformed JSON \(.* the file is cut short\)"),
    (_set("layout", "0", "offset", "0"), r"field 'layout\[0\].offset' is '0' \(a JSON string\), not an integer"),
    (_set("layout", "1", "offset", 0), r"field 'layout\[1\].offset' is 0, but the blocks before it end at 16"),
    (_set("layout", "0", "in", None), r"field 'layout\[0\].in' is missing"),
    (_set("layout", "0", "k_out", 9999), r"field 'layout\[0\]' projects a 64 x 64 weight to 9999 x 4"),
    (_set("dim", 100), r"field 'dim' is 100, but the layout's blocks hold 224 numbers"),
    (_set("dim", -5), r"field 'dim' is -5, must be >= 1"),
    (_set("dtype", "int8"), r"field 'dtype' is 'int8', not one of \['float32', 'float16', 'bfloat16'\]"),
    (_set("fingerprint", "settings", "x"), r"field 'fingerprint.settings' is 'x' \(a JSON string\), not an object"),
    (_set("complete", "no"), r"field 'complete' is 'no' \(a JSON string\), not true or false"),
    (_set("tokenization", "max_length", -3), r"field 'tokenization.max_length' is -3, must be >= 2"),
    (_set("factors", "../../elsewhere.safetensors"), r"field 'factors' is '../../elsewhere.safetensors': a file name "
                                                     r"inside the store, not a path"),
    (_set("dtype", "bfloat16"), r"field 'dtype' is 'bfloat16', but .*rank000-.*\.safetensors stores F16 vectors"),
])
def test_an_edited_store_record_names_file_and_field(built_store, tmp_path, edit, message):
    """Issue 57: store.json's layout, dim, dtype and flags were not checked: edited offsets, dims or dtypes were
    queried (exit 0), a missing key or a wrong type raised KeyError / AttributeError / TypeError. Each is refused
    before the query computes anything, naming store.json and the field."""
    from iprox_lightning.io.gradient_store import StoreFormatError

    store, val = built_store
    kept = (store / "store.json").read_text()
    try:
        _edit_json(store / "store.json", edit)
        with pytest.raises(StoreFormatError, match=rf"^{store}/store.json:? " + message):
            main(["query", "--store", str(store), "--validation", str(val), "--output_dir", str(tmp_path / "q")])
    finally:
        (store / "store.json").write_text(kept)
    assert not (tmp_path / "q" / "scores.parquet").exists()


def _gguf_with_vocab(path, n_tokens):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{j}" for j in range(n_tokens)])
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.add_tensor("output.weight", np.ones((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_with_a_huge_string_array_or_absurd_lengths_is_refused_without_reading_it(tmp_path, monkeypatch):
    """Issue 57: the GGUF reader keeps over 1 KB per array entry: a 10 MB file of 700,000 short vocabulary strings took
    1.3 GB before the check answered. The header is now walked as stored, each declared length and count checked
    against the bytes left, the entries bounded by the vocabulary (8 per token-embedding row + 65,536)."""
    import struct
    import tracemalloc

    pytest.importorskip("gguf")
    from iprox_lightning import load_model
    from iprox_lightning.models.loading import check_gguf

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "cache"))
    big = _gguf_with_vocab(tmp_path / "vocab.gguf", 70_000)  # for 8 embedding rows
    tracemalloc.start()
    with pytest.raises(ValueError, match=rf"^{big}: its key-value arrays hold 70000 entries, more than a model with 8 "
                                         r"token-embedding rows has \(65600 at most"):
        load_model(str(big))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # the reader took ~90 MB for this file
    check_gguf(_gguf_with_vocab(tmp_path / "ok.gguf", 8))  # a vocabulary of the embedding's size: read
    data = bytearray((tmp_path / "ok.gguf").read_bytes())
    at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4  # value type, item type
    for offset, value, message in [(0, 10**15, r"array 'tokenizer.ggml.tokens' of 1000000000000000 entries at byte "),
                                   (8, 2**40, r"the string value of 'tokenizer.ggml.tokens' \(1099511627776 bytes\) ")]:
        bad = bytearray(data)
        bad[at + offset:at + offset + 8] = struct.pack("<Q", value)  # the count; the first string's length
        (tmp_path / "bad.gguf").write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=rf"^{tmp_path / 'bad.gguf'}: not a readable GGUF file, truncated or "
                                             rf"damaged \(\d+ bytes; {message}"):
            check_gguf(tmp_path / "bad.gguf")


def _peak_rss_since_reset():
    """(reset the process's peak RSS, a function returning the growth of the peak since then, in bytes); None where
    /proc/self/clear_refs cannot reset it."""
    def hwm():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) becomes the current RSS
        start = hwm()
    except OSError:
        return None
    return lambda: hwm() - start


def _turns(n, size, last="fine"):
    text = "".join("abcdefghij klmnopqrst"[j % 21] for j in range(size))
    msgs = [{"role": "user" if j % 2 == 0 else "assistant", "content": f"{j} {text}"} for j in range(n)]
    return msgs + [{"role": "assistant", "content": last}]


def test_a_record_of_many_short_turns_is_cut_before_it_is_tokenized(tmp_path):
    """Issue 57: each field was cut before tokenizing, not a conversation of many short turns: one 5 MB line of 50,000
    turns peaked at 2.1 GB while it was tokenized. The rendered prompt and response are now cut too; the peak stays
    within 250 MB of where it was."""
    import gc

    from iprox_lightning.data.sft import SFTDataModule
    from iprox_lightning.models.builtin import builtin_tokenizer

    rec = {"id": "long", "category": "a", "messages": _turns(50_000, 96)}
    pool = _write_jsonl(tmp_path / "pool.jsonl", [rec] + _records(2))
    assert pool.stat().st_size > 5_000_000
    del rec
    gc.collect()
    peak = _peak_rss_since_reset()
    if peak is None:
        pytest.skip("/proc/self/clear_refs cannot reset the peak RSS here")
    ds = SFTDataModule(pool=str(pool), validation=None, tokenizer=builtin_tokenizer(), max_length=128).dataset("pool")
    grew = peak()
    assert ds.ids == ["long", "r0", "r1"] and len(ds.examples[0].input_ids) == 128
    assert grew < 250 * 2**20, f"peak RSS grew by {grew / 2**20:.0f} MB"


@pytest.mark.parametrize("template,truncation", [("chat", "prompt_left"), ("plain", "prompt_left"),
                                                 ("chat", "right"), ("plain", "right")])
def test_cutting_the_rendered_text_keeps_the_tokens_of_the_uncut_text(tmp_path, monkeypatch, template, truncation):
    """The kept tokens are those of the uncut text: for records of every size (short, long fields, many turns), the
    examples equal those tokenized without any cut (the BOS a chat template renders stays in front)."""
    from iprox_lightning.data import formatting
    from iprox_lightning.data.sft import SFTDataModule

    recs = _records(3) + [{"id": "turns", "category": "a", "messages": _turns(400, 60)},
                          {"id": "short-turns", "category": "b", "messages": _turns(4, 10)},
                          {"id": "long-answer", "category": "b", "messages": _turns(2, 10, last="x y " * 5000)}]
    pool = _write_jsonl(tmp_path / "pool.jsonl", recs)

    def tokenized(bound):
        monkeypatch.setattr(formatting, "CHARS_PER_TOKEN_BOUND", bound)
        tok = _counting_tokenizer()
        type(tok).longest = 0
        ds = SFTDataModule(pool=str(pool), validation=None, tokenizer=tok, max_length=96, prompt_template=template,
                           truncation=truncation).dataset("pool")
        return {ex.id: (ex.input_ids.tolist(), ex.prompt_len) for ex in ds.examples}, type(tok).longest

    got, longest = tokenized(64)
    want, longest_uncut = tokenized(10**9)
    assert longest <= 96 * 64 + 4 < longest_uncut
    assert got == want and len(got) >= 4


def _absurd_safetensors(path, kind):
    """Rewrite the safetensors file ``path`` with a header length past the file ("length") or a first tensor of 1 TB
    whose offsets lie past the file ("offsets")."""
    import struct

    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    if kind == "length":
        path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
        return
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name] = {"dtype": "F32", "shape": [2**18, 2**20], "data_offsets": [0, 2**40]}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


_ABSURD = {"length": r"not a readable safetensors file: its header claims 4611686018427387904 bytes, the file has "
                     r"\d+: cut short",
           "offsets": r"not a readable safetensors file: tensor '.*' \(F32 \[262144, 1048576\], 1099511627776 bytes\) lies at bytes 0..1099511627776 of "
                      r"the \d+ data bytes the file holds"}


@pytest.mark.parametrize("kind", sorted(_ABSURD))
def test_safetensors_headers_with_absurd_sizes_are_refused_naming_the_file(proxy, tmp_path, kind):
    """Issue 57: a model directory's weights with a header length or tensor offsets past the file stopped with the
    safetensors library's 'Error while deserializing header' (no file named), through transformers; a proxy's, a
    store's or a factor file's with its message. Each is now checked against the file's size first, naming file and
    tensor."""
    import torch

    from iprox_lightning import load_model
    from iprox_lightning.io.factors import load_factors, save_factors
    from iprox_lightning.io.proxy import ProxyFormatError
    from iprox_lightning.io.gradient_store import StoreFormatError
    from iprox_lightning.models.tiny import tiny_causal_lm
    from iprox_lightning.errors import UserInputError

    path, _ = proxy
    _absurd_safetensors(path / "iprox_proxy.safetensors", kind)
    with pytest.raises(ProxyFormatError, match=rf"^{path}/iprox_proxy.safetensors: {_ABSURD[kind]}"):
        load_model(str(path), tokenizer=False)
    dense = tmp_path / "dense"
    tiny_causal_lm("llama", seed=1).save_pretrained(dense)
    _absurd_safetensors(dense / "model.safetensors", kind)
    with pytest.raises(UserInputError, match=rf"^{dense}/model.safetensors: {_ABSURD[kind]}"):
        load_model(str(dense), tokenizer=False)
    factors = save_factors(tmp_path / "kfac-x.safetensors", {"A": torch.ones(2, 2)}, method="kfac", fingerprint={})
    _absurd_safetensors(factors, kind)
    with pytest.raises(StoreFormatError, match=rf"^{factors}: {_ABSURD[kind]}"):
        load_factors(factors, method="kfac")


def test_a_cut_model_config_is_named(tmp_path):
    from iprox_lightning import load_model
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.models.tiny import tiny_causal_lm

    tiny_causal_lm("llama", seed=1).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text()[:50])
    with pytest.raises(UserInputError, match=rf"^{tmp_path}/config.json \(the model's architecture\): malformed JSON "
                                             r"\(.*the file is cut short\)"):
        load_model(str(tmp_path), tokenizer=False)


def _command_line(monkeypatch, capsys, *args):
    """``python train.py <args>`` as the process's command line: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, args)])
    monkeypatch.delenv("IPROX_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("extra,message", [
    (["--n", "0"], "--n must be >= 1, got 0"),
    (["--n", "11"], "--n 11 is more than the 10 records of {pool}"),
    (["--n", "3", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--n", "3", "--output", "{dir}"], "--output {dir} is a directory; name a file"),
    (["--n", "3", "--output", "{pool}"], "--output {pool} would replace the pool {pool}"),
    (["--n", "4", "--output", "{dir}/taken.jsonl"], "--output {dir}/taken.jsonl already exists and holds something "
                                                     "else than this sample"),
])
def test_sample_pool_edges_answer_in_one_line(tmp_path, monkeypatch, capsys, extra, message):
    """Issue 57: sample_pool raised plain ValueError / IsADirectoryError / FileExistsError (a traceback on the
    command line) and numpy's 'expected non-negative integer' for a negative seed; each is one error: line now."""
    pool = _write_jsonl(tmp_path / "pool.jsonl", [{**r, "source": "s"} for r in _records(10)])
    (tmp_path / "taken.jsonl").write_text("{}\n")
    fill = {"pool": pool, "dir": tmp_path}
    extra = [a.format(**fill) for a in extra]
    if "--output" not in extra:
        extra += ["--output", tmp_path / "sample.jsonl"]
    code, err = _command_line(monkeypatch, capsys, "sample_pool", "--pool", pool, *extra)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + message.format(**fill)), err
    assert not (tmp_path / "sample.jsonl").exists() and (tmp_path / "taken.jsonl").read_text() == "{}\n"


def test_exclude_categories_matching_no_category_is_refused(tmp_path):
    """Issue 57: a misspelt ``exclude_categories`` pattern excluded nothing and the selection was written as if the
    option had not been given (exit 0); matching everything was already refused."""
    import pandas as pd

    from iprox_lightning.errors import UserInputError

    pool = _write_jsonl(tmp_path / "pool.jsonl", _records(8))
    table = tmp_path / "scores.parquet"
    pd.DataFrame({"id": [f"r{j}" for j in range(8)], "score": [float(j) for j in range(8)]}).to_parquet(table)
    args = ["select", "--scores_path", table, "--pool", pool, "--allow_pool_mismatch", "true", "--k", "2", "--output",
            tmp_path / "sel.jsonl", "--quiet", "true"]
    with pytest.raises(UserInputError, match=r"exclude_categories \['A'\] match\(es\) no category of the 8 ranked "
                                             r"candidates \(their categories: 'a', 'b'\)"):
        main([*map(str, args), "--exclude_categories", '["a*", "A"]'])
    assert not (tmp_path / "sel.jsonl").exists()
    main([*map(str, args), "--exclude_categories", '["a*"]'])  # every pattern matches: selected among the rest
    assert [json.loads(line)["id"] for line in (tmp_path / "sel.jsonl").read_text().splitlines()] == ["r6", "r4"]


@pytest.mark.parametrize("how", ["-c", "string", "group file", "group file ="])
def test_a_config_file_cannot_opt_in_to_running_code_by_another_spelling(tmp_path, monkeypatch, how):
    """Issue 57: the opt-in check read only ``--config FILE`` and boolean values: ``-c FILE``, ``"true"`` / ``"False"``
    as strings (the parser reads them as booleans) and a group given as a file (``--data d.yaml``) set
    trust_remote_code / weights_only from a file (checked: ``--print_config`` showed ``trust_remote_code: true``)."""
    from iprox_lightning.errors import UserInputError

    monkeypatch.delenv("IPROX_ALLOW_CODE", raising=False)
    cfg = tmp_path / "shared.yaml"
    if how == "-c":
        cfg.write_text("data:\n  init_args:\n    trust_remote_code: true\n")
        args, dotted = ["-c", str(cfg)], "data.init_args.trust_remote_code: true"
    elif how == "string":
        cfg.write_text("ckpt_path: x.ckpt\nweights_only: 'False'\n")
        args, dotted = ["--config", str(cfg)], "weights_only: false"
    else:
        cfg.write_text("init_args:\n  trust_remote_code: 'yes'\n")
        args = ["--data", str(cfg)] if how == "group file" else [f"--data={cfg}"]
        dotted = "data.init_args.trust_remote_code: true"
    with pytest.raises(UserInputError, match=rf"^{cfg}: {dotted} would run code .* a config file cannot opt in"):
        main(["fit", "--config", "configs/warmup.yaml", *args])


@pytest.mark.parametrize("text,message", [('{"model": {"name": "x"', r"malformed JSON \(.* the file is cut short\)"),
                                          ("[1, 2]", r"holds a JSON array, not an object"),
                                          (b"\xff\xfe{}", r"not UTF-8 text \(byte offset 0\)")])
def test_a_cut_or_foreign_settings_or_selection_meta_names_the_file(tmp_path, text, message):
    """Issue 57: a score directory's settings.json or a selection's .meta.json that is a JSON array or not UTF-8 raised
    AttributeError / UnicodeDecodeError (a cut one was named already); each reader now goes through io/jsonfile."""
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.io.scores import read_settings
    from iprox_lightning.io.selection import read_meta

    for path, read, arg in [(tmp_path / "settings.json", read_settings, tmp_path),
                            (tmp_path / "sel.jsonl.meta.json", read_meta, tmp_path / "sel.jsonl")]:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(UserInputError, match=rf"^{path} \((score settings|selection meta)[^)]*\): {message}"):
            read(arg)


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_half_written_output(tmp_path, monkeypatch, capsys):
    """A write the disk refuses (ENOSPC) ends a command with one line naming the file and saying what to do; the
    output is not created and no temporary file is left (the write goes to a temporary and is renamed when done)."""
    import builtins
    import errno
    import sys

    import iprox_lightning.io.atomic as atomic
    from iprox_lightning.cli import main

    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"r{i}", "instruction": f"q{i}", "response": f"a{i}", "source": "s"})
                            + "\n" for i in range(10)))
    out = tmp_path / "out" / "sample.jsonl"

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, text):
            if self.written:  # the first line fits, the second does not
                raise OSError(errno.ENOSPC, "No space left on device", self.f.name)
            self.written += len(text)
            return self.f.write(text)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    # every writer goes through io/atomic.py (issue 61), so its open is the one the disk refuses
    monkeypatch.setattr(atomic, "open", lambda *a, **k: FullDisk(builtins.open(*a, **k)), raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "sample_pool", "--pool", str(pool), "--n", "5", "--output", str(out)])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the disk is full writing {out} ")  # the file, not its temporary
    assert "run the same command again" in err[0]
    assert not out.exists() and list(out.parent.iterdir()) == []
