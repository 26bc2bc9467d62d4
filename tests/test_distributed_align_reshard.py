"""Stage 2 under FSDP2 with the proxy gathered one decoder block at a time (``reshard_proxy: true``, issue 63 item 2)
on 2 CPU gloo processes (torchrun), against the replicated single-process run.

Each rank aligns on its own batch of 2 rows (``test_distributed_train.micro_batch``). Without micro-batches the
objective is the mean of the ranks' losses (the DDP semantics, as the gathered-whole FSDP2 path): the reference is one
process on the mean of the two batches' losses. With ``micro_batch_size`` it is the global batch's
(``test_distributed_align_scale``): the reference is one process on the concatenated batches in micro-batches of one
row. Compared: the first step's loss and factor gradients, every step's loss on both ranks, the factors after three
AdamW steps, and that the proxy's decoder blocks are not gathered between the forward and the loss's backward.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from test_distributed_align_scale import RecordSteps, _single_process_global  # noqa: E402  (the global batch's reference)
from test_distributed_train import (  # noqa: E402  (the shared 2-rank harness and reference)
    LR_ALIGN, STEPS, _assert_close, _assert_only_factors_moved_and_saved, _results, micro_batch, svd_proxy,
    run_modes, teacher_model, torchrun_two_ranks, val_micro_batch,
)

MODES = {"reshard": {"reshard_proxy": True}, "reshard_micro": {"reshard_proxy": True, "micro_batch_size": 1}}
# bf16-mixed: the resharded proxy against the gathered-whole FSDP2 path (autocast's copies of the factors regathered)
MIXED = {"reshard_bf16_mixed": {"reshard_proxy": True}, "whole_bf16_mixed": {}}
MIXED_STEPS = 2


def _gathered_blocks(proxy) -> int:
    """How many of the proxy's decoder-block parameters are gathered (plain tensors, not FSDP2's shards) now."""
    from iprox_lightning.engine.blocks import decoder_blocks

    _, blocks = decoder_blocks(proxy)
    return sum(not hasattr(p, "full_tensor") for b in blocks for p in b.parameters())


def _run_mode(mode: str, out: str, options: dict, precision: str = "32-true", steps: int = STEPS) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    from iprox_lightning.modules import ProxyAlignModule
    from iprox_lightning.training.causal_lm import full_state_dict

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = DataLoader([micro_batch(s, rank) for s in range(steps)], batch_size=None)
    teacher = teacher_model()
    module = ProxyAlignModule(target=teacher, proxy=svd_proxy(teacher), kl_weight=0.1, lr=LR_ALIGN,
                              log_layer_cosines=False, save_dir=f"{out}/{mode}-proxy", keep_best=False, **options)
    record = {"loss": [], "gathered_before_backward": [], "handles": {}}
    from iprox_lightning.alignment import fsdp

    pack = fsdp.ProxyBlocks._pack

    def counting_pack(self, t):  # the saved tensors packed as handles, by the dtype they are regathered in
        out = pack(self, t)
        if isinstance(out, tuple):
            key = str(out[2] or t.dtype)
            record["handles"][key] = record["handles"].get(key, 0) + 1
        return out

    fsdp.ProxyBlocks._pack = counting_pack

    class Record(RecordSteps):
        def on_before_backward(self, trainer, pl_module, loss):
            record["gathered_before_backward"].append(_gathered_blocks(pl_module.proxy))

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                record["val_loss"] = float(trainer.callback_metrics["val/loss"])

    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_checkpointing=False,
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[Record(record)], precision=precision, num_sanity_val_steps=0)
    try:
        # (the plain mode also runs a held-out check after its last step: alignment_step without create_graph)
        trainer.fit(module, data, DataLoader([val_micro_batch(0, rank)], batch_size=None) if mode == "reshard" else None)
    finally:
        fsdp.ProxyBlocks._pack = pack
    save_file({k: v.contiguous() for k, v in record["grads"].items()}, f"{out}/{mode}-grads-rank{rank}.safetensors")
    record["block_parameters"] = _gathered_blocks(module.proxy) * 0 + sum(
        1 for b in __import__("iprox_lightning.engine.blocks", fromlist=["x"]).decoder_blocks(module.proxy)[1]
        for _ in b.parameters())
    Path(f"{out}/{mode}-record-rank{rank}.json").write_text(json.dumps(record, default=str))
    full = full_state_dict(module.proxy)  # collective
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/{mode}-rank0.safetensors")


def _worker(out: str) -> None:
    run_modes(out, [(mode, functools.partial(_run_mode, mode, out, options)) for mode, options in MODES.items()]
              + [(mode, functools.partial(_run_mode, mode, out, options, "bf16-mixed", steps=MIXED_STEPS))
                 for mode, options in MIXED.items()])


@pytest.fixture(scope="module")
def reshard_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist_reshard")
    torchrun_two_ranks(HERE, out, timeout=300)
    return out


@functools.lru_cache(maxsize=1)
def _single_process_mean() -> tuple[list[dict], dict, list[list[float]]]:
    """One process, AdamW on the mean of the two ranks' batches' alignment losses: the proxy's state at steps
    0..STEPS, the first step's gradients and each rank's batch's loss at every step."""
    from iprox_lightning.alignment.losses import alignment_losses, proxy_factor_layers

    teacher = teacher_model().requires_grad_(False)
    proxy = svd_proxy(teacher).requires_grad_(False)
    names = {id(p): n for n, p in proxy.named_parameters()}
    params = [p for m in proxy_factor_layers(proxy).values() for p in (m.A, m.B)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=LR_ALIGN, weight_decay=0.01)
    states, grads, losses = [], {}, [[], []]
    for s in range(STEPS + 1):
        states.append({k: v.detach().clone() for k, v in proxy.state_dict().items()})
        if s == STEPS:
            break
        per_rank = [alignment_losses(teacher, proxy, micro_batch(s, r), kl_weight=0.1).loss for r in range(2)]
        opt.zero_grad()
        ((per_rank[0] + per_rank[1]) / 2).backward()
        if s == 0:
            grads = {names[id(p)]: p.grad.detach().clone() for p in params}
        for r in range(2):
            losses[r].append(float(per_rank[r]))
        opt.step()
    return states, grads, losses


