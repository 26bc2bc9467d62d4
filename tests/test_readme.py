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
