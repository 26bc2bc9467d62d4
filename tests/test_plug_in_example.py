"""The 'add IProX to your own Lightning project' example runs and does what it says."""
import importlib.util
import json
from pathlib import Path

from iprox_lightning import LowRankLinear
from iprox_lightning.io.scores import read_scores

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plug_in_lightning.py"


def test_plug_in_example(tmp_path):
    spec = importlib.util.spec_from_file_location("plug_in_lightning", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(str(tmp_path))
    n_lowrank = sum(isinstance(m, LowRankLinear) for m in res["proxy"].modules())
    assert n_lowrank == 14  # every q/k/v/o/gate/up/down of the 2 blocks
    assert (tmp_path / "proxy" / "iprox_proxy.json").exists()
    scores = read_scores(res["scores"])
    pool_ids = {x["id"] for x in mod.make_examples(96, seed=0)}
    assert set(scores) == pool_ids  # every example scored exactly once
    rows = [json.loads(l) for l in open(res["selected"])]
    assert len(rows) == 24
    # the validation set is 'count' sequences only: the selection should be dominated by them
    share = sum(r["id"].startswith("count") for r in rows) / len(rows)
    assert share >= 0.75
