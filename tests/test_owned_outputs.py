"""Issue 61, data loss: the package deletes only what it wrote (a marker in every directory it creates), an output
never replaces an input (compared by device and inode, not by path), and a pool's ids keep their JSON type through
a selection. Each case of the issue through the command line (``iprox_lightning.cli.main``) or the public API, plus a
symbolically linked and a hard-linked target."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from iprox_lightning.cli import main
from iprox_lightning.io.ownership import MARKER, make_owned_dir, mark_file, owned_kind

pytestmark = pytest.mark.usefixtures("one_thread")


def _command_line(monkeypatch, capsys, *args):
    """``python train.py <args>`` as the process's command line: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, args)])
    monkeypatch.delenv("IPROX_DEBUG", raising=False)
    capsys.readouterr()  # what the test's own set-up printed
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code, capsys.readouterr().err.splitlines()


def _user_files(d: Path, n: int = 4) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    for j in range(n):
        (d / f"file{j}.txt").write_text(f"user data {j}")
    (d / "thesis.tex").write_text("\\documentclass{article}")
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _contents(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _check_cache(root: Path) -> Path:
    """A check cache as ``train.py check`` writes it (through its own writer): marked when created."""
    import torch

    from iprox_lightning.io.tensor_cache import TensorCache

    TensorCache(root, kind="check cache").save("validation", "abc", {"V0": torch.ones(3)}, {"keys": ["a"]})
    return root


# ------------------------------------------------------------------------------------------------ cache --clear
def test_cache_clear_under_a_home_keeps_a_users_cache_folder(tmp_path, monkeypatch, capsys):
    """``cache --under ~ --clear true`` deleted ``project/cache/`` with the user's thesis: a folder named ``cache``
    without the package's marker is not ours; the package's own check cache beside it is cleared."""
    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "ipx"))
    home = tmp_path / "home"
    before = _user_files(home / "project" / "cache")
    ours = _check_cache(home / "runs" / "check" / "cache")
    assert owned_kind(ours) == "check cache" and owned_kind(home / "project" / "cache") is None
    assert main(["cache", "--under", str(home)]) == [str(ours)]
    main(["cache", "--under", str(home), "--clear", "true"])
    assert "cache: cleared" in capsys.readouterr().out
    assert not ours.exists() and (home / "runs" / "check").is_dir()
    assert _contents(home / "project" / "cache") == before


def test_cache_under_a_folder_named_cache_is_never_itself_an_entry(tmp_path, monkeypatch, capsys):
    """``cache --under <a folder named cache> --clear true`` deleted the folder itself (4 of 4 user files); the
    folder given is never an entry, even when it is the package's own cache."""
    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "ipx"))
    user = tmp_path / "cache"
    before = _user_files(user)
    assert main(["cache", "--under", str(user), "--clear", "true"]) == []
    assert _contents(user) == before
    ours = _check_cache(tmp_path / "out" / "cache")
    assert main(["cache", "--under", str(ours), "--clear", "true"]) == []
    assert owned_kind(ours) == "check cache" and (ours / "validation" / "abc.safetensors").is_file()
    assert "is itself a check cache" in capsys.readouterr().out


