"""Sizes read from a file are bounded before anything is built from them, and numeric plan options are checked
(issue 61): an absurd layer count in a config-only model directory (``plan`` grew past 3 GB), a GGUF whose tensors
are not the model its metadata describes (``predict`` built a default-size Llama, 4 GB in 17 s), a pool of 1 MB ids
(``build_store`` grew to 875 MB and failed inside safetensors), ``plan --validation_examples -1`` (a plan, exit 0).

Each refusal is one ``error:`` line naming the file and the field, and the process that refuses stays small: its peak
RSS is measured in a fresh process (``resource.getrusage`` of a wrapper whose only child is the command)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PEAK_MB = 1500
"""Peak RSS a refusing command may reach: the interpreter with torch, transformers and Lightning imported is 500-800
MB here; the cases above grew to 3-4 GB and more before they were killed."""

_WRAPPER = """
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=600)
print(json.dumps({"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                  "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _measured(args: list[str], cwd: Path, env: dict | None = None) -> dict:
    """``python train.py <args>`` in a fresh process: its exit code, output and peak RSS in MB."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run([sys.executable, "-c", _WRAPPER, sys.executable, str(ROOT / "train.py"), *args], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _one_error_line(res: dict) -> str:
    assert res["rc"] == 2, (res["rc"], res["stderr"][-2000:])
    lines = [l for l in res["stderr"].splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in res["stderr"], res["stderr"][-2000:]
    return errors[0]


# ------------------------------------------------------------------------------------------------ model configs
def test_plan_refuses_a_config_with_an_absurd_layer_count_without_building_it(tmp_path):
    """Before: ``plan`` on this config-only directory grew past 3 GB (transformers' config and the meta model hold
    objects per layer)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 10**9, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "vocab_size": 100}))
    res = _measured(["plan", "--model", str(model)], tmp_path)
    line = _one_error_line(res)
    assert line.startswith(f"error: {model / 'config.json'}: num_hidden_layers = 1000000000 layers, more than any "
                           "model this package plans or loads (1,024 at most)"), line
    assert res["peak_mb"] < PEAK_MB, res["peak_mb"]


@pytest.mark.parametrize("key, value, message", [
    ("vocab_size", 10**12, "vocab_size = 1000000000000 vocabulary, more than any model this package plans or loads "
                           "(4,194,304 at most)"),
    ("intermediate_size", [64, 2**40], "intermediate_size = 1099511627776 intermediate size, more than any model"),
    ("num_attention_heads", -4, "num_attention_heads = -4 is not a size (a non-negative integer)"),
    ("hidden_size", "64", "hidden_size = '64' is not a size (a non-negative integer)"),
])
def test_a_model_directory_with_a_size_out_of_bounds_is_refused_when_loaded(tmp_path, key, value, message):
    from iprox_lightning import load_model
    from iprox_lightning.errors import UserInputError

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "vocab_size": 100, key: value}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserInputError, match=rf"^{model / 'config.json'}: {message}".replace("(", r"\(").replace(")", r"\)")):
        load_model(str(model), tokenizer=False)


def test_a_sub_config_is_bounded_too(tmp_path):
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.models.bounds import check_config_sizes

    check_config_sizes({"model_type": "gemma3", "text_config": {"num_hidden_layers": 26, "vocab_size": 262144}}, "c")
    with pytest.raises(UserInputError, match=r"^c: text_config\.num_hidden_layers = 5000 layers"):
        check_config_sizes({"model_type": "gemma3", "text_config": {"num_hidden_layers": 5000}}, "c")


