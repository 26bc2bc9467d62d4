import os
import pathlib

import pytest
import torch

# Tiny models are dominated by threading overhead: one intra-op thread is several times faster
# (and keeps parallel DDP test processes from oversubscribing the 2 CI cores).
torch.set_num_threads(int(os.environ.get("IPROX_TEST_THREADS", "1")))



@pytest.fixture
def one_thread():
    """One intra-op thread for the test, whatever IPROX_TEST_THREADS says: tiny matmuls oversubscribe the 2 shared
    cores badly (modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"
if not SHARED.exists():  # clone next to ../shared (CI layout) or inside /work
    SHARED = pathlib.Path(os.environ.get("IPROX_SHARED", "/work/shared"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow real-model tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("IPROX_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow real-model test: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir():
    return SHARED


@pytest.fixture(scope="session")
def eval_dir():
    d = SHARED / "data" / "eval"
    if not d.exists():
        pytest.skip("../shared/data/eval not present")
    return d


@pytest.fixture(scope="session")
def smollm_gguf():
    p = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.exists():
        if os.environ.get("IPROX_REQUIRE_SLOW") == "1":  # CI: a missing model must fail, not skip every slow test
            pytest.fail(f"IPROX_REQUIRE_SLOW=1 but the SmolLM2 GGUF is not at {p} (set IPROX_SHARED to the shared folder)")
        pytest.skip("SmolLM2 GGUF not present")
    return p


# ------------------------------------------------------------------------------------------------ a clean checkout
CHECKOUT = pathlib.Path(__file__).resolve().parents[1]
WRITTEN_PATHS = ("outputs", "config.yaml", "lightning_logs")
"""Where a test that forgets ``tmp_path`` writes into the checkout: the stage configs' ``outputs/...`` (relative to the
working directory), LightningCLI's saved ``config.yaml`` (the working directory when a run has no logger) and
Lightning's default ``lightning_logs/``. All git-ignored, so only this check sees them."""
CLEAN_ENV = "IPROX_REQUIRE_CLEAN"
"""``1`` (CI, ``.ci/run``): files a test wrote there fail the run; otherwise they are listed in the summary (another
process, e.g. a pipeline run from the same checkout, may be writing to ``outputs/`` meanwhile)."""


def _checkout_files() -> dict[str, int]:
    found = {}
    for name in WRITTEN_PATHS:
        p = CHECKOUT / name
        files = [p] if p.is_file() else (f for f in p.rglob("*") if f.is_file()) if p.is_dir() else ()
        for f in files:
            try:
                found[str(f.relative_to(CHECKOUT))] = f.stat().st_mtime_ns
            except OSError:
                pass
    return found


def pytest_sessionstart(session):
    session.config._iprox_checkout_files = _checkout_files()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_iprox_checkout_files", None)
    if before is None or getattr(session.config, "workerinput", None) is not None:
        return
    written = sorted(p for p, m in _checkout_files().items() if before.get(p) != m)
    session.config._iprox_written = written
    if written and os.environ.get(CLEAN_ENV) == "1" and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    written = getattr(config, "_iprox_written", None)
    if written:
        shown = ", ".join(written[:10]) + (f" and {len(written) - 10} more" if len(written) > 10 else "")
        terminalreporter.write_sep("=", "files written into the checkout (use tmp_path)", red=True)
        terminalreporter.write_line(f"{len(written)} file(s) under {', '.join(WRITTEN_PATHS)}: {shown}"
                                    + (f" — failing ({CLEAN_ENV}=1)" if os.environ.get(CLEAN_ENV) == "1" else ""))
