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