def test_iprox_cache_holding_user_models_and_gguf_keeps_them(tmp_path, monkeypatch, capsys):
    """With ``IPROX_CACHE`` at a folder holding the user's ``models/`` and ``gguf/``, ``cache --clear true`` deleted
    ``models/my-finetune`` and ``gguf/llama-3.gguf``; only the package's marked GGUF copies and model files go."""
    from iprox_lightning.models.builtin import builtin_tokenizer
    from iprox_lightning.models.loading import _write_cache
    from iprox_lightning.models.tiny import tiny_causal_lm

    root = tmp_path / "ipx"
    monkeypatch.setenv("IPROX_CACHE", str(root))
    mine = root / "models" / "my-finetune"
    before = _user_files(mine)
    (root / "gguf").mkdir()
    (root / "gguf" / "llama-3.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    copy = root / "gguf" / "tiny-0123456789abcdef"
    _write_cache(tiny_causal_lm("llama", seed=1, vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2,
                                num_kv_heads=1), builtin_tokenizer(), copy)  # the package's GGUF copy writer
    assembled = root / "models" / "gemma.gguf"
    assembled.write_bytes(b"GGUF" + b"\1" * 50)
    mark_file(assembled, "model file")  # as the test suite's assembler marks what it writes
    listed = main(["cache"])
    text = capsys.readouterr().out
    assert sorted(listed) == sorted([str(copy), str(assembled)])
    assert "not ours, kept" in text and str(mine) in text and str(root / "gguf" / "llama-3.gguf") in text
    main(["cache", "--clear", "true"])
    assert not copy.exists() and not assembled.exists() and not list((root / "models").glob(".*iprox.json"))
    assert _contents(mine) == before and (root / "gguf" / "llama-3.gguf").read_bytes().startswith(b"GGUF")
    assert "kept 2 entries not written by iprox_lightning" in capsys.readouterr().out


def test_cache_keeps_a_symlinked_and_a_hard_linked_copy_of_its_own_cache(tmp_path, monkeypatch, capsys):
    """A symbolic link to a cache, and a copy of a cache made of hard links (``cp -al``: the marker file too) or a
    plain copy, are not the package's: the marker counts only in the directory it was written in."""
    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "ipx"))
    ours = _check_cache(tmp_path / "a" / "cache")
    backup = tmp_path / "backup" / "cache"
    shutil.copytree(ours, backup, copy_function=os.link)  # cp -al: every file a hard link, the marker too
    assert os.stat(backup / MARKER).st_ino == os.stat(ours / MARKER).st_ino
    shutil.copytree(ours, tmp_path / "copy" / "cache")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "cache").symlink_to(ours)
    for d in (backup, tmp_path / "copy" / "cache", tmp_path / "links" / "cache"):
        assert owned_kind(d) is None
    user = _user_files(tmp_path / "user")  # the user's files reached from inside the package's cache
    (ours / "to-user").symlink_to(tmp_path / "user")
    os.link(tmp_path / "user" / "thesis.tex", ours / "thesis-link.tex")
    main(["cache", "--under", str(tmp_path), "--clear", "true"])
    assert not ours.exists() and _contents(tmp_path / "user") == user  # links removed, never followed
    assert (backup / "validation" / "abc.safetensors").is_file()  # its only link now: kept
    assert (tmp_path / "copy" / "cache" / "validation" / "abc.safetensors").is_file()
    assert (tmp_path / "links" / "cache").is_symlink()
    text = capsys.readouterr().out
    assert "not ours, kept" in text and str(backup) in text  # an older-looking cache without marker: listed, kept


def test_cache_under_root_lists_no_system_folder_and_a_vanishing_folder_is_skipped(tmp_path, monkeypatch, capsys):
    """``cache --under /`` listed 67 system folders named ``cache`` (site-packages too) as the package's, and a temp
    folder that vanished during the walk gave ``FileNotFoundError``."""
    import iprox_lightning.io.caches as caches
    from iprox_lightning.models.loading import cache_root
    from iprox_lightning.io import ownership

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "ipx"))
    site = tmp_path / "lib" / "python3" / "site-packages"
    for pkg in ("pip/_internal/cache", "jedi/cache", "torch/cache"):
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
    gone = tmp_path / "tmp"
    for j in range(3):
        (gone / f"t{j}" / "cache" / "scores").mkdir(parents=True)
    real = ownership.owned_kind

    def vanishing(path):  # another process removes the temp folders while the walk is under way
        if Path(path).name == "cache" and gone in Path(path).parents:
            shutil.rmtree(Path(path), ignore_errors=True)
        return real(path)

    monkeypatch.setattr(ownership, "owned_kind", vanishing)
    assert main(["cache", "--under", str(tmp_path)]) == []
    monkeypatch.setattr(ownership, "owned_kind", real)
    assert all((site / p).is_dir() for p in ("pip/_internal/cache", "jedi/cache", "torch/cache"))
    listed = caches.cache_entries(cache_root(), [str(Path(sys.prefix))])  # a real site-packages: none of its folders is ours
    assert [e for e in listed if e.ours] == []


