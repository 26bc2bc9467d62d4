"""Stage 2 at scale under FSDP2 on 2 CPU gloo processes (torchrun): the teacher sharded per decoder block beside the
proxy, with activation checkpointing and micro-batches, against the replicated single-process run.

With micro-batches under FSDP2 the objective is the global batch's (every rank's rows; the accumulation buffers are
sharded over the ranks, ``alignment/fsdp.FactorShards``): each rank aligns on its own batch of 2 rows
(``test_distributed_train.micro_batch``), so the reference is one process on the two ranks' batches concatenated, in
micro-batches of one row (``_single_process_global``): the loss and the factors' gradients of the first step, the loss
of every step and the factors after three AdamW steps.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from test_distributed_train import (  # noqa: E402  (the shared 2-rank harness and reference)
    LR_ALIGN, STEPS, _assert_close, _assert_only_factors_moved_and_saved, _results, concat, micro_batch, svd_proxy,
    run_modes, teacher_model, torchrun_two_ranks,
)
from iprox_lightning.alignment.losses import proxy_factor_layers  # noqa: E402

# (the default settings' FSDP2 runs, with the teacher sharded too: test_distributed_train's align_fsdp2* modes)
MODES = {"fsdp2_checkpointing_micro": {"activation_checkpointing": True, "micro_batch_size": 1},
         # one micro-batch a rank (the rank's whole batch): the global batch's objective all the same
         "fsdp2_micro_whole": {"micro_batch_size": 2}}


class RecordSteps(L.Callback):
    """Into ``record``: the first step's factor gradients, gathered (a collective), and every step's loss."""

    def __init__(self, record: dict) -> None:
        self.record = record

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            names = [f"{n}.{f}" for n in proxy_factor_layers(pl_module.proxy) for f in "AB"]
            params = optimizer.param_groups[0]["params"]  # the sharded factors, in model order
            assert len(names) == len(params)
            self.record["grads"] = {n: p.grad.full_tensor() for n, p in zip(names, params)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["loss"].append(float(outputs["loss"]))


def _run_mode(mode: str, out: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    from iprox_lightning.modules import ProxyAlignModule
    from iprox_lightning.training.causal_lm import full_state_dict, is_sharded

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = DataLoader([micro_batch(s, rank) for s in range(STEPS)], batch_size=None)
    teacher = teacher_model()
    module = ProxyAlignModule(target=teacher, proxy=svd_proxy(teacher), kl_weight=0.1, lr=LR_ALIGN,
                              log_layer_cosines=False, save_dir=f"{out}/{mode}-proxy", keep_best=False,
                              **MODES[mode])
    record = {"loss": []}

    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[RecordSteps(record)])
    trainer.fit(module, data)
    save_file({k: v.contiguous() for k, v in record["grads"].items()}, f"{out}/{mode}-grads-rank{rank}.safetensors")
    Path(f"{out}/{mode}-loss-rank{rank}.json").write_text(json.dumps(record["loss"]))
    # the teacher is sharded: each rank holds half of every decoder block's weights
    from torch.distributed.tensor import DTensor

    w = module.teacher.model.layers[0].mlp.gate_proj.weight
    local = w.to_local().shape[0] if isinstance(w, DTensor) else None
    Path(f"{out}/{mode}-teacher-rank{rank}.json").write_text(json.dumps(
        {"sharded": is_sharded(module.teacher), "rows": list(w.shape)[0], "local_rows": local}))
    full = full_state_dict(module.proxy)  # collective
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/{mode}-rank0.safetensors")


def _worker(out: str) -> None:
    run_modes(out, [(mode, functools.partial(_run_mode, mode, out)) for mode in MODES])


@pytest.fixture(scope="module")
def scale_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist_scale")
    torchrun_two_ranks(HERE, out, timeout=300)
    return out


@functools.lru_cache(maxsize=1)
def _single_process_global() -> tuple[list[dict], dict, list[float]]:
    """One process, AdamW (the module's defaults, lr ``LR_ALIGN``) on the two ranks' batches concatenated, in
    micro-batches of one row: the proxy's state at steps 0..STEPS, the first step's gradients and every step's loss.
    The reference of every mode (checkpointing gives the same numbers bit for bit: tests/test_alignment_scale.py)."""
    from iprox_lightning.alignment.losses import accumulated_alignment_losses, proxy_factor_layers

    teacher = teacher_model().requires_grad_(False)
    proxy = svd_proxy(teacher).requires_grad_(False)
    names = {id(p): n for n, p in proxy.named_parameters()}
    params = [p for m in proxy_factor_layers(proxy).values() for p in (m.A, m.B)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=LR_ALIGN, weight_decay=0.01)
    states, grads, losses = [], {}, []
    for s in range(STEPS + 1):
        states.append({k: v.detach().clone() for k, v in proxy.state_dict().items()})
        if s == STEPS:
            break
        out = accumulated_alignment_losses(teacher, proxy, concat(micro_batch(s, 0), micro_batch(s, 1)), 1,
                                           kl_weight=0.1)
        opt.zero_grad()
        out.loss.backward()
        if s == 0:
            grads = {names[id(p)]: p.grad.detach().clone() for p in params}
        losses.append(float(out.loss))
        opt.step()
    return states, grads, losses


@pytest.mark.distributed
@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp2_sharded_teacher_and_proxy_equal_the_replicated_run(scale_out, mode):
    """FSDP2, the teacher sharded per decoder block (half of each weight per rank) beside the proxy, the accumulation
    buffers sharded: the first step's loss and factor gradients equal the single process's on the global batch to
    1e-5 (float summation order: the reduce-scatters, the all-reduced cosine sums), and so does every step's loss on
    both ranks; after 3 AdamW steps the factors equal the single-process run's (rtol 1e-4 as the other FSDP2
    alignment tests, atol 1e-5: the normalised update amplifies the gradients' float differences), also with both forwards
    checkpointed; the saved proxy (rebuilt from the teacher's skeleton) holds them."""
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    (r0,) = _results(scale_out, mode, ranks=(0,))
    states, grads, losses = _single_process_global()
    for r in (0, 1):
        got = load_file(scale_out / f"{mode}-grads-rank{r}.safetensors")
        assert set(got) == set(grads)
        _assert_close(got, grads, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(json.loads((scale_out / f"{mode}-loss-rank{r}.json").read_text()), losses,
                                   rtol=1e-5, atol=0)
    init, ref = states[0], states[-1]
    assert set(r0) == set(ref)
    # (atol 1e-5: half a percent of one AdamW step of lr 2e-3, where a gradient entry near 0 meets a float difference)
    _assert_close(r0, ref, atol=1e-5)
    _assert_only_factors_moved_and_saved(r0, init, scale_out / f"{mode}-proxy")
    for r in (0, 1):
        t = json.loads((scale_out / f"{mode}-teacher-rank{r}.json").read_text())
        assert t["sharded"] and t["local_rows"] == t["rows"] // 2


if __name__ == "__main__":
    _worker(sys.argv[1])
