"""Training stages under 2-process CPU gloo (torchrun): DDP and FSDP2 alignment (FSDP2 also with held-out
checks and ``keep_best``), DDP and FSDP2 warm-up.

The test functions launch this very file with ``python -m torch.distributed.run --nproc_per_node=2``;
each rank writes its final parameters to ``<out>/<mode>-rank<r>.safetensors`` and the test compares the
ranks with each other and with a single-process reference computed here:

* alignment (DDP): each rank aligns on its own micro-batch and the single backward averages the
  gradients, so the step equals single-process AdamW on ``(L(b_0) + L(b_1)) / 2`` (per-micro-batch
  losses averaged — NOT ``L`` of the concatenated batch, since the cosines do not decompose);
* warm-up (DDP and FSDP2): the loss is normalised by the global response-token count, so the step
  equals single-process training on the concatenated batch; so it does with the memory levers (issue 64):
  micro-batches of one example, activation checkpointing and, under FSDP2, the CPU offload of the sharded state.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
STEPS = 3
LR_ALIGN = 2e-3
LR_ALIGN_VAL = 4e-3  # align_fsdp2_val: the held-out loss falls after step 1, then rises (best step 1 of 0..3)
LR_WARM = 1e-3


def make_batch(seed: int, B: int = 2, T: int = 10, V: int = 128, n_resp: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, : T - (n_resp or T // 2)] = -100
    return dict(input_ids=ids, attention_mask=torch.ones(B, T, dtype=torch.long), labels=labels,
                id=[f"{seed}-{i}" for i in range(B)])


def micro_batch(step: int, rank: int) -> dict:
    # unequal response-token counts across ranks, so token normalisation matters
    return make_batch(100 * step + rank, n_resp=3 + 3 * rank)


def concat(a: dict, b: dict) -> dict:
    return {k: (torch.cat([a[k], b[k]]) if isinstance(a[k], torch.Tensor) else a[k] + b[k]) for k in a}


def teacher_model():
    from iprox_lightning.models.tiny import tiny_causal_lm

    return tiny_causal_lm("llama", seed=5)


def svd_proxy(teacher):
    from iprox_lightning.compression.apply import compress_model

    proxy = copy.deepcopy(teacher)
    compress_model(proxy, None, 0.5, method="svd", progress=False)
    return proxy


# ------------------------------------------------------------------------------------------------ worker
MODES = ("align_ddp", "align_fsdp2", "align_fsdp2_val", "warmup_ddp", "warmup_fsdp2", "warmup_ddp_levers",
         "warmup_fsdp2_levers")
LEVERS = dict(micro_batch_size=1, gradient_checkpointing=True)
VAL_BATCHES = 2


def val_micro_batch(i: int, rank: int) -> dict:
    return make_batch(5000 + 10 * i + rank, n_resp=4 + rank)


def _run_mode(mode: str, out: str) -> None:
    import lightning as L
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    from iprox_lightning.training.causal_lm import full_state_dict

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = DataLoader([micro_batch(s, rank) for s in range(STEPS)], batch_size=None)
    if mode.startswith("align"):
        from iprox_lightning.modules import ProxyAlignModule

        teacher = teacher_model()
        module = ProxyAlignModule(target=teacher, proxy=svd_proxy(teacher), kl_weight=0.1,
                                  lr=LR_ALIGN_VAL if mode == "align_fsdp2_val" else LR_ALIGN,
                                  log_layer_cosines=False, save_dir=f"{out}/{mode}-proxy",
                                  keep_best=mode == "align_fsdp2_val")
        if mode == "align_ddp":
            strategy = "ddp"
        else:
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        from iprox_lightning.modules import WarmupModule

        levers = {} if not mode.endswith("_levers") else {**LEVERS, "fsdp_cpu_offload": "fsdp2" in mode}
        module = WarmupModule(model=teacher_model(), lr=LR_WARM, warmup_ratio=0.0, lr_schedule="constant",
                              save_dir=f"{out}/{mode}-hf", **levers)
        if mode.startswith("warmup_ddp"):
            strategy = "ddp"
        else:
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    validation = {}
    if mode == "align_fsdp2_val":  # a held-out check after every step, and the un-aligned factors at step 0
        validation = dict(val_check_interval=1, num_sanity_val_steps=0)
        val = DataLoader([val_micro_batch(i, rank) for i in range(VAL_BATCHES)], batch_size=None)
    losses: list[float] = []

    class LocalLoss(L.Callback):  # each step's logged loss of this rank's batch
        def on_train_batch_end(self, trainer, *args):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[LocalLoss()] if mode.startswith("warmup") else [],
                        **validation)
    trainer.fit(module, data, val if validation else None)
    if losses:
        Path(f"{out}/{mode}-losses-rank{rank}.json").write_text(json.dumps(losses))
    if validation:
        Path(f"{out}/{mode}-history-rank{rank}.json").write_text(json.dumps(module.validation_history))
    net = module.proxy if mode.startswith("align") else module.model
    sharded = full_state_dict(net)  # collective under FSDP2; the full tensors land on rank 0 only
    if sharded is not None:
        if rank == 0:
            save_file({k: v.contiguous() for k, v in sharded.items()}, f"{out}/{mode}-rank0.safetensors")
        return
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()},
              f"{out}/{mode}-rank{rank}.safetensors")


def run_modes(out: str, runs) -> None:
    """On one rank, run each ``(mode, callable)`` of ``runs`` in turn; a failure is written to
    ``out/<mode>-rank<r>.error`` (what the tests report) before it is raised."""
    torch.set_num_threads(1)
    for mode, run in runs:
        try:
            run()
        except Exception as e:
            Path(f"{out}/{mode}-rank{os.environ['RANK']}.error").write_text(f"{type(e).__name__}: {e}")
            raise


def _worker(out: str) -> None:
    run_modes(out, [(mode, functools.partial(_run_mode, mode, out)) for mode in MODES])


# ------------------------------------------------------------------------------------------------ tests
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_two_ranks(script: Path, out: Path, timeout: int) -> subprocess.CompletedProcess:
    """``script out`` on 2 CPU gloo ranks through torchrun (one thread each); its output kept in ``out/log.txt``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(script), str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "log.txt").write_text(res.stdout + "\n" + res.stderr)
    return res


