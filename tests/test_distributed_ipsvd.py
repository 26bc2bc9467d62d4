"""Stage 1 (``IPSVDCallback``) under 2-process CPU gloo DDP (torchrun): each rank decomposes its share of the layers.

The test functions launch this very file with ``python -m torch.distributed.run --nproc_per_node=2``; in each mode
every rank records, right after Stage 1 (``on_fit_start``, before any training step), its proxy's state, the report
it holds and how many times it ran ``compress``. The tests compare both ranks with one process's ``compress`` of the
same model and probe batches, computed here with the same thread count (one): the factors are bitwise equal.

* ``build``: ``ProxyAlignModule`` (teacher and proxy built in ``configure_model``), IPSVD with the global allocation,
  the health check on the alignment split and the proxy saved by rank 0;
* ``drop``: ``drop_blocks=1`` and ``keep_dense`` (the structure rank 1 receives differs from its loaded model);
* ``group``: ``probe_group_layers=2`` (each rank's probes two layers at a time);
* ``one``: a single layer to decompose (rank 1 has no share);
* ``fail``: rank 0's probes raise; rank 1 stops at once with rank 0's error instead of waiting for the timeout.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]  # this checkout's package (torchrun runs this file), test_probes

from test_probes import make_batches  # noqa: E402

SETTINGS = {
    "build": dict(sparsity=0.5, num_probe_tokens=24, allocation="global"),
    "drop": dict(sparsity=0.5, num_probe_tokens=24, allocation="global", drop_blocks=1, keep_dense=[r"layers\.0\.mlp"]),
    "group": dict(sparsity=0.5, num_probe_tokens=24, allocation="global"),
    # one layer to decompose: rank 1 has none, and still holds the factors and the report (probe counts included)
    "one": dict(sparsity=0.5, num_probe_tokens=24, allocation="uniform", targets=["o_proj"],
                keep_dense=[r"layers\.[12]\."]),
}
GROUP = {"group": 2}  # probe_group_layers of each mode (None: one pass)
MODES = ("build", "drop", "group", "one", "fail")


def teacher_model():
    from iprox_lightning.models.tiny import tiny_causal_lm

    return tiny_causal_lm("llama", seed=5, num_layers=3)


def probe_batches():
    return make_batches(n_examples=6, batch_size=3, seed=2)


def align_batches():
    return make_batches(n_examples=4, batch_size=2, seed=3)


# ------------------------------------------------------------------------------------------------ worker
def _run_mode(mode: str, out: Path) -> None:
    import lightning as L
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    import iprox_lightning.compression.callback as ipsvd_callback
    from iprox_lightning.engine.batch import sft_loss
    from iprox_lightning.callbacks import IPSVDCallback
    from iprox_lightning.modules import ProxyAlignModule

    rank = int(os.environ["RANK"])
    calls = []
    real_compress = ipsvd_callback.compress
    ipsvd_callback.compress = lambda *a, **k: calls.append(1) or real_compress(*a, **k)
    import iprox_lightning.compression.plan as plan_module

    spectra = []  # the layers whose exact IPSVD this rank computed (the global allocation's spectra)
    real_whitened = plan_module.whitened_svd
    plan_module.whitened_svd = lambda W, *a, **k: spectra.append(tuple(W.shape)) or real_whitened(W, *a, **k)

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(make_batches(n_examples=2, batch_size=2, seed=10 + rank), batch_size=None)

        def probe_dataloader(self):
            if mode == "fail" and rank == 0:
                raise ValueError("the probe file is unreadable")
            return probe_batches()

        def dataloader(self, split):
            assert split == "align"
            return align_batches()

    class Dense(L.LightningModule):  # no teacher: drop_blocks is allowed without alignment
        def __init__(self):
            super().__init__()
            self.proxy = None

        def configure_model(self):
            if self.proxy is None:
                self.proxy = teacher_model()

        def training_step(self, batch, batch_idx):
            return sft_loss(self.proxy(input_ids=batch["input_ids"]).logits, batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.proxy.parameters() if p.requires_grad], lr=0.0)

    class AfterStageOne(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            state = {k: v.detach().contiguous() for k, v in pl_module.proxy.state_dict().items()}
            save_file(state, str(out / f"{mode}-rank{rank}.safetensors"))
            report = pl_module.ipsvd_report.to_dict()
            (out / f"{mode}-rank{rank}.json").write_text(json.dumps({"report": report, "compress_calls": len(calls),
                                                                    "spectra": spectra},
                                                                   default=str))

    if mode == "build":
        module = ProxyAlignModule(target=teacher_model(), kl_weight=0.1, lr=1e-3, log_layer_cosines=False)
        callback = IPSVDCallback(**SETTINGS["build"], save_dir=str(out / "build-proxy"))
    else:
        module = Dense()
        callback = IPSVDCallback(**SETTINGS.get(mode, SETTINGS["build"]), health_batches=0,
                                 probe_group_layers=GROUP.get(mode))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[callback, AfterStageOne()])
    t0 = time.perf_counter()
    try:
        trainer.fit(module, datamodule=Data())
    except Exception as e:
        if mode != "fail":
            raise
        (out / f"fail-rank{rank}.error").write_text(
            json.dumps({"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}))
    finally:
        ipsvd_callback.compress = real_compress
        plan_module.whitened_svd = real_whitened


def _worker(out: str) -> None:
    torch.set_num_threads(1)
    for mode in MODES:
        _run_mode(mode, Path(out))
    # the "fail" mode leaves the process group of an interrupted fit: destroyed here, not by the interpreter's exit
    # (which could abort the rank: "terminate called without an active exception", seen once in a fresh-clone CI run)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def dist_out(tmp_path_factory) -> Path:
    """One torchrun launch (2 CPU gloo ranks) running every mode in turn."""
    from test_distributed_train import torchrun_two_ranks

    out = tmp_path_factory.mktemp("dist_ipsvd")
    res = torchrun_two_ranks(HERE, out, timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    return out


def _rank_results(out: Path, mode: str) -> list[tuple[dict, dict]]:
    from safetensors.torch import load_file

    return [(load_file(out / f"{mode}-rank{r}.safetensors"), json.loads((out / f"{mode}-rank{r}.json").read_text()))
            for r in (0, 1)]


def _one_process(mode: str, group: int | None = None):
    """One process's Stage 1 of the same model and probe batches (the callback's ``compress``, one thread)."""
    import iprox_lightning.compression.plan as plan_module
    from iprox_lightning.compression.apply import CompressionConfig, compress

    torch.set_num_threads(1)
    model = teacher_model()
    spectra, real = [], plan_module.whitened_svd
    plan_module.whitened_svd = lambda W, *a, **k: spectra.append(list(W.shape)) or real(W, *a, **k)
    try:
        report = compress(model, probe_batches(), CompressionConfig(**SETTINGS[mode]), progress=False,
                          probe_group_layers=group)
    finally:
        plan_module.whitened_svd = real
    return model.state_dict(), report, spectra


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["build", "drop", "group", "one"])
def test_each_rank_decomposes_its_share_and_every_rank_holds_one_process_factors(dist_out, mode):
    (s0, r0), (s1, r1) = _rank_results(dist_out, mode)
    assert r0["compress_calls"] == 1 and r1["compress_calls"] == 1  # every rank: its share of the layers
    n0, n1 = len(r0["spectra"]), len(r1["spectra"])
    assert (n0 and n1) or mode == "one"  # both ranks decomposed layers (the global allocation's spectra), each once
    ref_state, ref_report, ref_spectra = _one_process(mode, GROUP.get(mode))
    assert set(s0) == set(s1) == set(ref_state)
    factors = [k for k in ref_state if k.endswith((".A", ".B"))]
    assert factors
    for k in ref_state:  # bitwise: the same probe columns and the same functions on them, on whichever rank
        assert torch.equal(s0[k], ref_state[k]) and torch.equal(s1[k], ref_state[k]), k
    assert r0["report"] == r1["report"]  # one report on every rank (health included: rank 0's)
    assert [lr["objective"] for lr in r1["report"]["layers"]] == [lr.objective for lr in ref_report.layers]
    ranks = {lr.name: lr.rank for lr in ref_report.layers}
    assert r1["report"]["probe_tokens"] == ref_report.probe_tokens > 0
    assert sorted(r0["spectra"] + r1["spectra"]) == sorted(ref_spectra)  # between them, one process's decompositions
    assert {lr["name"]: lr["rank"] for lr in r1["report"]["layers"]} == ranks
    if mode == "group":  # and the single pass's factors: the same ranks, equal to rounding (compress's docstring)
        single_state, single_report, _ = _one_process(mode)
        assert {lr.name: lr.rank for lr in single_report.layers} == ranks
        for k in factors:
            err = float((single_state[k] - ref_state[k]).norm() / single_state[k].norm())
            assert err <= 1e-6, (k, err)
    if mode == "drop":
        assert r1["report"]["block_drop"]["dropped"] == ref_report.block_drop.dropped
        assert sum(".mlp." in k and "layers.0." in k and k.endswith(".A") for k in s1) == 0  # keep_dense kept dense
    if mode == "build":
        from iprox_lightning.compression.apply import load_proxy

        assert r1["report"]["health"]["examples"] > 0  # rank 0's health check, sent with the report
        saved, _ = load_proxy(dist_out / "build-proxy")
        for k, v in saved.state_dict().items():
            assert torch.equal(v, ref_state[k]), k


@pytest.mark.distributed
def test_a_stage_one_failure_on_rank_zero_stops_every_rank_at_once(dist_out):
    errors = [json.loads((dist_out / f"fail-rank{r}.error").read_text()) for r in (0, 1)]
    assert errors[0]["error"] == "ValueError: the probe file is unreadable"
    assert errors[1]["error"].startswith("StageOneFailed: Stage 1 failed on rank 0 (ValueError: the probe file is "
                                         "unreadable)")
    assert errors[1]["seconds"] < 60  # not the process group's 30-minute timeout


if __name__ == "__main__":
    _worker(sys.argv[1])
