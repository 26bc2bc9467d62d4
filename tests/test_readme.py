"""The README's Python API snippet runs as written (on the built-in model and data)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippet_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    block = re.search(r"```python\n(import iprox_lightning as ipx.*?)```", text, re.S).group(1)
    block = block.replace('"/tmp/proxy"', repr(str(tmp_path / "proxy")))
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    assert ns["report"].layers and (tmp_path / "proxy" / "iprox_proxy.json").exists()
    assert set(ns["proxy_scores"]) == set(ns["target_scores"]) and len(ns["target_scores"]) == 2000
    out = capsys.readouterr().out
    assert "spearman" in out


def test_readme_quick_start_matches_ci():
    text = README.read_text()
    cmds = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, re.S).group(1)
    lines = [l for l in cmds.splitlines() if l and not l.startswith("#")]
    assert len(lines) == 2
    ci = (README.parent / ".ci" / "run").read_text()
    assert lines[1] in ci  # .ci/run runs exactly the README's test command


def readme_stage_commands() -> list[str]:
    """The commands of the README's stage table, in order, exactly as written there."""
    text = README.read_text()
    section = text[text.index("## The pipeline, one config per stage"):]
    section = section[: section.index("\n\n", section.index("| stage | command |"))]
    return re.findall(r"^\|[^|]*\| `(python train\.py [^`]*)` \|", section, re.M)


def test_readme_stage_commands_run_as_written(tmp_path, monkeypatch, capsys, eval_dir):
    """Every stage command of the README, verbatim, in order, from a directory laid out like a clone
    (``configs/`` here, the eval suites in ``../shared/data/eval``): each stage finds the previous one's output."""
    import json
    import shlex

    import pytest

    from iprox_lightning.cli import main

    cmds = readme_stage_commands()
    assert len(cmds) == 11 and cmds[-1] == "python train.py pipeline --workdir outputs/pipeline"
    repo = tmp_path / "clone"
    repo.mkdir()
    (repo / "configs").symlink_to(README.parent / "configs")
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "eval").symlink_to(eval_dir)
    monkeypatch.chdir(repo)
    for cmd in cmds[:-1]:
        args = shlex.split(cmd)
        assert args[:2] == ["python", "train.py"]
        main(args[2:])
    out = capsys.readouterr().out
    o = repo / "outputs"
    for path in ("warmup/model/config.json", "proxy/model/iprox_proxy.json", "scores/target/scores.parquet",
                 "scores/proxy/scores.parquet", "scores/random/scores.parquet", "selected/proxy.jsonl",
                 "finetune/proxy/model/config.json", "eval/proxy/test_metrics.json", "report/report.md"):
        assert (o / path).exists(), path
    sel = [json.loads(line) for line in open(o / "selected" / "proxy.jsonl")]
    assert len(sel) == 100 and all(r["instruction"] and r["response"] for r in sel)  # full records
    assert "select: wrote 100 of 1991 ranked examples" in out and "pool share" in out  # 9 duplicate texts dropped
    metrics = json.loads((o / "eval" / "proxy" / "test_metrics.json").read_text())
    assert {"mmlu/acc", "bbh/em"} <= set(metrics["metrics"]) and "tydiqa" in metrics["skipped"]
    assert "[evaluate] tydiqa skipped" in out
    md = (o / "report" / "report.md").read_text()
    assert "| proxy |" in md and "| random |" in md and "| target |" in md and "## Selection `proxy` explained" in md
    # the last row (the whole pipeline) is run by tests/test_pipeline.py; here its command line must parse
    with pytest.raises(SystemExit) as e:
        main(shlex.split(cmds[-1])[2:] + ["--print_config"])
    assert e.value.code in (0, None)


def architecture_paths(text: str) -> set[str]:
    """The file paths ARCHITECTURE.md names in backticks (``x.py``, ``dir/x.py``, ``x.yaml``, ``x.md``)."""
    return {p for p in re.findall(r"`([\w/.\-]+\.(?:py|yaml|md))`", text)}


def test_architecture_names_only_files_that_exist():
    """ARCHITECTURE.md matches the code: every file it names is there (in the package, the repository root,
    ``configs/`` or ``bench/``), and every sub-package of the package has its row."""
    root = README.parent
    text = (root / "ARCHITECTURE.md").read_text()
    paths = architecture_paths(text)
    assert {"tracking.py", "io/proxy.py", "target_layers.py", "io/records.py", "data/sources.py"} <= paths
    bases = (root / "iprox_lightning", root, root / "configs", root / "bench")
    missing = sorted(p for p in paths if not any((b / p).exists() for b in bases))
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"
    folders = sorted(d.name for d in (root / "iprox_lightning").iterdir() if (d / "__init__.py").exists())
    assert [d for d in folders if f"`{d}/" not in text] == []


def test_architecture_paths_reader():
    assert architecture_paths("see `io/proxy.py` and `configs/warmup.yaml`, not `x`") == {"io/proxy.py",
                                                                                          "configs/warmup.yaml"}


def test_readme_build_once_query_many_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's "Build once, query many" commands, verbatim: build, query, select."""
    import re
    import shlex

    from iprox_lightning.cli import main

    text = README.read_text()
    block = re.search(r"## Build once, query many\n.*?```bash\n(.*?)```", text, re.S).group(1)
    cmds = [c for c in block.splitlines() if c.startswith("python train.py")]
    assert [shlex.split(c)[2] for c in cmds] == ["build_store", "query", "select"]
    monkeypatch.chdir(tmp_path)
    for c in cmds:
        main(shlex.split(c)[2:])
    out = capsys.readouterr().out
    assert "build_store: 200 pool examples" in out and "query: 200 stored pool examples" in out
    assert (tmp_path / "outputs" / "selected" / "query.jsonl").exists()
    assert (tmp_path / "outputs" / "scores" / "query" / "neighbours.jsonl").exists()