@pytest.fixture(scope="module")
def dist_out(tmp_path_factory) -> Path:
    """One torchrun launch (2 CPU gloo ranks) running every mode in turn: start-up is paid once."""
    out = tmp_path_factory.mktemp("dist")
    torchrun_two_ranks(HERE, out, timeout=300)
    return out


def _results(out: Path, mode: str, ranks=(0, 1)) -> list[dict]:
    from safetensors.torch import load_file

    errors = sorted(out.glob(f"{mode}-rank*.error"))
    if errors:
        raise AssertionError(f"{mode} failed: " + " | ".join(e.read_text()[:2000] for e in errors))
    files = [out / f"{mode}-rank{r}.safetensors" for r in ranks]
    if not all(f.is_file() for f in files):
        raise AssertionError(f"{mode} wrote no result; log tail:\n{(out / 'log.txt').read_text()[-5000:]}")
    return [load_file(f) for f in files]


def _assert_close(a: dict, b: dict, rtol=1e-4, atol=1e-6, keys=None):
    for k in keys or a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def _single_process_alignment(lr: float = LR_ALIGN, heldout: bool = False) -> tuple[list[dict], list[float]]:
    """AdamW on the mean of the two micro-batch alignment losses. Returns the proxy state at steps 0..STEPS
    and, with ``heldout``, the mean alignment loss on both ranks' held-out batches at each of those steps."""
    from iprox_lightning.alignment.losses import alignment_losses, proxy_factor_layers

    teacher = teacher_model().requires_grad_(False)
    proxy = svd_proxy(teacher).requires_grad_(False)
    params = [p for m in proxy_factor_layers(proxy).values() for p in (m.A, m.B)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    states, held = [], []
    for s in range(STEPS + 1):
        states.append({k: v.detach().clone() for k, v in proxy.state_dict().items()})
        if heldout:
            losses = [alignment_losses(teacher, proxy, val_micro_batch(i, r), kl_weight=0.1, create_graph=False).loss
                      for r in (0, 1) for i in range(VAL_BATCHES)]
            held.append(float(torch.stack(losses).mean()))
        if s == STEPS:
            break
        losses = [alignment_losses(teacher, proxy, micro_batch(s, r), kl_weight=0.1).loss for r in range(2)]
        opt.zero_grad()
        ((losses[0] + losses[1]) / 2).backward()
        opt.step()
    return states, held


@pytest.mark.distributed
def test_ddp_alignment_ranks_identical_and_equal_to_mean_of_micro_batch_losses(dist_out):
    torch.set_num_threads(1)
    r0, r1 = _results(dist_out, "align_ddp")
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks differ on {k}"
    states, _ = _single_process_alignment()
    init, ref = states[0], states[-1]
    moved = [k for k in ref if not torch.equal(ref[k], init[k])]
    assert moved and all(k.endswith((".A", ".B")) for k in moved)
    _assert_close(r0, ref)
    _assert_only_factors_moved_and_saved(r0, init, dist_out / "align_ddp-proxy")


def _assert_only_factors_moved_and_saved(state, init, proxy_dir):
    """Non-factor tensors bit-identical to the initial proxy; the saved proxy holds exactly ``state``."""
    from iprox_lightning.compression.apply import load_proxy

    for k in init:
        if not k.endswith((".A", ".B")):
            assert torch.equal(state[k], init[k]), k
    saved, _ = load_proxy(proxy_dir)
    for k, v in saved.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.distributed
def test_fsdp2_alignment_double_backward_on_cpu_gloo(dist_out):
    """FSDP2 with unsharded params kept through both backward passes equals the DDP semantics."""
    torch.set_num_threads(1)
    (r0,) = _results(dist_out, "align_fsdp2", ranks=(0,))
    states, _ = _single_process_alignment()
    init, ref = states[0], states[-1]
    assert set(r0) == set(ref)
    _assert_close(r0, ref)
    _assert_only_factors_moved_and_saved(r0, init, dist_out / "align_fsdp2-proxy")


@pytest.mark.distributed
def test_fsdp2_alignment_with_heldout_checks_and_keep_best(dist_out):
    """FSDP2 with a validation loader: the held-out loss at step 0 (un-aligned factors, computed outside
    Lightning's loop) and after every step equals single-process alignment evaluated on both ranks' held-out
    batches, on both ranks; keep_best saves the factors of the best step."""
    from iprox_lightning.compression.apply import load_proxy

    torch.set_num_threads(1)
    (r0,) = _results(dist_out, "align_fsdp2_val", ranks=(0,))
    hist = [json.loads((dist_out / f"align_fsdp2_val-history-rank{r}.json").read_text()) for r in (0, 1)]
    assert hist[0] == hist[1] and [h["step"] for h in hist[0]] == list(range(STEPS + 1))
    # single-process reference: the DDP semantics of the training step, a held-out loss after each step
    ref_factors, ref_loss = _single_process_alignment(LR_ALIGN_VAL, heldout=True)
    got = [h["val/loss"] for h in hist[0]]
    assert got == pytest.approx(ref_loss, rel=1e-4)
    assert len(set(round(v, 6) for v in ref_loss)) == len(ref_loss)  # every step moved the held-out loss
    best = min(range(len(got)), key=got.__getitem__)
    assert 0 < best < STEPS  # neither the un-aligned nor the last factors: restoring is really tested
    saved, _ = load_proxy(dist_out / "align_fsdp2_val-proxy")
    _assert_close(saved.state_dict(), ref_factors[best])
    _assert_close(r0, ref_factors[best])  # restored into the module as well


def _single_process_warmup(losses: list | None = None) -> dict:
    """The final state of single-process warm-up on the concatenated batches; ``losses`` gets each step's loss of
    each rank's batch (``losses[step][rank]``, before the step)."""
    from iprox_lightning.training.causal_lm import decay_param_groups, freeze_embeddings_and_head
    from iprox_lightning.engine.batch import sft_loss

    model = teacher_model()
    model.train()
    freeze_embeddings_and_head(model)
    opt = torch.optim.AdamW(decay_param_groups(model, 0.01), lr=LR_WARM)
    for s in range(STEPS):
        if losses is not None:
            with torch.no_grad():
                losses.append([float(sft_loss(model(input_ids=m["input_ids"], attention_mask=m["attention_mask"]).logits,
                                              m["labels"])) for m in (micro_batch(s, 0), micro_batch(s, 1))])
        b = concat(micro_batch(s, 0), micro_batch(s, 1))
        loss = sft_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.distributed
def test_ddp_warmup_equals_single_process_on_concatenated_batch(dist_out):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    r0, r1 = _results(dist_out, "warmup_ddp")
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks differ on {k}"
    _assert_close(r0, _single_process_warmup())
    saved = AutoModelForCausalLM.from_pretrained(dist_out / "warmup_ddp-hf").state_dict()
    for k in r0:
        assert torch.equal(saved[k], r0[k]), k


@pytest.mark.distributed
def test_fsdp2_warmup_on_cpu_gloo(dist_out):
    """ModelParallelStrategy (FSDP2, fully_shard per decoder block) trains on CPU gloo, equals single process."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    (r0,) = _results(dist_out, "warmup_fsdp2", ranks=(0,))
    ref = _single_process_warmup()
    assert set(r0) == set(ref)
    _assert_close(r0, ref)
    saved = AutoModelForCausalLM.from_pretrained(dist_out / "warmup_fsdp2-hf").state_dict()
    for k in r0:
        assert torch.equal(saved[k], r0[k]), k


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    _worker(sys.argv[1])


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["warmup_ddp_levers", "warmup_fsdp2_levers"])
def test_warmup_with_memory_levers_on_two_gloo_ranks_equals_one_process(dist_out, mode):
    """Micro-batches of one example and activation checkpointing under DDP (a backward per micro-batch, each
    all-reduced), and under FSDP2 also the CPU offload of the sharded weights, gradients and AdamW moments: every
    rank's loss at every step equals one process's loss of that rank's batch to 1e-5, and the trained weights equal
    single-process training on the concatenated batches (to the tolerance of the plain DDP / FSDP2 tests: the
    all-reduce and the micro-batches sum in another order)."""
    torch.set_num_threads(1)
    ranks = (0, 1) if "ddp" in mode else (0,)
    got = _results(dist_out, mode, ranks=ranks)
    ref_losses: list = []
    ref = _single_process_warmup(ref_losses)
    for r0 in got:
        assert set(r0) == set(ref)
        _assert_close(r0, ref)
    for rank in (0, 1):
        losses = json.loads((dist_out / f"{mode}-losses-rank{rank}.json").read_text())
        assert losses == pytest.approx([step[rank] for step in ref_losses], rel=1e-5, abs=1e-6)