# ------------------------------------------------------------------------------------------------ GGUF
def _gguf(path: Path, tensors: dict, **sizes) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in sizes.items():
        getattr(w, f"add_{key}")(v)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_whose_tensors_are_not_its_architecture_is_refused_before_the_model_is_built(tmp_path):
    """One 1-element tensor, architecture llama, no sizes: ``check_gguf`` passed it and ``predict`` built
    transformers' default-size Llama (6.6B parameters; 4 GB in 17 s before the watchdog killed it)."""
    import numpy as np

    path = _gguf(tmp_path / "one.gguf", {"token_embd.weight": np.zeros((1,), np.float32)})
    script = f"""
import resource, sys
from iprox_lightning import load_model
from iprox_lightning.errors import UserInputError
import transformers, torch  # imported before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_model({str(path)!r})
except UserInputError as e:
    print(e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""
    import os

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "IPROX_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    message, growth = out.stdout.strip().splitlines()
    assert message.startswith(f"{path}: its tensors hold 1 weights, but the llama model its metadata describes "
                              "(num hidden layers 32, hidden size 4096, intermediate size 11008, vocab size 32000) "
                              "has 6,607,343,616 parameters: the tensors do not match the architecture"), message
    assert float(growth) < 500, growth  # the default-size model is built on the meta device only


def test_a_gguf_whose_tensors_match_its_metadata_passes(tmp_path):
    """The check compares element counts only: a GGUF holding the weights of the model its metadata describes (a
    one-layer Llama of width 8) passes, and its config is the one transformers reads."""
    import numpy as np

    from iprox_lightning.models.bounds import gguf_config
    from iprox_lightning.models.loading import check_gguf

    h, f, v = 8, 16, 32
    tensors = {"token_embd.weight": np.zeros((v, h), np.float32), "output_norm.weight": np.ones(h, np.float32),
               "blk.0.attn_norm.weight": np.ones(h, np.float32), "blk.0.ffn_norm.weight": np.ones(h, np.float32)}
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        tensors[f"blk.0.{name}.weight"] = np.zeros((h, h), np.float32)
    tensors.update({"blk.0.ffn_gate.weight": np.zeros((f, h), np.float32),
                    "blk.0.ffn_up.weight": np.zeros((f, h), np.float32),
                    "blk.0.ffn_down.weight": np.zeros((h, f), np.float32)})
    path = _gguf(tmp_path / "tiny.gguf", tensors, block_count=1, embedding_length=h, feed_forward_length=f,
                 head_count=2, head_count_kv=2, vocab_size=v, context_length=16)
    config = gguf_config(path, check_gguf(path))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size) == (1, h, f, v)


def test_a_gguf_with_an_absurd_size_in_its_metadata_is_refused_by_check_gguf(tmp_path):
    import numpy as np

    from iprox_lightning.errors import UserInputError
    from iprox_lightning.models.loading import check_gguf

    path = _gguf(tmp_path / "deep.gguf", {"token_embd.weight": np.zeros((4, 2), np.float32)}, block_count=10**9)
    with pytest.raises(UserInputError, match=rf"^{path}: metadata llama.block_count: num_hidden_layers = 1000000000 "
                                             r"layers, more than any model this package plans or loads"):
        check_gguf(path)
    res = _measured(["plan", "--model", str(path)], tmp_path)
    assert _one_error_line(res).startswith(f"error: {path}: metadata llama.block_count: num_hidden_layers = 1000000000")
    assert res["peak_mb"] < PEAK_MB, res["peak_mb"]


# ------------------------------------------------------------------------------------------------ ids
def test_build_store_refuses_a_pool_id_above_the_bound_up_front(tmp_path):
    """Before: a 1 MB id grew ``build_store`` to 875 MB and failed inside safetensors (header too large, a traceback),
    leaving the store unfinished. Now the pool's row is refused as it is read, before the store is started."""
    from iprox_lightning.io.records import MAX_ID_BYTES

    rows = [{"id": f"r{i}", "instruction": f"Add {i} and 2.", "response": str(i + 2), "category": "addition"}
            for i in range(20)]
    rows[3]["id"] = "é" * (1 << 19)  # 1 MiB of UTF-8 in 512 Ki characters
    pool = tmp_path / "pool.jsonl"
    pool.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp_path / "store"
    res = _measured(["build_store", "--model", "builtin", "--pool", str(pool), "--output_dir", str(store),
                     "--progress", "false"], tmp_path)
    assert _one_error_line(res) == (
        f"error: {pool}, line 4: field 'id' (id) is 1,048,576 bytes, more than an id may be ({MAX_ID_BYTES:,} bytes of "
        "UTF-8): ids are kept in every score table, selection and store shard; give the row a shorter id "
        "(--debug shows the traceback)")
    assert not store.exists()
    assert res["peak_mb"] < PEAK_MB, res["peak_mb"]
    rows[3]["id"] = "é" * (MAX_ID_BYTES // 2)  # at the bound: read
    from iprox_lightning.data.sources import read_records

    pool.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_records(str(pool))[3]["id"] == rows[3]["id"]


# ------------------------------------------------------------------------------------------------ plan options
@pytest.mark.parametrize("option, value, message", [
    ("validation_examples", "-1", "validation_examples must be >= 1, got -1"),
    ("align_epochs", "-1", "align_epochs must be >= 0, got -1"),
    ("kfac_examples", "0", "plan: kfac_examples must be >= 1, got 0"),  # ScoringConfig's check, named by its owner
    ("num_probe_tokens", "-5", "num_probe_tokens must be >= 1, got -5"),
    ("tasks", "0", "tasks must be >= 1, got 0"),
    ("select_k", "-1", "select_k must be >= 1, got -1"),
    ("k", "0", "store_k must be >= 1, got 0"),
    ("pool_size", "-3", "pool_size must be >= 1, got -3"),
    ("response_share", "0", "response_share must be in (0, 1], got 0.0"),
    ("sparsity", "1.5", "sparsity must be in (0, 1), got 1.5"),
])
def test_plan_refuses_a_negative_or_out_of_range_number_in_one_line(option, value, message, capsys):
    """Before: ``--validation_examples -1`` and ``--align_epochs -1`` printed a plan, exit 0."""
    from iprox_lightning.cli import main
    from iprox_lightning.errors import UserInputError

    with pytest.raises(UserInputError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]") + "$"):
        main(["plan", "--model", "smollm2-135m", f"--{option}", value])
    assert "peak/device" not in capsys.readouterr().out  # no plan printed


def test_plan_takes_zero_alignment_epochs():
    """``align_epochs 0``: the IPSVD-only proxy, a valid plan."""
    from iprox_lightning.cli import main

    rows = main(["plan", "--model", "smollm2-135m", "--align_epochs", "0"])
    assert any("alignment" in r["stage"] for r in rows)
