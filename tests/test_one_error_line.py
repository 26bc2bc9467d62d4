"""Issue 61 (Deliver 5): one ``error:`` line, naming the file or option, instead of a traceback, for each bad input
or fault of the issue's list; each test goes through the command line (``main`` or ``python train.py``) or the
public API, as a user hits it."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from iprox_lightning.cli import main
from iprox_lightning.errors import OutputNotDirectoryError, UserInputError

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _train(*args, cwd, timeout=300, **kw):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout, **kw)


def _one_error_line(r, start: str) -> str:
    """The stderr of ``r`` is one ``error:`` line beginning ``start`` (Lightning's INFO lines aside)."""
    lines = [line for line in r.stderr.splitlines() if not line.startswith(("INFO", "Seed set"))]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"error: {start}"), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("size", ["1.2.3GB", ".", "1e", "..5GB", "GB"])
def test_plan_device_memory_that_is_no_size_is_refused(size):
    """``plan --device_memory 1.2.3GB`` and ``.`` passed the size pattern and ended in float()'s ValueError."""
    with pytest.raises(UserInputError, match=rf"^device_memory: cannot read {size!r} as a size"):
        main(["plan", "--device_memory", size])


@pytest.mark.parametrize("content,message", [
    (b'{"device": "cpu", "par', r"malformed JSON \(.* the file is cut short\); measure again"),
    (b"\x89PNG\r\n\x1a\n\x00", r"not UTF-8 text"),
    (b"[1, 2]", r"holds a JSON array, not an object"),
    (b'{"device": "cpu", "params": "many"}', r"field 'params' is 'many' \(a JSON string\), not a number"),
    (b'{"device": "cpu", "params": 1, "tokens_per_s": [1]}', r"field 'tokens_per_s' is \[1\]"),
    (b'{"device": "cpu", "params": 1, "tokens_per_s": {"a": "fast"}}', r"field 'tokens_per_s.a' is 'fast'")])
def test_a_corrupt_speed_file_is_one_line_naming_it(tmp_path, content, message):
    """A corrupt ``speed_*.json`` under ``--speed_results`` raised AttributeError / TypeError (a list, a string
    where a number goes) or was skipped; it is refused naming the file and the field."""
    bad = tmp_path / "speed_mine_cpu.json"
    bad.write_bytes(content)
    with pytest.raises(UserInputError, match=rf"^{bad}.*{message}"):
        main(["plan", "--speed_results", str(tmp_path)])


# ------------------------------------------------------------------------------------------------ lock files
@pytest.mark.parametrize("content,holder", [
    ("[1, 2]", "holds a JSON array, not an object"),
    ('{"pid": 99999999999999999999999, "host": "me"}', "field 'pid' is 99999999999999999999999, not a process id"),
    ('{"pid": "12"}', "field 'pid' is '12' (a JSON string), not an integer"),
    ('{"pid": 12, "host": ', "malformed JSON"),
    ("\x00\x01", "malformed JSON")])
def test_a_held_lock_whose_file_is_damaged_still_says_it_is_held(tmp_path, content, holder):
    """A lock file holding a JSON list (AttributeError) or a huge pid (OverflowError in os.kill) gave a traceback
    instead of the "is being written by another" line; the holder is read with the JSON reader's checks."""
    import fcntl

    from iprox_lightning.io.score_dir import OutputLocked

    wd = tmp_path / "wd"
    wd.mkdir()
    lock = wd / ".pipeline.lock"
    lock.write_text(content)
    with open(lock) as held:  # another run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(OutputLocked, match=rf"^{wd} is being written by another pipeline run \(holder unknown: "
                                               rf"{lock}.*{re.escape(holder)}"):
            main(["pipeline", "--workdir", str(wd)])
    assert sorted(p.name for p in wd.iterdir()) == [".pipeline.lock"]  # nothing ran