@pytest.mark.distributed
@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp2_proxy_resharded_per_block_equals_the_replicated_run(reshard_out, mode):
    """``reshard_proxy``: the proxy's blocks are freed between the forward and the loss's backward (none gathered),
    yet the first step's loss and factor gradients equal the single process's to 1e-5 (float summation order: the
    reduce-scatters), and so does every step's loss on both ranks; after 3 AdamW steps the factors equal the
    single-process run's (rtol 1e-4, atol 1e-5: the normalised update amplifies the gradients' float differences, as
    in test_distributed_align_scale); only the factors moved and the saved proxy holds them."""
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    (r0,) = _results(reshard_out, mode, ranks=(0,))
    if "micro_batch_size" in MODES[mode]:
        states, grads, losses = _single_process_global()
        losses = [losses, losses]  # (the global batch's loss, on every rank)
    else:
        states, grads, losses = _single_process_mean()
    for r in (0, 1):
        got = load_file(reshard_out / f"{mode}-grads-rank{r}.safetensors")
        assert set(got) == set(grads)
        _assert_close(got, grads, rtol=1e-5, atol=1e-7)
        record = json.loads((reshard_out / f"{mode}-record-rank{r}.json").read_text())
        torch.testing.assert_close(record["loss"], losses[r], rtol=1e-5, atol=0)
        assert record["block_parameters"] > 0
        assert record["gathered_before_backward"] == [0] * STEPS  # no block held gathered for the loss's backward
        assert record["handles"].get("torch.float32", 0) > 0
    init, ref = states[0], states[-1]
    assert set(r0) == set(ref)
    _assert_close(r0, ref, atol=1e-5)
    _assert_only_factors_moved_and_saved(r0, init, reshard_out / f"{mode}-proxy")
    if mode == "reshard":  # the held-out loss after the last step: the mean of the ranks' batches' (sync_dist)
        from iprox_lightning.alignment.losses import alignment_losses
        from iprox_lightning.compression.apply import load_proxy

        proxy, _ = load_proxy(reshard_out / f"{mode}-proxy")
        teacher = teacher_model()
        want = sum(float(alignment_losses(teacher, proxy, val_micro_batch(0, r), kl_weight=0.1, create_graph=False).loss)
                   for r in (0, 1)) / 2
        assert record["val_loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.distributed
def test_fsdp2_proxy_resharded_per_block_under_bf16_mixed_equals_the_gathered_proxy(reshard_out):
    """bf16-mixed: autocast's bfloat16 copies of the gathered factors are saved tensors too (registered and
    regathered, not cached); the resharded proxy's losses, first gradients and factors after 2 steps equal the
    gathered-whole FSDP2 run's (the same operations: to 1e-6)."""
    from safetensors.torch import load_file

    got, ref = _results(reshard_out, "reshard_bf16_mixed", ranks=(0,))[0], _results(reshard_out, "whole_bf16_mixed",
                                                                                      ranks=(0,))[0]
    _assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for r in (0, 1):
        _assert_close(load_file(reshard_out / f"reshard_bf16_mixed-grads-rank{r}.safetensors"),
                      load_file(reshard_out / f"whole_bf16_mixed-grads-rank{r}.safetensors"), rtol=1e-6, atol=1e-8)
        a, b = (json.loads((reshard_out / f"{m}-record-rank{r}.json").read_text())
                for m in ("reshard_bf16_mixed", "whole_bf16_mixed"))
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-6, atol=0)
        assert a["gathered_before_backward"] == [0] * MIXED_STEPS and b["gathered_before_backward"] != [0] * MIXED_STEPS
        # autocast's bfloat16 copies of the factors are handles too (not held by the graph), and the whole path packs none
        assert a["handles"].get("torch.bfloat16", 0) > 0 and not b["handles"]


