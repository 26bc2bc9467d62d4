"""The hook-based features under FSDP2 (``fully_shard``, 2 CPU gloo processes): scores of a
sharded proxy equal those of the unsharded model, and no parameter gradient is written.

Lightning's ``FSDPStrategy`` needs CUDA; FSDP2's ``fully_shard`` runs on CPU, which is what this
test uses (in a subprocess, so pytest's process is not touched). Under FSDP every forward is a
collective: each rank here prepares the validation state on all batches (no batch sharding) and
scores the same number of batches.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_scoring_influence import batches, make_examples, make_proxy
from iprox_lightning.scoring import InfluenceScorer, ScoringConfig

OUT, METHOD = {out!r}, sys.argv[1]


def data():
    return (batches(make_examples(8, seed=1, tasks=["x"], zero_every=3), 4),
            batches(make_examples(6, seed=2, tasks=["a", "b"]), 3))


def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_proxy("llama", seed=3)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train, val = data()
    scorer = InfluenceScorer(model, ScoringConfig(method=METHOD, kfac_examples=8)).fit(val, train)
    res = scorer.score_batch(train[rank])
    no_grad = all(p.grad is None for p in model.parameters())
    json.dump({{"score": res["score"].tolist(), "task_scores": res["task_scores"].tolist(), "no_grad": no_grad}},
              open(os.path.join(OUT, f"r{{rank}}.json"), "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(run, args=(2,), nprocs=2)
    train, val = data()
    scorer = InfluenceScorer(make_proxy("llama", seed=3), ScoringConfig(method=METHOD, kfac_examples=8)).fit(val, train)
    ref = [scorer.score_batch(b) for b in train[:2]]
    json.dump([{{"score": r["score"].tolist(), "task_scores": r["task_scores"].tolist()}} for r in ref],
              open(os.path.join(OUT, "ref.json"), "w"))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("method,port", [("kfac", "29541")])
def test_fsdp2_sharded_proxy_scores_equal_unsharded(tmp_path, method, port):
    import numpy as np

    script = tmp_path / "fsdp_score.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path))))
    r = subprocess.run([sys.executable, str(script), method, port], cwd=tmp_path, capture_output=True, text=True,
                       timeout=240, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    ref = json.loads((tmp_path / "ref.json").read_text())
    for rank in range(2):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert got["no_grad"]
        np.testing.assert_allclose(got["score"], ref[rank]["score"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got["task_scores"], ref[rank]["task_scores"], rtol=1e-9, atol=1e-12)
        assert np.abs(ref[rank]["score"]).max() > 1e-3