# ------------------------------------------------------------------------------------------------ pipeline records
@pytest.mark.parametrize("content", [b'{"warmup": 1.', b"\xff\xfe\x00binary", b"[3.5]", b'{"warmup": "slow"}'])
def test_a_cut_or_binary_seconds_per_stage_is_one_line_on_a_rerun(tmp_path, content):
    """A cut or binary ``seconds_per_stage.json`` in the workdir ended a re-run in a JSONDecodeError /
    UnicodeDecodeError traceback; it is refused before any stage, naming the file and what to do."""
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "seconds_per_stage.json").write_bytes(content)
    with pytest.raises(UserInputError, match=rf"^{wd}/seconds_per_stage.json"):
        main(["pipeline", "--workdir", str(wd)])
    # nothing written (the workdir lock is removed on the way out, issue 65; a workdir holding files is not marked)
    assert sorted(p.name for p in wd.iterdir()) == ["seconds_per_stage.json"]


def _scored_workdir(wd: Path) -> Path:
    import random

    from iprox_lightning.io.scores import write_scores

    r = random.Random(0)
    ids = [f"r{i}" for i in range(20)]
    for who in ("target", "proxy"):
        write_scores({i: r.random() for i in ids}, wd / "scores" / who / "scores.parquet")
    return wd


@pytest.mark.parametrize("content,message", [(b'{"retention', r"malformed JSON .* the file is cut short"),
                                             (b"\x00\xff", "not UTF-8 text"), (b"7", "holds a JSON integer")])
def test_report_on_a_damaged_summary_is_one_line(tmp_path, content, message):
    """``report`` on a workdir whose ``summary.json`` is damaged raised JSONDecodeError; it names the file."""
    wd = _scored_workdir(tmp_path / "wd")
    (wd / "summary.json").write_bytes(content)
    with pytest.raises(UserInputError, match=rf"^{wd}/summary.json \(the pipeline's summary\): {message}"):
        main(["report", "--workdir", str(wd)])


# ------------------------------------------------------------------------------------------------ hardware
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU-only refusals")
@pytest.mark.parametrize("args", [["--strategy", "fsdp"], ["--strategy", "deepspeed"],
                                  ["--strategy", "fsdp", "--devices", "2"], ["--strategy", "deepspeed_stage_2"],
                                  ["--strategy", "lightning.pytorch.strategies.FSDPStrategy"]])
def test_a_gpu_strategy_on_cpus_is_refused_before_any_stage(tmp_path, args):
    """``--strategy fsdp`` / ``deepspeed`` on a machine without CUDA ran the warm-up's setup and failed in Lightning
    (a ValueError, or MisconfigurationException for DeepSpeed; with ``--devices 2`` inside a stage process)."""
    wd = tmp_path / "wd"
    with pytest.raises(UserInputError, match=rf"^strategy '{args[1]}' runs on CUDA devices only, and this machine "
                                             "has none: use --strategy ddp"):
        main(["pipeline", "--workdir", str(wd), "--accelerator", "auto", *args])
    assert not wd.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU-only refusal")
def test_a_trainer_the_machine_cannot_run_is_one_line(tmp_path):
    """``fit --trainer.strategy fsdp`` on CPUs: Lightning's ValueError building the Trainer, as one line."""
    with pytest.raises(UserInputError, match=r"^trainer: The strategy `fsdp` requires a GPU accelerator"):
        main(["fit", "--config", str(ROOT / "configs" / "warmup.yaml"), "--trainer.strategy", "fsdp",
              "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
              "--trainer.logger", "false", "--model.init_args.save_dir", str(tmp_path / "model")])


def test_a_failed_stage_process_is_one_line_naming_its_log(tmp_path, monkeypatch):
    """A stage run in its own processes (``--devices 2``) that failed ended the pipeline in a RuntimeError
    traceback with 30 lines of the stage's output; it is one line: the stage's last line and the log's path."""
    from iprox_lightning.workflow.stages import StageProcessFailed, _run_stage_process
    from iprox_lightning.errors import UserError

    monkeypatch.setenv("IPROX_DEBUG", "1")  # the stage's own error keeps its traceback: a failure, not a user error
    log = tmp_path / "logs" / "stage.out"
    with pytest.raises(StageProcessFailed) as e:
        _run_stage_process(["plan", "--device_memory", "."], log, threads=1)
    assert isinstance(e.value, (UserError, RuntimeError)) and "\n" not in str(e.value)
    assert str(e.value).startswith("stage failed (exit 1): python -m iprox_lightning.cli plan --device_memory .; its "
                                   "last line: iprox_lightning.errors.UserInputError: device_memory: cannot read")
    assert str(e.value).endswith(f"(its whole output, the traceback included: {log})") and "Traceback" in log.read_text()