def test_reshard_proxy_refuses_activation_checkpointing_and_task_terms():
    from iprox_lightning.alignment.module import AlignConfig
    from iprox_lightning.errors import UserInputError

    with pytest.raises(UserInputError, match="reshard_proxy.*activation_checkpointing"):
        AlignConfig(reshard_proxy=True, activation_checkpointing=True)
    with pytest.raises(UserInputError, match="reshard_proxy.*task terms"):
        AlignConfig(reshard_proxy=True, val_grad_weight=1.0, keep_best=False)
    with pytest.raises(UserInputError, match="reshard_proxy must be true or false"):
        AlignConfig(reshard_proxy="yes")
    assert AlignConfig().reshard_proxy is False


def test_recorded_per_rank_peak_falls_with_the_proxy_resharded():
    """``bench/plan_stage2.py --devices 2`` (the JSON under bench/results/plan/, its command inside): with
    ``reshard_proxy`` each rank's measured peak is lower than with the proxy gathered whole (with and without
    micro-batches, 32-true and bf16-mixed), and so is the plan's proxy part; ``tests/test_plan_stage2_measured.py`` checks every variant
    within ±20% of the plan."""
    from bench_scripts import load_bench

    bench = load_bench("plan_stage2")
    root = HERE.parents[1] / "bench" / "results" / "plan"
    for name in ("stage2_small-4l-2ranks.json", "stage2_small-2l-2ranks-reshard.json",
                 "stage2_small-4l-2ranks-bf16-mixed.json", "stage2_smollm2-135m-2l-2ranks-reshard.json"):
        runs = json.loads((root / name).read_text())["variants"]
        pairs = [("default", "reshard_proxy"), ("micro_batch_1", "reshard_proxy+micro_batch_1")]
        for whole, per_block in [p for p in pairs if p[1] in runs]:
            a, b = runs[whole], runs[per_block]
            assert b["settings"].get("reshard_proxy") and not a["settings"].get("reshard_proxy")
            for ra, rb in zip(a["ranks"], b["ranks"]):
                assert rb["peak_bytes"] < ra["peak_bytes"], (name, per_block)
            assert bench.plan(b)["parts"]["proxy"] < bench.plan(a)["parts"]["proxy"]


def test_plan_counts_the_proxy_per_block_with_align_reshard_proxy(tmp_path):
    """``train.py plan --align_reshard_proxy true`` (FSDP, 8 devices): Stage 2's proxy is its shard plus the larger of
    two blocks and the embedding / LM head matrix, not the whole proxy gathered beside its shard; nothing else
    changes. Without FSDP the option changes nothing."""
    from iprox_lightning.analysis import ModelSizes, load_config
    from iprox_lightning.analysis.memory import proxy_sizes
    from iprox_lightning.cli import main

    def stage2(*extra):
        out = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.json"
        main(["plan", "--model", "smollm2-135m", "--accelerator", "cpu", "--max_length", "64", "--output", str(out),
              *extra])
        rows = {r["stage"]: r for r in json.loads(out.read_text())["stages"]}
        return rows["build_proxy: Stage 2 (alignment)"]["parts"]

    fsdp = ["--devices", "8", "--strategy", "fsdp"]
    whole, per_block = stage2(*fsdp), stage2(*fsdp, "--align_reshard_proxy", "true")
    sizes = ModelSizes.from_config(load_config("smollm2-135m"))
    _, proxy_params = proxy_sizes(sizes, 0.5)
    L, V, H = sizes.shape.num_layers, sizes.shape.vocab_size, sizes.shape.hidden_size
    outside = sizes.params - L * sizes.largest_block
    assert whole["proxy"] == pytest.approx(proxy_params * 4 * (1 / 8 + 1))
    assert per_block["proxy"] == pytest.approx(proxy_params * 4 / 8 + max(2 * (proxy_params - outside) / L, V * H) * 4)
    assert {k: v for k, v in per_block.items() if k != "proxy"} == {k: v for k, v in whole.items() if k != "proxy"}
    assert stage2() == stage2("--align_reshard_proxy", "true")


if __name__ == "__main__":
    _worker(sys.argv[1])
