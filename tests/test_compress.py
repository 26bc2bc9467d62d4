"""compress_model on tiny real architectures: layer swap, parameter counts, fwd/bwd, save/load."""
import json

import pytest
import torch

from iprox_lightning.engine.batch import sft_loss
from iprox_lightning.compression.apply import (
    PROXY_MANIFEST,
    compress_model,
    count_parameters,
    is_compressed,
    load_proxy,
    lowrank_layers,
    save_proxy,
)
from iprox_lightning.compression.ipsvd import ipsvd_factors, svd_factors
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.engine.target_layers import find_target_linears, linear_shape, linear_weight
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.compression.probes import collect_probes
from iprox_lightning.compression.ranks import rank_for_sparsity

from test_probes import make_batches


def expected_rank(in_f, out_f, rho, mult=1):
    """The rank formula written out independently: r = (1−ρ)·in·out/(in+out), nearest multiple."""
    r = (1 - rho) * in_f * out_f / (in_f + out_f)
    r = max(mult, mult * round(r / mult))
    return None if r >= min(in_f, out_f) else r


def test_rank_for_sparsity_values():
    # tiny llama shapes (hidden 32, kv 16, intermediate 64), by hand
    assert rank_for_sparsity(32, 32, 0.5) == 8  # 0.5·1024/64
    assert rank_for_sparsity(32, 16, 0.5) == 5  # 0.5·512/48 = 5.33
    assert rank_for_sparsity(32, 64, 0.5) == 11  # 0.5·2048/96 = 10.67
    assert rank_for_sparsity(576, 1536, 0.3) == 293  # SmolLM2 gate/up: 0.7·884736/2112 = 293.2
    assert rank_for_sparsity(576, 1536, 0.7, rank_multiple=128) == 128  # 125.7 -> 128
    assert rank_for_sparsity(576, 192, 0.3, rank_multiple=128) == 128  # 100.8 -> 128 < 192
    assert rank_for_sparsity(32, 16, 0.3, rank_multiple=16) is None  # would reach min(in, out): dense
    assert rank_for_sparsity(10, 10, 0.99) == 1
    with pytest.raises(ValueError, match="sparsity"):
        rank_for_sparsity(10, 10, 1.0)