# ------------------------------------------------------------------------------------------------ inputs
def test_build_store_with_an_empty_builtin_pool_is_refused(tmp_path):
    """``build_store --builtin_size 0`` raised generate_builtin_dataset's ValueError deep in the data module."""
    with pytest.raises(UserInputError, match=r"^builtin_size \(the built-in pool's size\) must be an integer >= 1, "
                                             r"got 0"):
        main(["build_store", "--model", "builtin", "--builtin_size", "0", "--output_dir", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("under", [False, True])
def test_check_output_dir_that_is_a_file_is_refused(tmp_path, under):
    """``check --output_dir <an existing file>`` ended in NotADirectoryError making the cache folder."""
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    out = f / "sub" if under else f
    with pytest.raises(OutputNotDirectoryError, match=rf"^--output_dir {out} (is|lies under {f}, which is) a file, "
                                                      "not a directory"):
        main(["check", "--target", "builtin", "--proxy", "builtin", "--output_dir", str(out)])
    assert f.read_text() == "mine"


def test_a_store_whose_layout_rows_are_swapped_is_refused_naming_the_field(tmp_path):
    """A ``store.json`` whose layout lists two same-shaped weights under each other's key passed every check of the
    record and the files, then ``query`` failed in a ValueError that named neither the file nor the field."""
    from iprox_lightning.io.gradient_store import StoreFormatError

    store = tmp_path / "store"
    main(["build_store", "--model", "builtin", "--builtin_size", "12", "--output_dir", str(store),
          "--progress", "false"])
    info = json.loads((store / "store.json").read_text())
    rows = info["layout"]
    a, b = next((i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))
                if (rows[i]["out"], rows[i]["in"], rows[i]["k_out"], rows[i]["k_in"])
                == (rows[j]["out"], rows[j]["in"], rows[j]["k_out"], rows[j]["k_in"]))
    rows[a]["key"], rows[b]["key"] = rows[b]["key"], rows[a]["key"]
    (store / "store.json").write_text(json.dumps(info, indent=2))
    with pytest.raises(StoreFormatError, match=rf"^{store}/store.json: field 'layout\[{a}\]' is {rows[a]['key']} .*"
                                               rf"the model's tracked weight there is {rows[b]['key']}"):
        main(["query", "--store", str(store), "--validation", "builtin", "--output_dir", str(tmp_path / "q"),
              "--progress", "false"])
    q = tmp_path / "q"  # no result written (the directory, made and marked first, holds only the marker)
    assert not q.exists() or all(p.name.startswith(".iprox") for p in q.iterdir())


@pytest.mark.distributed
def test_two_processes_with_one_example_is_one_clear_line(tmp_path):
    """``build_store --devices 2`` on a one-example pool: rank 1 died on Lightning's bare AssertionError (its
    sampler's), rank 0 on gloo's "connection closed by peer"; each rank now says why in one line."""
    pool = tmp_path / "one.jsonl"
    pool.write_text(json.dumps({"id": "a", "instruction": "say 1", "response": "ok 1"}) + "\n")
    r = _train("build_store", "--model", "builtin", "--pool", pool, "--output_dir", tmp_path / "store",
               "--devices", "2", cwd=tmp_path, timeout=400)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith(("INFO", "Seed set"))]
    assert r.returncode == 2 and "AssertionError" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines and all(line == lines[0] for line in lines) and len(lines) <= 2, lines  # the same line per rank
    assert lines[0].startswith("error: the pool to score has 1 example(s) but the run has 2 processes")
    assert "--devices 1" in lines[0]


