"""Analytic FLOPs vs a hand count and vs torch.utils.flop_counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from iprox_lightning.analysis.flops import (
    ModelShape,
    alignment_flops,
    ipsvd_flops,
    pipeline_flops,
    probe_flops,
    scoring_flops,
    svd_flops,
)
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.models.tiny import tiny_causal_lm, tiny_config


def test_forward_flops_hand_count_tiny_llama():
    # hidden 32, inter 64, 4 heads x 8, 2 kv heads, vocab 128, 2 layers; B=2, T=16
    s = ModelShape.from_model(tiny_causal_lm("llama"))
    B, T, h, kv, inter, V = 2, 16, 32, 16, 64, 128
    per_tok_layer = 2 * (h * h + h * kv + h * kv + h * h + 3 * h * inter)  # q, k, v, o, gate/up/down
    lin = 2 * B * T * per_tok_layer
    att = 2 * 4 * B * T * T * 4 * 8  # QK^T + AV, 2 layers
    head = 2 * B * T * h * V
    f = s.forward_flops(B, T)
    assert (f["linear"], f["attention"], f["lm_head"]) == (lin, att, head)
    assert s.tracked_params == 2 * (per_tok_layer // 2)
    assert s.forward_flops(B, T, attention="causal")["attention"] == 2 * 4 * B * (T * (T + 1) / 2) * 4 * 8


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_forward_and_backward_match_flop_counter(arch):
    model = tiny_causal_lm(arch)
    s = ModelShape.from_model(model)
    x = torch.randint(3, 128, (2, 12))
    with FlopCounterMode(display=False) as fc:
        logits = model(input_ids=x).logits
    assert s.forward_flops(2, 12)["total"] == fc.get_total_flops()
    # embeddings and LM head frozen (as in the paper): head costs 1x, block linears 2x, attention 2x
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    logits = model(input_ids=x).logits
    with FlopCounterMode(display=False) as fc:
        logits.square().mean().backward()
    assert s.backward_flops(2, 12, weight_grads="all")["total"] == fc.get_total_flops()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_head_on_scored_positions_matches_flop_counter(arch):
    """The product's forward (the LM head on the response tokens only, batch.scored_logits): head_share = N / (B·T)."""
    from iprox_lightning.engine.batch import scored_logits

    model = tiny_causal_lm(arch)
    s = ModelShape.from_model(model)
    x = torch.randint(3, 128, (2, 12))
    labels = x.clone()
    labels[0, :9] = -100  # 3 scored positions in row 0 (8, 9, 10), 6 in row 1 (5..10)
    labels[1, :6] = -100
    with FlopCounterMode(display=False) as fc:
        logits, scored = scored_logits(model, {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": labels})
    assert logits.shape[0] == 9
    assert s.forward_flops(2, 12, head_share=9 / 24)["total"] == fc.get_total_flops()
    with pytest.raises(ValueError, match="head_share"):
        s.forward_flops(2, 12, head_share=1.5)


def test_lowrank_proxy_shape_matches_flop_counter_and_from_config():
    model = tiny_causal_lm("qwen2")
    target = ModelShape.from_model(model)
    ranks = {"model.layers.0.mlp.up_proj": 5, "model.layers.1.self_attn.q_proj": 3}
    proxy = target.with_ranks(ranks)
    for name, r in ranks.items():
        lin = model.get_submodule(name)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, LowRankLinear(lin.in_features, lin.out_features, r, bias=lin.bias is not None))
    x = torch.randint(3, 128, (1, 9))
    with FlopCounterMode(display=False) as fc:
        model(input_ids=x)
    assert proxy.forward_flops(1, 9)["total"] == fc.get_total_flops()
    assert ModelShape.from_model(model).forward_flops(1, 9) == proxy.forward_flops(1, 9)
    # the shape can be read from the config alone (meta device) with per-layer ranks
    from_cfg = ModelShape.from_config(tiny_config("qwen2"), ranks=ranks)
    assert from_cfg.forward_flops(1, 9) == proxy.forward_flops(1, 9)
    assert from_cfg.tracked_params == proxy.tracked_params
    with pytest.raises(KeyError, match="not in"):
        target.with_ranks({"model.layers.9.mlp.up_proj": 2})


def test_stage_flops_hand_count():
    t = ModelShape.from_model(tiny_causal_lm("llama"))
    ranks = {l.name: 4 for l in t.linears}
    p = t.with_ranks(ranks)
    n, T = 3, 10
    # probe: forward + input-grad backward (linears 1x, attention 2x, head 1x) + IPSVD
    f = t.forward_flops(n, T)
    pr = probe_flops(t, p, n_examples=n, seq_len=T, n_vectors=6)
    assert pr["forward"] == f["total"]
    assert pr["backward"] == f["linear"] + 2 * f["attention"] + f["lm_head"]
    assert pr["ipsvd"] == sum(ipsvd_flops(in_features=l.in_features, out_features=l.out_features, n_vectors=6, rank=4)
                              for l in t.linears)
    # one layer of IPSVD by hand: out 16, in 32, N 6, r 4
    hand = (6 * 32 * 36 + 20 * 216) + (6 * 16 * 36 + 20 * 216) + 2 * 6 * 16 * 32 + 2 * 6 * 32 * 6 + (26 * 216) + 2 * 4 * (16 * 6 + 32 * 6)
    assert ipsvd_flops(in_features=32, out_features=16, n_vectors=6, rank=4) == hand
    with pytest.raises(TypeError):  # the old positional (out, in) call cannot silently swap the sizes
        ipsvd_flops(16, 32, 6, 4)
    assert svd_flops(3, 10) == svd_flops(10, 3) == 6 * 10 * 9 + 20 * 27
    # scoring: forward + backward with weight grads of tracked layers + one inner product per train example
    sc = scoring_flops(p, n_train=7, n_val=2, seq_len=T)
    fp = p.forward_flops(9, T)
    assert sc["backward"] == 2 * fp["linear"] + 2 * fp["attention"] + fp["lm_head"]
    assert sc["inner_products"] == 2 * 7 * p.tracked_params
    al = alignment_flops(t, p, n_examples=n, seq_len=T, epochs=2)
    assert al["double_backward"] == pytest.approx(2.0 * (al["proxy_forward"] + al["proxy_backward"]))
    assert al["projection"] == sum(4 * n * 2 * T * 4 * (l.in_features + l.out_features) for l in t.linears)
    tot = pipeline_flops(t, p, seq_len=T, n_train=7, n_val=2, n_probe_examples=n, n_probe_vectors=6, n_align_examples=n, align_epochs=2)
    assert tot["total"] == pytest.approx(pr["total"] + al["total"] + sc["total"])
    # scoring with the target itself costs more than with the proxy
    assert pipeline_flops(t, None, seq_len=T, n_train=7, n_val=2)["scoring"] > sc["total"]
    # the LM head on a share of the tokens (the product's scored positions): every stage saves exactly that share of
    # its head passes — probe 2 (fwd + input-grad bwd); alignment 2 teacher + 2 proxy passes, the proxy's counted
    # 1 + 2 times (its double backward); scoring 2 per example
    share = 0.25
    head = t.forward_flops(1, T)["lm_head"]  # one sequence's head forward
    kw = dict(seq_len=T, n_train=7, n_val=2, n_probe_examples=n, n_probe_vectors=6, n_align_examples=n, align_epochs=2)
    part = pipeline_flops(t, p, head_share=share, **kw)
    saved = (1 - share) * head
    assert tot["probe"] - part["probe"] == pytest.approx(2 * n * saved)
    assert tot["alignment"] - part["alignment"] == pytest.approx((2 + 2 * 3) * 2 * n * saved)
    assert tot["scoring"] - part["scoring"] == pytest.approx(2 * 9 * saved)


def test_flops_rows_report():
    from iprox_lightning.analysis.tables import flops_rows, format_table

    t = ModelShape.from_model(tiny_causal_lm("llama"))
    p = t.with_ranks({l.name: 4 for l in t.linears})
    kw = dict(seq_len=32, n_train=50, n_val=5)
    rows = flops_rows(t, {"target": None, "iprox": p}, **kw)
    assert rows[0]["TFLOPs_scoring"] == pytest.approx(pipeline_flops(t, None, **kw)["scoring"] / 1e12)
    assert rows[1]["TFLOPs_total"] == pytest.approx(pipeline_flops(t, p, **kw)["total"] / 1e12)
    assert rows[1]["params_tracked"] == sum(4 * (l.in_features + l.out_features) for l in t.linears)
    assert "| iprox |" in format_table(rows)