def test_an_older_versions_cache_without_marker_is_listed_kept_and_left_to_the_user(tmp_path, monkeypatch, capsys):
    """Caches written before markers hold none: ``cache --under`` lists one that looks like a check / store cache as
    not ours and says to delete it by hand; ``--clear`` and ``check --keep_validation_cache false`` keep it."""
    from iprox_lightning.workflow.check import _drop_validation_cache
    from iprox_lightning.scoring.check_cache import CheckCache

    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "ipx"))
    old = tmp_path / "outputs" / "check" / "cache"
    (old / "validation").mkdir(parents=True)
    (old / "validation" / "0123.safetensors").write_bytes(b"\0" * 64)
    (old / "scores").mkdir()
    (old / "scores" / "0123.parquet").write_bytes(b"PAR1")
    assert main(["cache", "--under", str(tmp_path / "outputs"), "--clear", "true"]) == []
    out = capsys.readouterr().out
    assert "not ours, kept" in out and str(old) in out and "delete it by hand" in out
    _drop_validation_cache(CheckCache(old))
    assert "holds no check cache marker" in capsys.readouterr().out
    assert (old / "validation" / "0123.safetensors").is_file() and (old / "scores" / "0123.parquet").is_file()


# ------------------------------------------------------------------------------------------------ --overwrite
def _proxy(tmp_path):
    from iprox_lightning import compress_model, save_proxy
    from iprox_lightning.models.builtin import builtin_tokenizer
    from iprox_lightning.models.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", seed=3, vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2,
                           num_kv_heads=1)
    compress_model(model, None, 0.5, method="svd", progress=False)
    return save_proxy(model, builtin_tokenizer(), tmp_path / "proxy", target_model="tiny-llama")


def _plain_model(d: Path) -> Path:
    """A warmed-up target as ``save_pretrained`` leaves it: config, weights, tokenizer (no export marker)."""
    from iprox_lightning.models.builtin import builtin_tokenizer
    from iprox_lightning.models.tiny import tiny_causal_lm

    tiny_causal_lm("llama", seed=5, vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2,
                   num_kv_heads=1).save_pretrained(d)
    builtin_tokenizer().save_pretrained(d)
    return d


