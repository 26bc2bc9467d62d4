"""A LoRA warm-up under 2-process CPU gloo DDP (torchrun) equals single-process LoRA training on the concatenated batch,
and rank 0 alone writes the adapters and the merged model (issue 66).

The test launches this file with ``python -m torch.distributed.run --nproc_per_node=2``; each rank trains the same
LoRA adapters on its own micro-batch (``tests/test_distributed_train.py``'s batches: unequal response-token counts,
so the global token normalisation matters) and writes them to ``<out>/lora_ddp-rank<r>.safetensors``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
STEPS = 3
LR = 1e-3  # the dense DDP test's (tests/test_distributed_train.py LR_WARM)
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _module(save_dir: str):
    from iprox_lightning.models.tiny import tiny_causal_lm
    from iprox_lightning.modules import WarmupModule

    module = WarmupModule(model=tiny_causal_lm("llama", seed=5), lr=LR, warmup_ratio=0.0, lr_schedule="constant",
                          save_dir=save_dir, lora=LORA)
    torch.manual_seed(0)  # the adapters' initialisation, the same on every rank and in the reference
    module.configure_model()
    return module


def _adapters(module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items() if "lora_" in k}


def _fit(module, batches, **trainer_kw):
    import lightning as L
    from torch.utils.data import DataLoader

    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        **trainer_kw)
    trainer.fit(module, DataLoader(batches, batch_size=None))


def _worker(out: str) -> None:
    from safetensors.torch import save_file

    from test_distributed_train import micro_batch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    module = _module(f"{out}/lora_ddp-hf")
    trained = {}
    orig = module.on_fit_end

    def keep_then_save():  # the adapters as trained, before on_fit_end merges them into the model
        trained.update(_adapters(module))
        orig()

    module.on_fit_end = keep_then_save
    _fit(module, [micro_batch(s, rank) for s in range(STEPS)], devices=2, strategy="ddp")
    save_file({k: v.contiguous() for k, v in trained.items()}, f"{out}/lora_ddp-rank{rank}.safetensors")


@pytest.mark.distributed
def test_ddp_lora_warmup_equals_single_process_on_concatenated_batch(tmp_path):
    from safetensors.torch import load_file

    from test_distributed_train import concat, micro_batch, torchrun_two_ranks

    torch.set_num_threads(1)
    res = torchrun_two_ranks(HERE, tmp_path, timeout=300)
    files = [tmp_path / f"lora_ddp-rank{r}.safetensors" for r in (0, 1)]
    assert all(f.is_file() for f in files), (tmp_path / "log.txt").read_text()[-5000:]
    assert res.returncode == 0
    r0, r1 = (load_file(f) for f in files)
    assert sorted(r0) == sorted(r1) and len(r0) == 2 * 3 * 2  # A and B of 3 layers in 2 blocks
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks differ on {k}"
    assert all(r0[k].abs().max() > 1e-4 for k in r0 if "lora_B" in k)  # B starts at zero: the adapters trained
    # the reference: one process, both ranks' micro-batches concatenated
    ref = _module(str(tmp_path / "ref-hf"))
    trained = {}
    orig = ref.on_fit_end
    ref.on_fit_end = lambda: (trained.update(_adapters(ref)), orig())
    _fit(ref, [concat(micro_batch(s, 0), micro_batch(s, 1)) for s in range(STEPS)])
    for k in r0:
        # gradients all-reduced vs one batch: float32 sums in another order (the dense DDP test's tolerance)
        torch.testing.assert_close(r0[k], trained[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    # rank 0 wrote the adapters (safetensors) and the merged model, which equals the reference's merged model
    saved = load_file(tmp_path / "lora_ddp-hf" / "adapters" / "final" / "adapter_model.safetensors")
    assert len(saved) == len(r0)
    from iprox_lightning.models.loading import load_model

    ddp_merged, _ = load_model(str(tmp_path / "lora_ddp-hf"), tokenizer=False)
    ref_merged, _ = load_model(str(tmp_path / "ref-hf"), tokenizer=False)
    for k, v in ref_merged.state_dict().items():
        torch.testing.assert_close(ddp_merged.state_dict()[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    _worker(sys.argv[1])