ARCHS = ["llama", "qwen2", "gemma3", "gpt2", "phi3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_compress_roundtrip(arch, tmp_path):
    model = tiny_causal_lm(arch, seed=0)
    ref = {n: (linear_shape(m), linear_weight(m).detach().clone(), m) for n, m in find_target_linears(model).items()}
    dense_total = count_parameters(model)
    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    rho = 0.5
    rep = compress_model(model, batches, rho, num_probe_tokens=24, allocation="uniform", progress=False)
    # every targeted layer swapped at the formula's rank; parameter counts add up
    low = lowrank_layers(model)
    assert set(low) == set(ref)
    removed = added = 0
    for name, ((out_f, in_f), W, old) in ref.items():
        r = expected_rank(in_f, out_f, rho)
        assert low[name].rank == r and rep.ranks[name] == r
        assert low[name].A.shape == (out_f, r) and low[name].B.shape == (r, in_f)
        if getattr(old, "bias", None) is not None:
            assert torch.equal(low[name].bias, old.bias) and not low[name].bias.requires_grad
        removed += in_f * out_f
        added += r * (in_f + out_f)
    assert rep.params_before == dense_total
    assert rep.params_after == count_parameters(model) == dense_total - removed + added
    assert rep.params_requested == round(dense_total - removed + (1 - rho) * removed)
    assert rep.achieved_sparsity == pytest.approx(1 - added / removed)
    assert all(lr.objective is not None and 0 <= lr.relative_objective < 1 for lr in rep.layers)
    # forward/backward through the factors
    b = batches[0]
    model.train()
    loss = sft_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.A.grad is not None and m.A.grad.abs().sum() > 0 and m.B.grad.abs().sum() > 0 for m in low.values())
    model.zero_grad(set_to_none=True)
    model.eval()
    # save -> load: bit-identical weights and outputs
    save_proxy(model, None, tmp_path / "proxy", rep, target_model=f"tiny-{arch}")
    manifest = json.loads((tmp_path / "proxy" / PROXY_MANIFEST).read_text())
    assert manifest["target_model"] == f"tiny-{arch}" and manifest["sparsity"] == rho
    assert manifest["method"] == "ipsvd" and manifest["probe_tokens"] == 24 and manifest["params_after"] == rep.params_after
    assert {n: e["rank"] for n, e in manifest["layers"].items()} == rep.ranks
    loaded, tok = load_proxy(tmp_path / "proxy")
    assert tok is None
    sd1, sd2 = model.state_dict(), loaded.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    with torch.no_grad():
        out1 = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        out2 = loaded(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.equal(out1, out2)


def test_factors_are_ipsvd_of_the_collected_probes():
    model = tiny_causal_lm("llama", seed=3)
    batches = make_batches(n_examples=6, batch_size=3, seed=2)
    W = {n: linear_weight(m).detach().clone() for n, m in find_target_linears(model).items()}
    probes = collect_probes(model, batches, num_tokens=30, seed=0, progress=False)
    rep = compress_model(model, batches, 0.4, mode="core", damping=1e-2, damping_mode="relative",
                         num_probe_tokens=30, seed=0, progress=False)
    for name, m in lowrank_layers(model).items():
        A, B = ipsvd_factors(W[name], probes.H[name], probes.Delta[name], m.rank, mode="core", damping=1e-2,
                             damping_mode="relative")
        torch.testing.assert_close(m.A, A, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.B, B, rtol=1e-5, atol=1e-6)
    assert rep.mode == "core" and all(lr.mode == "core" for lr in rep.layers)


def test_core_fallback_and_baselines():
    batches = make_batches(n_examples=3, batch_size=3, seed=4)
    model = tiny_causal_lm("llama", seed=0)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj'.*mode='core' supports rank"):
        compress_model(model, batches, 0.1, mode="core", num_probe_tokens=4, core_fallback="error", progress=False)
    assert not is_compressed(model)  # failed on the first layer, nothing swapped
    rep = compress_model(model, batches, 0.1, mode="core", num_probe_tokens=4, progress=False)
    assert {lr.mode for lr in rep.layers} == {"exact"}  # every rank > N=4: recorded fallback
    with pytest.raises(ValueError, match="already compressed"):
        compress_model(model, batches, 0.5, progress=False)
    # plain SVD baseline, no probes needed
    model = tiny_causal_lm("llama", seed=0)
    W = {n: linear_weight(m).detach().clone() for n, m in find_target_linears(model).items()}
    rep = compress_model(model, None, 0.5, method="svd", progress=False)
    assert rep.method == "svd" and rep.probe_tokens == 0 and all(lr.objective is None for lr in rep.layers)
    for name, m in lowrank_layers(model).items():
        A, B = svd_factors(W[name], m.rank)
        assert torch.equal(m.A, A) and torch.equal(m.B, B)
    # random baseline: seeded, independent of the weights
    m1, m2 = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=1)
    compress_model(m1, None, 0.5, method="random", seed=5, progress=False)
    compress_model(m2, None, 0.5, method="random", seed=5, progress=False)
    l1, l2 = lowrank_layers(m1), lowrank_layers(m2)
    assert all(torch.equal(l1[n].A, l2[n].A) for n in l1)
    with pytest.raises(ValueError, match="needs a probe_dataloader"):
        compress_model(tiny_causal_lm("llama"), None, 0.5, method="ipsvd", progress=False)


def test_rank_multiple_keeps_small_layers_dense():
    model = tiny_causal_lm("llama", seed=0)
    before = count_parameters(model)
    rep = compress_model(model, None, 0.5, method="svd", rank_multiple=16, progress=False)
    ranks = rep.ranks
    # q/o 32x32: 8 -> 16 (< 32); k/v 16x32: 5.3 -> 16 = min -> dense; gate/up/down: 10.7 -> 16 (< 32)
    assert ranks["model.layers.0.self_attn.q_proj"] == 16
    assert ranks["model.layers.0.self_attn.k_proj"] is None
    assert ranks["model.layers.1.mlp.down_proj"] == 16
    assert isinstance(model.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, LowRankLinear)
    per_block_removed = 2 * 32 * 32 + 3 * 32 * 64
    per_block_added = 2 * 16 * 64 + 3 * 16 * 96
    assert rep.params_after == before - 2 * (per_block_removed - per_block_added)


