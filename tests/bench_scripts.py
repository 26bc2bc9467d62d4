"""A ``bench/`` script as a module, for the tests that check recorded measurements against today's plan with the
script's own plan functions (the scripts are not a package: each is a command)."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """``bench/<name>.py``, loaded once per test process (a script imports its siblings, e.g. ``plan_memory``'s
    shapes: ``bench/`` goes on the path)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        if str(BENCH) not in sys.path:
            sys.path.insert(0, str(BENCH))
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
