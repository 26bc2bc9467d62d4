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


MODULE_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from test_writer_scoring import TinyDM, build_model
from iprox_lightning.engine.fsdp import is_sharded
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.scoring.writer import InfluenceWriter

if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[InfluenceWriter({out!r}, write_every_n_batches=1)])
    module = InfluenceScoringModule(build_model(), method=sys.argv[1], kfac_examples=8, shard_layers=True)
    trainer.predict(module, datamodule=TinyDM(), return_predictions=False)
    w = module.net.model.layers[0].mlp.gate_proj.weight
    json.dump({{"sharded": is_sharded(module.net), "local_rows": w.to_local().shape[0], "rows": w.shape[0],
               "V": sorted(module.scorer.V), "factors": sorted(module.metric.eigens)}},
              open(os.path.join({held!r}, f"r{{trainer.global_rank}}.json"), "w"))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["ekfac"])
def test_fsdp2_scoring_module_with_layer_shards_equals_one_process(tmp_path, method):
    """``InfluenceScoringModule`` under ``ModelParallelStrategy`` (FSDP2, 2 CPU gloo ranks): the scored model sharded
    per decoder block (half of each weight per rank), ``shard_layers`` (each rank fits, holds and applies the factors
    and validation gradients of its share of the weights), the pool and factor batches split over the ranks (one rank
    with a batch fewer: idle steps): the written table equals one process's scores to 1e-6 (the sampler repeats an
    example in another batch on rank 1, whose padding changes the float64 rounding: 1e-7 measured, as under DDP)."""
    import os

    from iprox_lightning.scoring import ScoreTable
    from iprox_lightning.scoring.writer import SCORES_FILE

    sys.path.insert(0, str(Path(__file__).parent))
    from test_writer_scoring import assert_table_equal, reference

    out, held = tmp_path / "scores", tmp_path / "held"
    held.mkdir()
    script = tmp_path / "fsdp_module.py"
    script.write_text(textwrap.dedent(MODULE_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out),
                                                           held=str(held))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    r = subprocess.run([sys.executable, str(script), method], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert_table_equal(ScoreTable.load(str(out / SCORES_FILE)), reference(method), rtol=1e-6)
    ranks = [json.loads((held / f"r{k}.json").read_text()) for k in range(2)]
    assert all(t["sharded"] and t["local_rows"] == t["rows"] // 2 for t in ranks)
    for field in ("V", "factors"):
        a, b = (set(t[field]) for t in ranks)
        assert a and b and a.isdisjoint(b) and len(a | b) == 7  # 7 linears, each on one rank


CHECKPOINTS_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from test_writer_scoring import TinyDM
from iprox_lightning.engine.fsdp import is_sharded
from iprox_lightning.scoring import module as M
from iprox_lightning.scoring.writer import InfluenceWriter

if __name__ == "__main__":
    devices, in_turn, out = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    seen, prepare = [], M.InfluenceScoringModule._prepare

    def recorded(self, net, metric, source, vmodel):
        seen.append([os.path.basename(str(source)), is_sharded(net)])
        return prepare(self, net, metric, source, vmodel)

    M.InfluenceScoringModule._prepare = recorded
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False, strategy=strategy,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[InfluenceWriter(out, write_every_n_batches=1)])
    module = M.InfluenceScoringModule(checkpoints=[{{"path": p, "weight": w}} for p, w in {ckpts!r}],
                                      checkpoints_in_turn=in_turn)
    trainer.predict(module, datamodule=TinyDM(), return_predictions=False)
    json.dump(seen, open(os.path.join(out, f"seen{{trainer.global_rank}}.json"), "w"))
"""


@pytest.mark.distributed
def test_fsdp2_checkpoints_are_each_sharded_and_score_as_one_process_in_turn_or_together(tmp_path):
    """Multi-checkpoint scoring under ``ModelParallelStrategy`` (FSDP2, 2 CPU gloo ranks) of two dense checkpoints:
    every checkpoint's model is sharded per decoder block as the first is (before, a later checkpoint was loaded whole
    on every rank), batch by batch and ``checkpoints_in_turn`` (its pass over the pool replayed in step on both
    ranks): the two tables are the same numbers, and one process's batch-by-batch scores to 1e-5 (float32 checkpoints;
    the sampler's repeated example in another batch, as above)."""
    import os

    import numpy as np

    from iprox_lightning.models.tiny import tiny_causal_lm
    from iprox_lightning.scoring import ScoreTable
    from iprox_lightning.scoring.writer import SCORES_FILE

    sys.path.insert(0, str(Path(__file__).parent))
    from test_scoring_influence import TINY
    from test_writer_scoring import assert_table_equal

    ckpts = []
    for seed, weight in ((21, 1.0), (22, 0.5)):
        d = tmp_path / f"ckpt{seed}"
        tiny_causal_lm("llama", seed=seed, **TINY).save_pretrained(d)
        ckpts.append((str(d), weight))
    script = tmp_path / "fsdp_checkpoints.py"
    script.write_text(textwrap.dedent(CHECKPOINTS_SCRIPT.format(tests=str(Path(__file__).parent), ckpts=ckpts)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    tables, seen = {}, {}
    for devices, in_turn in ((1, "0"), (2, "0"), (2, "1")):
        out = tmp_path / f"scores_{devices}_{in_turn}"
        r = subprocess.run([sys.executable, str(script), str(devices), in_turn, str(out)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-4000:]
        tables[devices, in_turn] = ScoreTable.load(str(out / SCORES_FILE))
        seen[devices, in_turn] = [json.loads((out / f"seen{k}.json").read_text()) for k in range(devices)]
    assert seen[1, "0"] == [[["ckpt21", False], ["ckpt22", False]]]
    assert seen[2, "0"] == [[["ckpt21", True], ["ckpt22", True]]] * 2  # every checkpoint sharded on both ranks
    assert seen[2, "1"] == [[["ckpt22", True], ["ckpt21", True]]] * 2  # the later checkpoint's pass first
    together, in_turn = tables[2, "0"], tables[2, "1"]
    assert together.ids == in_turn.ids  # the same rows in the same batches: the same numbers
    np.testing.assert_array_equal(in_turn.task_scores, together.task_scores)
    assert_table_equal(together, tables[1, "0"], rtol=1e-5)