# ------------------------------------------------------------------------------------------------ closed output
@pytest.mark.parametrize("args", [["--help"], ["plan"], ["cache"], ["select", "--k", "2"]])
def test_output_closed_early_exits_quietly(tmp_path, args):
    """``train.py --help | head`` and the same for ``plan``, ``cache`` and ``select``: a BrokenPipeError
    traceback; the Python docs' way for SIGPIPE now: nothing on stderr, exit status 1."""
    if args[0] == "select":
        _scored_workdir(tmp_path / "wd")
        args = [*args, "--scores_path", tmp_path / "wd" / "scores" / "target" / "scores.parquet",
                "--output", tmp_path / "sel.jsonl"]
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *map(str, args)], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the command writes a line
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ------------------------------------------------------------------------------------------------ full disk
def _tmpfs(path: Path, size: str) -> list[str] | None:
    """The command prefix that runs a command with a ``size`` tmpfs mounted at ``path`` (a private mount
    namespace), or ``None`` where this machine does not allow it."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {path}"],
                           capture_output=True)
    return None if probe.returncode else ["unshare", "-rm", "sh", "-c",
                                          f'mount -t tmpfs -o size={size} tmpfs {path} && exec "$@"', "sh"]


def test_export_on_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tmp_path):
    """``export_proxy`` onto a full disk: safetensors' own SafetensorError ("No space left on device (os error 28)")
    gave a traceback. It is the one disk-full line naming the output, and the disk holds no temporary."""
    import torch

    from iprox_lightning import compress_model, save_proxy
    from iprox_lightning.models.builtin import builtin_tokenizer
    from iprox_lightning.models.tiny import tiny_causal_lm

    disk = tmp_path / "disk"
    disk.mkdir()
    run = _tmpfs(disk, "16k")  # the config files fit, the 29 KB of weights do not
    if run is None:
        pytest.skip("no private tmpfs mount here (unshare -rm)")
    model = tiny_causal_lm("llama", seed=3, vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2,
                           num_kv_heads=1, dtype=torch.float32)
    compress_model(model, None, 0.5, method="svd", progress=False)
    proxy = save_proxy(model, builtin_tokenizer(), tmp_path / "proxy", target_model="tiny")
    out = disk / "export"
    r = subprocess.run([*run, "sh", "-c", f'{sys.executable} {ROOT / "train.py"} export_proxy --proxy {proxy} '
                                          f'--output {out}; echo "rc=$?" >&2; ls -A {disk} >&2'],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    err = [line for line in r.stderr.splitlines() if "it/s]" not in line and line.strip()]
    assert err[-1] == "rc=1", r.stderr  # `ls -A` printed nothing after it: no export, no temporary
    assert len(err) == 2 and err[0].startswith(f"error: the disk is full writing {out} (No space left on device)")


@pytest.mark.parametrize("args,message", [
    (["--strategy", "fsdp", "--devices", "2", "--accelerator", "gpu"],
     r"^strategy 'fsdp' with --devices 2: this machine has 1 CUDA device\(s\); pass --devices 1 or fewer"),
    (["--strategy", "fsdp"], r"^strategy 'fsdp' runs on CUDA devices only, and the accelerator is cpu \(the default\)"),
    (["--strategy", "deepspeed", "--accelerator", "gpu"], r"^strategy 'deepspeed' needs the deepspeed package")])
def test_a_gpu_strategy_the_machine_cannot_run_is_refused_before_any_stage(tmp_path, monkeypatch, args, message):
    """The same up-front check on a machine with one CUDA device (simulated here: the check reads only the device
    count): more --devices than devices, the cpu accelerator, DeepSpeed not installed."""
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    if importlib.util.find_spec("deepspeed") is not None and "deepspeed" in args:
        pytest.skip("deepspeed is installed here")
    wd = tmp_path / "wd"
    with pytest.raises(UserInputError, match=message):
        main(["pipeline", "--workdir", str(wd), *args])
    assert not wd.exists()
