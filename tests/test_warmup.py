"""WarmupModule / CausalLMModule: frozen embeddings + LM head, SFT loss, schedule, save_pretrained output."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from iprox_lightning.engine.batch import sft_loss
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.modules import WarmupModule
from iprox_lightning.training.causal_lm import decay_param_groups, linear_warmup_decay
from test_alignment_module import make_batch  # the tests' shared SFT batch


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


def fit(module, n=4, **kw):
    tr = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kw)
    tr.fit(module, DataLoader([make_batch(i) for i in range(n)], batch_size=None))
    return tr


@pytest.mark.parametrize("tied", [False, True])
def test_warmup_freezes_embeddings_and_head_and_saves_hf_dir(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model = tiny_causal_lm("llama", seed=1, tie_word_embeddings=tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = WarmupModule(model=model, lr=1e-3, save_dir=str(tmp_path / "warm"))
    tr = fit(m)
    opt_ids = {id(p) for g in tr.optimizers[0].param_groups for p in g["params"]}
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (emb is head) == tied
    assert id(emb) not in opt_ids and id(head) not in opt_ids
    after = model.state_dict()
    for k in after:
        same = torch.equal(after[k], before[k])
        if "embed_tokens" in k or "lm_head" in k:
            assert same, k
        elif k.endswith("proj.weight"):
            assert not same, k  # every projection matrix trained
    # norm weights train too (no weight decay on them)
    assert not torch.equal(after["model.norm.weight"], before["model.norm.weight"])

    saved = tmp_path / "warm"
    assert (saved / "model.safetensors").is_file() and (saved / "config.json").is_file()
    assert not list(saved.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_warmup_reduces_sft_loss_on_its_data():
    model = tiny_causal_lm("qwen2", seed=0)
    batches = [make_batch(i) for i in range(4)]

    def loss():
        with torch.no_grad():
            return sum(sft_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                b["labels"]).item() for b in batches) / 4

    l0 = loss()
    m = WarmupModule(model=model, lr=3e-3, warmup_ratio=0.0, lr_schedule="constant")
    tr = L.Trainer(accelerator="cpu", max_epochs=5, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    tr.fit(m, DataLoader(batches, batch_size=None))
    assert loss() < l0 - 0.1


def test_step_loss_is_response_token_mean():
    model = tiny_causal_lm("llama", seed=0)
    m = WarmupModule(model=model)
    m.configure_model()
    b = make_batch(3)
    b["labels"][0, 8:] = -100  # unequal token counts per row
    loss, local = m.sft_step(b)
    ref = sft_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6) and local.item() == pytest.approx(ref.item(), rel=1e-6)


def test_param_groups_and_schedule():
    model = tiny_causal_lm("qwen2", seed=0)  # qwen2 has q/k/v biases
    groups = decay_param_groups(model, 0.01)
    assert groups[0]["weight_decay"] == 0.01 and all(p.dim() >= 2 for p in groups[0]["params"])
    assert groups[1]["weight_decay"] == 0.0 and all(p.dim() == 1 for p in groups[1]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = linear_warmup_decay(opt, total_steps=10, warmup_ratio=0.2)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warm-up 2 steps: 1/3, 2/3; then (10 - s)/8 for s = 2..9
    expected = [1 / 3, 2 / 3] + [(10 - s) / 8 for s in range(2, 10)]
    assert lrs == pytest.approx(expected)
    with pytest.raises(ValueError, match="lr_schedule"):
        WarmupModule(lr_schedule="cosine")


def test_warmup_loads_builtin_by_name(tmp_path):
    m = WarmupModule(model="builtin", save_dir=str(tmp_path / "w"))
    m.configure_model()
    assert m.tokenizer is not None and m.hparams.model == "builtin"
    assert not m.model.get_input_embeddings().weight.requires_grad
    m.save_model(str(tmp_path / "w"))
    assert (tmp_path / "w" / "tokenizer_config.json").is_file() and (tmp_path / "w" / "model.safetensors").is_file()