def test_export_overwrite_refuses_a_plain_model_dir_and_links_to_it(tmp_path, monkeypatch, capsys):
    """``export_proxy --overwrite true`` onto the warmed-up target (a plain model directory, no export marker)
    replaced the model, rc 0: now one error line naming the directory, and the model is untouched. A symbolic link
    to it, a symbolic link to a real export and a hard-linked copy of an export are refused too; a marked export is
    replaced."""
    proxy = _proxy(tmp_path)
    target = _plain_model(tmp_path / "warmup" / "model")
    before = _contents(target)
    code, err = _command_line(monkeypatch, capsys, "export_proxy", "--proxy", proxy, "--output", target,
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and str(target) in err[0]
    assert f"holds no {MARKER} marker" in err[0]
    assert _contents(target) == before
    (tmp_path / "link").symlink_to(target)
    code, err = _command_line(monkeypatch, capsys, "export_proxy", "--proxy", proxy, "--output", tmp_path / "link",
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "is a symbolic link" in err[0] and _contents(target) == before
    export = tmp_path / "dense"
    main(["export_proxy", "--proxy", str(proxy), "--output", str(export)])
    assert owned_kind(export) == "proxy export"
    (tmp_path / "elink").symlink_to(export)
    code, err = _command_line(monkeypatch, capsys, "export_proxy", "--proxy", proxy, "--output", tmp_path / "elink",
                              "--overwrite", "true")
    assert code == 2 and "is a symbolic link" in err[0] and owned_kind(export) == "proxy export"
    hard = tmp_path / "dense-backup"
    shutil.copytree(export, hard, copy_function=os.link)
    hard_before = _contents(hard)
    code, err = _command_line(monkeypatch, capsys, "export_proxy", "--proxy", proxy, "--output", hard,
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and str(hard) in err[0] and _contents(hard) == hard_before
    main(["export_proxy", "--proxy", str(proxy), "--output", str(export), "--overwrite", "true", "--dtype", "bfloat16"])
    assert json.loads((export / "iprox_export.json").read_text())["dtype"] == "bfloat16"
    assert owned_kind(export) == "proxy export"


def test_overwrite_of_scores_and_stores_clears_only_marked_directories(tmp_path):
    """``--overwrite`` of a scoring output (InfluenceWriter, query, the pipeline's ``--force``) and of a gradient
    store cleared ``shards/``, ``scores.parquet``, ``store.json`` and ``cache/`` of any directory: now only of one
    the package marked as that kind."""
    from iprox_lightning.errors import OutputExistsError
    from iprox_lightning.io.gradient_store import clear_store
    from iprox_lightning.io.score_dir import clear_output

    users = tmp_path / "mine"
    (users / "shards").mkdir(parents=True)
    (users / "shards" / "notes.txt").write_text("keep")
    (users / "cache").mkdir()
    (users / "settings.json").write_text("{}")
    with pytest.raises(OutputExistsError, match=rf"refusing to replace {users} .*holds no {MARKER} marker"):
        clear_output(users)
    with pytest.raises(OutputExistsError, match=rf"refusing to replace {users} "):
        clear_store(users)
    assert (users / "shards" / "notes.txt").read_text() == "keep" and (users / "settings.json").exists()
    scores = tmp_path / "scores"
    make_owned_dir(scores, "scores")
    (scores / "shards").mkdir()
    (scores / "scores.parquet").write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="is a scores the package wrote, not a gradient store"):
        clear_store(scores)
    clear_output(scores)
    assert not (scores / "shards").exists() and not (scores / "scores.parquet").exists()


def test_a_scoring_run_with_overwrite_refuses_an_unmarked_output_dir(tmp_path):
    """Through the writer: ``InfluenceWriter(overwrite=True)`` into a directory of the user's holding ``shards/``
    stops before anything is deleted; into the directory a first run created it starts fresh."""
    from iprox_lightning.errors import OutputExistsError
    from test_artifacts import DM, score

    first = tmp_path / "run"
    score(first, DM())
    assert owned_kind(first) == "scores"
    score(first, DM(), overwrite=True)
    users = tmp_path / "users"
    (users / "shards").mkdir(parents=True)
    (users / "shards" / "data.bin").write_bytes(b"1")
    with pytest.raises(OutputExistsError, match=rf"{users}"):
        score(users, DM(), overwrite=True)
    assert (users / "shards" / "data.bin").read_bytes() == b"1"


# ------------------------------------------------------------------------------------------------ outputs vs inputs
def test_plan_output_never_replaces_the_models_config_and_a_dir_is_one_line(tmp_path, monkeypatch, capsys):
    """``plan --model DIR --output DIR/config.json`` replaced the model's config with the plan; ``--output <a dir>``
    was a traceback. Both one error line now; a link to the config is caught too."""
    from iprox_lightning.models.tiny import tiny_causal_lm

    model = tmp_path / "model"
    tiny_causal_lm("llama", seed=1, vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2,
                   num_kv_heads=1).config.save_pretrained(model)
    before = (model / "config.json").read_bytes()
    code, err = _command_line(monkeypatch, capsys, "plan", "--model", model, "--output", model / "config.json")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --output {model / 'config.json'} is inside the "
                                                             f"model directory {model}")
    os.link(model / "config.json", tmp_path / "cfg-link.json")
    code, err = _command_line(monkeypatch, capsys, "plan", "--model", model / "config.json", "--output",
                              tmp_path / "cfg-link.json")
    assert code == 2 and len(err) == 1 and "is the model file" in err[0]
    code, err = _command_line(monkeypatch, capsys, "plan", "--model", model, "--output", tmp_path)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --output {tmp_path} is a directory; name a file")
    assert (model / "config.json").read_bytes() == before
    main(["plan", "--model", str(model), "--output", str(tmp_path / "plan.json")])
    assert json.loads((tmp_path / "plan.json").read_text())["stages"]


def test_a_trained_or_extracted_model_never_replaces_the_model_it_starts_from(tmp_path, monkeypatch, capsys):
    """``save_dir`` of warm-up / fine-tune / build_proxy and ``layer_extraction --output_dir`` at the model read (or
    a symbolic link to it): ``save_pretrained`` would have written over its weights at the end of the run. Refused
    when the module is made, before any training, by the same identity guard."""
    from iprox_lightning.alignment.module import ProxyAlignModule
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.training.causal_lm import CausalLMModule

    model = _plain_model(tmp_path / "model")
    (tmp_path / "alias").symlink_to(model)
    before = _contents(model)
    with pytest.raises(UserInputError, match=rf"^save_dir {tmp_path / 'alias'} is the model directory {model}"):
        CausalLMModule(model=str(model), save_dir=str(tmp_path / "alias"))
    with pytest.raises(UserInputError, match=rf"^save_dir {model} is the target directory {model}"):
        ProxyAlignModule(target=str(model), save_dir=str(model))
    code, err = _command_line(monkeypatch, capsys, "layer_extraction", "--model", model, "--output_dir", model)
    assert code == 2 and len(err) == 1 and f"output_dir {model} is the model directory" in err[0]
    assert _contents(model) == before
    CausalLMModule(model=str(model), save_dir=str(tmp_path / "trained"))  # another directory: fine


def _pool(path: Path, n: int = 40) -> Path:
    """A pool whose ids mix integers and strings (every other line)."""
    path.write_text("".join(json.dumps({"id": j if j % 2 else f"ex-{j}", "instruction": f"say {j}",
                                        "response": f"ok {j}", "category": "a" if j % 3 else "b"}) + "\n"
                            for j in range(n)))
    return path


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_random_scores_and_select_never_write_onto_a_link_of_their_input(tmp_path, monkeypatch, capsys, link):
    """``random_scores --output`` onto a hard link of the pool overwrote the pool (the guard compared paths); the
    same for ``select`` onto a link of its score table or the pool and ``sample_pool`` onto a link of the pool."""
    pool = _pool(tmp_path / "pool.jsonl")
    before = pool.read_bytes()
    alias = tmp_path / "alias.jsonl"
    os.link(pool, alias) if link == "hard" else alias.symlink_to(pool)
    code, err = _command_line(monkeypatch, capsys, "random_scores", "--output", alias, "--pool", pool,
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and f"is the pool file {pool}" in err[0] and pool.read_bytes() == before
    code, err = _command_line(monkeypatch, capsys, "sample_pool", "--pool", pool, "--n", "4", "--by", "category",
                              "--output", alias, "--overwrite", "true")
    assert code == 2 and len(err) == 1 and pool.read_bytes() == before
    table = tmp_path / "scores.parquet"
    main(["random_scores", "--output", str(table), "--pool", str(pool)])
    table_before = table.read_bytes()
    t_alias = tmp_path / "t-alias.parquet"
    os.link(table, t_alias) if link == "hard" else t_alias.symlink_to(table)
    code, err = _command_line(monkeypatch, capsys, "select", "--scores_path", t_alias, "--k", "3", "--output", t_alias,
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "is the score table being read" in err[0]
    code, err = _command_line(monkeypatch, capsys, "select", "--scores_path", table, "--k", "3", "--pool", pool,
                              "--output", alias, "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "is the pool file" in err[0]
    assert pool.read_bytes() == before and table.read_bytes() == table_before


# ------------------------------------------------------------------------------------------------ ids round-trip
def test_a_selection_keeps_each_pool_ids_json_type(tmp_path, capsys):
    """A pool whose ids mix ints and strings: the selection wrote the integer ids as strings (20 of 40 lines changed
    the id's JSON type, so a join on id downstream missed them). Each selected line keeps the pool's id exactly, and
    so does a pool sample; the selection reads back and fine-tunes as before."""
    from iprox_lightning.io.selection import read_selection

    pool = _pool(tmp_path / "pool.jsonl")
    by_key = {json.dumps(json.loads(line)["id"]): json.loads(line) for line in pool.read_text().splitlines()}
    table = tmp_path / "scores.parquet"
    main(["random_scores", "--output", str(table), "--pool", str(pool)])
    out = tmp_path / "selected.jsonl"
    main(["select", "--scores_path", str(table), "--k", "40", "--pool", str(pool), "--output", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 40 and sum(isinstance(x["id"], int) for x in lines) == 20
    for x in lines:  # the same id, the same JSON type, the same record
        src = by_key[json.dumps(x["id"])]
        assert type(x["id"]) is type(src["id"]) and x["instruction"] == src["instruction"]
    assert sorted(str(r["id"]) for r in read_selection(out)) == sorted(str(k) for k in
                                                                        (json.loads(k) for k in by_key))
    sample = tmp_path / "sample.jsonl"
    main(["sample_pool", "--pool", str(pool), "--n", "10", "--by", "category", "--output", str(sample)])
    for x in map(json.loads, sample.read_text().splitlines()):
        assert type(x["id"]) is type(by_key[json.dumps(x["id"])]["id"])
    main(["sample_pool", "--pool", str(pool), "--n", "10", "--by", "category", "--output", str(sample)])
    assert "already there, unchanged" in capsys.readouterr().out


def test_overwrite_of_a_file_output_replaces_only_a_file_of_the_commands_kind(tmp_path, monkeypatch, capsys):
    """``--overwrite true`` of ``random_scores``, ``select`` and ``sample_pool`` replaces a score table, a selection
    (its ``.meta.json`` beside it) or a sample the package wrote; a file of the user's under that name, or a symbolic
    link, is refused in one line and kept."""
    pool = _pool(tmp_path / "pool.jsonl")
    mine = tmp_path / "mine.parquet"
    mine.write_text("my own notes, not a table\n")
    code, err = _command_line(monkeypatch, capsys, "random_scores", "--output", mine, "--pool", pool,
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "is not a score table: not replaced" in err[0]
    table = tmp_path / "scores.parquet"
    main(["random_scores", "--output", str(table), "--pool", str(pool)])
    main(["random_scores", "--output", str(table), "--pool", str(pool), "--seed", "3", "--overwrite", "true"])
    (tmp_path / "table-link.parquet").symlink_to(table)
    code, err = _command_line(monkeypatch, capsys, "random_scores", "--output", tmp_path / "table-link.parquet",
                              "--pool", pool, "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "is a symbolic link" in err[0]
    notes = tmp_path / "notes.jsonl"
    notes.write_text("keep me\n")
    code, err = _command_line(monkeypatch, capsys, "select", "--scores_path", table, "--k", "3", "--output", notes,
                              "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "a file of unknown origin" in err[0]
    code, err = _command_line(monkeypatch, capsys, "sample_pool", "--pool", pool, "--n", "4", "--by", "category",
                              "--output", notes, "--overwrite", "true")
    assert code == 2 and len(err) == 1 and "is not a JSONL file of records: not replaced" in err[0]
    assert notes.read_text() == "keep me\n" and mine.read_text() == "my own notes, not a table\n"
