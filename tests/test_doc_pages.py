"""The pages a user reads first (README.md, ARCHITECTURE.md) stay short and name only what is there."""
import re
from pathlib import Path

import pytest
from test_import_graph import WING_FLOORS

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "ARCHITECTURE.md")
MAX_LINES = 160  # 150 until the README's GPU section carried the generated target table (issues 63, 64)
# where a page's relative paths are looked up: the repository root, the package (ARCHITECTURE.md's paths are under
# it), and the folders whose files the pages name by their own path (`configs/builtin/`, `bench/effect.py`)
BASES = (ROOT, ROOT / "iprox_lightning", ROOT / "configs", ROOT / "bench")
NOT_IN_REPOSITORY = ("outputs/", "../", "/", "W/", "-")  # run outputs, the shared data, absolute paths, options


def repository_paths(text: str) -> set[str]:
    """The repository paths a page names in inline code (fenced blocks are run by the tests of their commands): each
    word of a backticked span that is a file (``x.py``, ``x.yaml``, ``x.md``, ``dir/x.json``) or a folder (``dir/``).
    Words with a placeholder (``configs/<stage>.yaml``), run outputs (``outputs/...``, ``W/...``), ``../shared/...``
    and bare names of written files (``check.json``) are not repository paths."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in span.split():
            word = word.split("::")[0]  # a test id names its file
            if not re.fullmatch(r"[\w./\-]+", word) or word.startswith(NOT_IN_REPOSITORY):
                continue
            if word.endswith((".py", ".yaml", ".md")) or ("/" in word and word.endswith((".json", "/"))):
                found.add(word)
    return found


def test_repository_paths_reader():
    text = ("run `python train.py fit --config configs/warmup.yaml`, see `io/proxy.py`, `engine/` and "
            "`tests/test_x.py::test_y`, `bench/results/x/summary.json`; not `outputs/a/b.json`, `configs/<stage>.yaml`, "
            "`check.json`, `../shared/m.gguf`, `--out`, `x`\n```bash\npython gone.py\n```\n")
    assert repository_paths(text) == {"train.py", "configs/warmup.yaml", "io/proxy.py", "engine/", "tests/test_x.py",
                                      "bench/results/x/summary.json"}


@pytest.mark.parametrize("page", PAGES)
def test_page_is_short(page):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= MAX_LINES, f"{page} has {lines} lines (at most {MAX_LINES}): move detail to docs/GUIDE.md"


@pytest.mark.parametrize("page", PAGES)
def test_page_names_only_paths_that_exist(page):
    paths = repository_paths((ROOT / page).read_text())
    assert "docs/GUIDE.md" in paths or "engine/tracking.py" in paths  # the page was read
    missing = sorted(p for p in paths if not any((base / p).exists() for base in BASES))
    assert not missing, f"{page} names paths that do not exist: {missing}"


def test_architecture_maps_every_wing_on_the_import_graph_tests_floors():
    """Every sub-package has its entry in ARCHITECTURE.md, and its floors line is ``WING_FLOORS``, in order."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    folders = sorted(d.name for d in (ROOT / "iprox_lightning").iterdir() if (d / "__init__.py").exists())
    assert [d for d in folders if f"`{d}/`" not in text] == []
    section = text[text.index("## The floors"):text.index("\n## ", text.index("## The floors") + 1)]
    floors_line = " ".join(section.strip().split("\n\n")[-1].split())
    floors = [{re.sub(r"/$|\.py$", "", w).replace("__init__", "iprox_lightning")
               for w in re.findall(r"`([^`]+)`", floor)} for floor in floors_line.split(" < ")]
    assert floors == WING_FLOORS