def test_save_load_with_tokenizer_and_errors(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]")
    model = tiny_causal_lm("qwen2", seed=0)
    with pytest.raises(ValueError, match="no LowRankLinear"):
        save_proxy(model, tok, tmp_path / "p0")
    compress_model(model, None, 0.7, method="svd", progress=False)
    save_proxy(model, tok, tmp_path / "p")
    loaded, tok2 = load_proxy(tmp_path / "p")
    # (transformers 5 may pick the architecture's tokenizer class for a custom tokenizer; ids are kept)
    assert tok2 is not None and tok2.convert_tokens_to_ids(["hello", "world", "[PAD]"]) == [2, 3, 0]
    assert (tmp_path / "p" / "tokenizer.json").is_file()
    with pytest.raises(FileNotFoundError, match="not an IProX proxy directory"):
        load_proxy(tmp_path)
    man = json.loads((tmp_path / "p" / PROXY_MANIFEST).read_text())
    name = next(iter(man["layers"]))
    man["layers"][name]["in_features"] += 1
    (tmp_path / "p" / PROXY_MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ValueError, match=f"layer '{name}' is"):
        load_proxy(tmp_path / "p")


def test_summary_states_what_the_proxy_cannot_compress_and_warns_once(caplog, tmp_path):
    """Issue 55: a model whose vocabulary is most of it (Gemma-3-270M: a 262k-way embedding) keeps most of its
    parameters at any ρ; the summary says which share no ρ reaches (parameters and per-token matmul FLOPs), and a
    warning says it once when the whole model saves less than half of ρ."""
    import logging

    from iprox_lightning.workflow.summary import _uncompressible

    vocab, hidden = 4096, 32
    model = tiny_causal_lm("gemma3", seed=0, vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=True)
    total = count_parameters(model)
    targeted = sum(linear_shape(m)[0] * linear_shape(m)[1] for m in find_target_linears(model).values())
    with caplog.at_level(logging.WARNING, logger="iprox_lightning.compression.apply"):
        rep = compress_model(model, make_batches(n_examples=6, batch_size=3, seed=1), 0.5, num_probe_tokens=24,
                             allocation="uniform", progress=False)
        compress_model(tiny_causal_lm("gemma3", seed=0, vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=True),
                       make_batches(n_examples=6, batch_size=3, seed=1), 0.5, num_probe_tokens=24,
                       allocation="uniform", progress=False)
    # the shares, by hand: everything outside the targeted layers; FLOPs: the (tied) LM head's vocab x hidden matmul
    assert rep.fixed_param_share == pytest.approx(1 - targeted / total)
    assert rep.fixed_param_share > 0.8
    assert rep.fixed_flop_share == pytest.approx(vocab * hidden / (vocab * hidden + targeted))
    assert rep.param_saving < 0.25
    text = rep.summary()
    assert f"not compressible: {rep.fixed_param_share:.1%} of the parameters (embedding, LM head, norms)" in text
    assert f"{rep.fixed_flop_share:.1%} of the per-token matmul FLOPs (LM head)" in text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "saves only" in warned[0] and "sparsity 0.5" in warned[0], warned
    # the manifest carries the counts; the pipeline summary's line reads them
    save_proxy(model, None, tmp_path / "p", rep)
    manifest = json.loads((tmp_path / "p" / PROXY_MANIFEST).read_text())
    u = _uncompressible(manifest)["uncompressible"]
    assert u["params"] == pytest.approx(rep.fixed_param_share, abs=1e-4)
    assert u["flops"] == pytest.approx(rep.fixed_flop_share, abs=1e-4)


def test_a_model_mostly_made_of_targeted_layers_gets_no_warning(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="iprox_lightning.compression.apply"):
        rep = compress_model(tiny_causal_lm("llama", seed=0), make_batches(n_examples=6, batch_size=3, seed=1), 0.5,
                             num_probe_tokens=24, allocation="uniform", progress=False)
    assert rep.saving_warning() is None and not [r for r in caplog.records if r.levelno == logging.WARNING]
