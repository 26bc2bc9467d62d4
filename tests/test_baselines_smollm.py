"""Real-model checks on SmolLM2-135M (slow): layer extraction, FLOPs, SA / 1-NND, regression scorer."""
import json

import pytest
import torch

pytestmark = pytest.mark.slow


def _pool_batches(tokenizer, path, n=8, max_len=64, batch_size=4):
    recs = [json.loads(l) for _, l in zip(range(n), open(path, encoding="utf-8"))]
    batches = []
    for s in range(0, n, batch_size):
        rows = []
        for r in recs[s : s + batch_size]:
            prompt = r["instruction"] + ("\n\n" + r["context"] if r["context"] else "") + "\n"
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a = tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            p = p[-(max_len // 2):]  # keep the end of long prompts so every example has response tokens
            ids = (p + a)[:max_len]
            lab = ([-100] * len(p) + a)[:max_len]
            rows.append((r["id"], ids, lab))
        T = max(len(x[1]) for x in rows)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batches.append({
            "input_ids": torch.tensor([x[1] + [pad] * (T - len(x[1])) for x in rows]),
            "attention_mask": torch.tensor([[1] * len(x[1]) + [0] * (T - len(x[1])) for x in rows]),
            "labels": torch.tensor([x[2] + [-100] * (T - len(x[2])) for x in rows]),
            "id": [x[0] for x in rows],
        })
    return batches


@pytest.fixture(scope="module")
def smollm(smollm_gguf):
    from iprox_lightning.models.loading import load_model

    return load_model(str(smollm_gguf))


@pytest.fixture(scope="module")
def pool_batches(smollm, shared_dir):
    return _pool_batches(smollm[1], shared_dir / "data" / "pool" / "instructions.jsonl")


def test_smollm_layer_extraction(smollm, pool_batches, tmp_path):
    from transformers import AutoModelForCausalLM

    from iprox_lightning.baselines.layer_extraction import layer_extraction_proxy, save_layer_extraction
    from iprox_lightning.engine.batch import sft_loss

    model, tok = smollm
    proxy, info = layer_extraction_proxy(model, pool_batches, sparsity=0.3, progress=False)
    assert info["num_layers_before"] == 30 and info["num_layers_after"] == 21
    assert proxy.config.num_hidden_layers == 21 and model.config.num_hidden_layers == 30
    imp = torch.tensor(info["importance"])
    assert torch.all((imp > 0) & (imp < 2))
    b = pool_batches[0]
    with torch.no_grad():
        full = sft_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
        cut = sft_loss(proxy(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    print(f"\nSmolLM2 block importance: {[round(x, 3) for x in info['importance']]}\nkept {info['kept_blocks']}\n"
          f"response loss full {float(full):.3f} vs 21-block proxy {float(cut):.3f}")
    assert torch.isfinite(cut) and float(cut) < 3 * float(full) + 5
    out = save_layer_extraction(proxy, info, tmp_path / "le", tokenizer=tok)
    re = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(re(input_ids=b["input_ids"][:1, :16]).logits, proxy(input_ids=b["input_ids"][:1, :16]).logits)


def test_smollm_flops_match_counter(smollm):
    from torch.utils.flop_counter import FlopCounterMode

    from iprox_lightning.analysis.flops import ModelShape, pipeline_flops

    model, _ = smollm
    shape = ModelShape.from_model(model)
    x = torch.randint(0, 1000, (1, 32))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=x)
    assert shape.forward_flops(1, 32)["total"] == fc.get_total_flops()
    from_cfg = ModelShape.from_config(model.config)
    assert from_cfg.forward_flops(1, 32) == shape.forward_flops(1, 32)
    # a rho = 0.5 proxy: each tracked layer keeps half its parameters
    ranks = {l.name: max(1, int(0.5 * l.out_features * l.in_features / (l.out_features + l.in_features)))
             for l in shape.linears if l.tracked}
    proxy = shape.with_ranks(ranks)
    common = dict(seq_len=256, n_train=16574, n_val=285)
    full = pipeline_flops(shape, None, **common)
    prox = pipeline_flops(shape, proxy, n_probe_examples=17, n_probe_vectors=512, n_align_examples=149, **common)
    print(f"\nSmolLM2 TFLOPs (T=256, pool 16574): target scoring {full['scoring'] / 1e12:.1f}; "
          f"rho=0.5 proxy: probe {prox['probe'] / 1e12:.3f}, alignment {prox['alignment'] / 1e12:.3f}, "
          f"scoring {prox['scoring'] / 1e12:.1f}, total {prox['total'] / 1e12:.1f}")
    assert prox["total"] < full["total"]


def test_smollm_sa_and_nnd(smollm, pool_batches):
    from iprox_lightning.analysis.subspace import mean_nn_distance, per_example_gradients, subspace_affinity

    model, _ = smollm
    ids, G = per_example_gradients(model, pool_batches, projection_dim=8, seed=0, progress=False)
    assert G.shape[0] == 8 and torch.isfinite(G).all() and bool((G.norm(dim=1) > 0).all())
    sa_self = subspace_affinity(G[:4], G[:4])
    sa_other = subspace_affinity(G[:4], G[4:])
    nnd = mean_nn_distance(G[:4])
    print(f"\nSmolLM2 projected grads d={G.shape[1]}: SA(self)={sa_self:.3f} SA(other)={sa_other:.3f} 1-NND={nnd:.3f}")
    assert sa_self == pytest.approx(1.0) and 0 < sa_other < 1 and nnd > 0
