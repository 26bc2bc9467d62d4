"""compress(drop_blocks=d): Layer Extraction's least important blocks removed, the rest IPSVD-compressed at the
whole-model parameter budget of the same ρ; saved / reloaded as a proxy; d = 0 is the unchanged path."""
import json

import pytest
import torch

from iprox_lightning.baselines.layer_extraction import block_importance, layer_extraction_proxy, remove_blocks
from iprox_lightning.callbacks import IPSVDCallback
from iprox_lightning.compression.apply import (
    PROXY_MANIFEST,
    CompressionConfig,
    compress_model,
    count_parameters,
    is_compressed,
    load_proxy,
    lowrank_layers,
    save_proxy,
)
from iprox_lightning.io.proxy import ProxyFormatError
from iprox_lightning.compression.ipsvd import compute_factors, weighted_spectrum
from iprox_lightning.engine.target_layers import find_target_linears, linear_shape, linear_weight
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.compression.probes import collect_probes
from iprox_lightning.compression.ranks import allocate_ranks, rank_for_sparsity

from test_probes import make_batches

RHO, N_TOKENS = 0.5, 24
KW = dict(num_probe_tokens=N_TOKENS, progress=False)


def _batches():
    return make_batches(n_examples=6, batch_size=3, seed=1)


def _model(arch="llama"):
    return tiny_causal_lm(arch, seed=0, num_layers=4)


def _in_plus_out(model):
    return [sum(linear_shape(m)) for m in find_target_linears(model).values()]


def _reference_global(model, batches, budget):
    """Today's global path written out from its parts: probes, weighted spectra, one budget, exact IPSVD factors."""
    modules = find_target_linears(model)
    probes = collect_probes(model, batches, modules, num_tokens=N_TOKENS, seed=0, progress=False)
    W = {n: linear_weight(m).detach() for n, m in modules.items()}
    spectra = {n: weighted_spectrum(W[n], probes.H[n], probes.Delta[n], damping=1e-3, damping_mode="relative")
               for n in modules}
    plan = allocate_ranks(spectra, {n: linear_shape(m) for n, m in modules.items()}, budget)
    factors = {}
    for k, n in enumerate(modules, start=1):
        if plan[n] is not None:
            factors[n] = compute_factors("ipsvd", W[n], plan[n], probes.H[n], probes.Delta[n], mode="exact", seed=k,
                                         damping=1e-3, damping_mode="relative", core_fallback="exact")
    return plan, factors


def test_drop_blocks_zero_is_the_unchanged_path():
    assert CompressionConfig() == CompressionConfig(drop_blocks=0)
    batches, model = _batches(), _model()
    ref_model = _model()
    budget = sum((1.0 - RHO) * o * i for o, i in (linear_shape(m) for m in find_target_linears(ref_model).values()))
    plan, factors = _reference_global(ref_model, batches, budget)
    rep = compress_model(model, batches, RHO, allocation="global", drop_blocks=0, **KW)
    assert rep.block_drop is None and "block_drop" not in rep.to_dict()
    assert rep.ranks == plan
    low = lowrank_layers(model)
    assert set(low) == set(factors)
    for n, (A, B) in factors.items():  # bit-identical factors
        assert torch.equal(low[n].A, A) and torch.equal(low[n].B, B), n


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_drop_one_block_global_equal_budget_and_layer_extraction_choice(arch):
    batches = _batches()
    base = _model(arch)
    bound = max(_in_plus_out(base))  # rank_multiple 1: one rank step of the widest layer
    importance = block_importance(_model(arch), batches, progress=False)
    _, le_info = layer_extraction_proxy(_model(arch), batches, sparsity=0.25, progress=False)  # 4 -> 3 blocks
    rep0 = compress_model(base, batches, RHO, allocation="global", **KW)

    model = _model(arch)
    rep1 = compress_model(model, batches, RHO, allocation="global", drop_blocks=1, **KW)
    bd = rep1.block_drop
    # the block Layer Extraction drops, by its own importance on the same (probe) batches
    assert bd.dropped == le_info["removed_blocks"] == [int(torch.argmin(importance))]
    assert bd.importance == importance.tolist()
    assert bd.kept == [i for i in range(4) if i not in bd.dropped] and bd.num_blocks_after == 3
    assert model.config.num_hidden_layers == 3 and bd.importance_tokens == sum(int(b["attention_mask"].sum()) for b in batches)
    # equal whole-model budget: both spend ≤ params_requested and leave less than one rank step of the widest layer
    assert rep1.params_requested == rep0.params_requested and rep1.params_before == rep0.params_before
    assert rep1.params_after == count_parameters(model)
    for rep in (rep0, rep1):
        assert rep.params_requested - bound < rep.params_after <= rep.params_requested
    assert abs(rep1.params_after - rep0.params_after) < bound
    # the budget handed back: the remaining layers hold more than (1 − ρ) of themselves
    remaining_dense = sum(lr.params_before for lr in rep1.layers)
    assert sum(lr.params_after for lr in rep1.layers) > (1 - RHO) * remaining_dense
    assert bd.layer_budget == rep1.params_requested - (rep1.params_after - rep1.target_params_after)

    # factors = Layer Extraction's cut model, probed after the cut, compressed with the remaining budget
    cut = remove_blocks(_model(arch), bd.kept)
    plan, factors = _reference_global(cut, batches, bd.layer_budget)
    assert rep1.ranks == plan
    low = lowrank_layers(model)
    for n, (A, B) in factors.items():
        assert torch.equal(low[n].A, A) and torch.equal(low[n].B, B), n


def test_drop_one_block_uniform_solves_one_sparsity():
    batches = _batches()
    base = _model()
    half_steps = sum(_in_plus_out(base)) / 2  # rank_multiple 1: each layer's rank within ½ of its exact rank
    rep0 = compress_model(base, batches, RHO, allocation="uniform", **KW)
    model = _model()
    rep1 = compress_model(model, batches, RHO, allocation="uniform", drop_blocks=1, **KW)
    rho2 = rep1.block_drop.layer_sparsity
    # 4 blocks -> 3: everything but the targeted layers keeps 8,416 of the 26,912 requested: ρ' = 1 − 18,496/27,648
    assert rep1.block_drop.layer_budget == 18496 and rho2 == pytest.approx(1 - 18496 / 27648)
    assert all(lr.rank == rank_for_sparsity(lr.in_features, lr.out_features, rho2) for lr in rep1.layers)
    remaining_half_steps = sum(_in_plus_out(model)) / 2
    assert abs(rep0.params_after - rep0.params_requested) <= half_steps
    assert abs(rep1.params_after - rep1.params_requested) <= remaining_half_steps
    assert abs(rep1.params_after - rep0.params_after) <= half_steps + remaining_half_steps
    assert (rep0.params_after, rep1.params_after) == (27168, 26752)  # requested 26,912


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dropped_block_proxy_saves_and_reloads(arch, tmp_path):
    batches = _batches()
    model = _model(arch)
    rep = compress_model(model, batches, RHO, drop_blocks=1, **KW)
    path = save_proxy(model, None, tmp_path / "proxy", rep)
    man = json.loads((path / PROXY_MANIFEST).read_text())
    assert man["compression"]["drop_blocks"] == 1
    assert man["block_drop"]["dropped"] == rep.block_drop.dropped and man["block_drop"]["kept"] == rep.block_drop.kept
    assert man["block_drop"]["importance"] == rep.block_drop.importance and len(man["block_drop"]["importance"]) == 4
    assert man["params_after"] == rep.params_after
    loaded, _ = load_proxy(path)
    assert loaded.config.num_hidden_layers == 3
    assert count_parameters(loaded) == rep.params_after
    assert {n: m.rank for n, m in lowrank_layers(loaded).items()} == {n: m.rank for n, m in lowrank_layers(model).items()}
    b = make_batches(n_examples=3, batch_size=3, seed=7)[0]
    model.eval()
    with torch.no_grad():
        out1 = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        out2 = loaded(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.equal(out1, out2)
    # a manifest whose recorded drop disagrees with config.json is refused
    man["block_drop"]["num_blocks_before"] = 5
    (path / PROXY_MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ProxyFormatError, match=r"blocks \[\d\] of 5 were dropped.*4 decoder blocks.*num_hidden_layers=3"):
        load_proxy(path)


def test_drop_blocks_errors_name_the_numbers_and_leave_the_model_alone():
    batches = _batches()
    with pytest.raises(ValueError, match="drop_blocks must be an integer >= 0"):
        CompressionConfig(drop_blocks=-1)
    with pytest.raises(ValueError, match="drop_blocks must be an integer >= 0"):
        IPSVDCallback(drop_blocks=-1)
    model = _model()
    with pytest.raises(ValueError, match=r"drop_blocks=4 must be below the model's number of decoder blocks \(4\)"):
        compress_model(model, batches, RHO, drop_blocks=4, **KW)
    # 4 -> 2 blocks at ρ = 0.5: 26,912 requested, 8,352 elsewhere, 18,560 left for layers holding 18,432 dense
    with pytest.raises(ValueError, match=r"drop_blocks=2, sparsity 0.5: the whole model may hold 26,912 parameters; "
                                         r"after removing 2 of 4 blocks .* holds 8,352, which leaves 18,560 weights "
                                         r"for layers that hold only 18,432 dense"):
        compress_model(model, batches, RHO, drop_blocks=2, **KW)
    assert model.config.num_hidden_layers == 4 and not is_compressed(model)  # refused before the cut
    with pytest.raises(ValueError, match=r"drop_blocks=1, sparsity 0.99, remaining layers: budget .* below the minimum"):
        compress_model(model, batches, 0.99, drop_blocks=1, **KW)
    with pytest.raises(ValueError, match=r"drop_blocks=1, sparsity 0.99, remaining layers: budget .* below the smallest"):
        compress_model(model, batches, 0.99, allocation="uniform", drop_blocks=1, **KW)
    assert model.config.num_hidden_layers == 4 and not is_compressed(model)
    probes = collect_probes(model, batches, num_tokens=N_TOKENS, progress=False)
    with pytest.raises(ValueError, match="precollected probes"):
        compress_model(model, batches, RHO, drop_blocks=1, probes=probes, **KW)
    with pytest.raises(ValueError, match="needs the probe batches"):
        compress_model(model, None, RHO, method="svd", drop_blocks=1, **KW)


def test_callback_drop_blocks_option_and_alignment_guard(tmp_path):
    import lightning.pytorch as pl

    cb = IPSVDCallback(sparsity=0.7, drop_blocks=1, num_probe_tokens=N_TOKENS, allocation="uniform",
                       save_dir=str(tmp_path / "proxy"))
    assert cb.config.drop_blocks == 1

    class Module(pl.LightningModule):  # a TeacherHolder (compression.callback): teacher + aligns
        def __init__(self, teacher=None, align=None):
            super().__init__()
            self.proxy = tiny_causal_lm("llama", seed=0)  # 2 blocks
            self.teacher = teacher
            self.aligns = bool(align)

        def probe_dataloader(self):
            return _batches()

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    aligning = Module(teacher=tiny_causal_lm("llama", seed=0), align=True)
    with pytest.raises(ValueError, match=r"drop_blocks=1.*aligns the proxy with the target layer by layer path"):
        cb.setup(trainer, aligning, "fit")
    assert not is_compressed(aligning.proxy)
    module = Module(teacher=tiny_causal_lm("llama", seed=0), align=False)  # the IPSVD-only proxy
    cb.setup(trainer, module, "fit")
    assert module.proxy.config.num_hidden_layers == 1 and len(cb.report.block_drop.dropped) == 1
    assert load_proxy(tmp_path / "proxy")[0].config.num_hidden_layers == 1


def test_align_module_refuses_a_loaded_proxy_with_dropped_blocks(tmp_path):
    """A saved dropped-block proxy given to ProxyAlignModule(proxy=dir) skips the callback's guard; the module's own
    check refuses to align it (layers would be paired with the wrong target block), and align=False loads it."""
    from iprox_lightning.modules import ProxyAlignModule

    teacher = tiny_causal_lm("llama", seed=0)
    proxy = tiny_causal_lm("llama", seed=0)
    compress_model(proxy, _batches(), sparsity=0.7, drop_blocks=1, num_probe_tokens=N_TOKENS, allocation="uniform")
    save_proxy(proxy, None, tmp_path / "proxy")
    module = ProxyAlignModule(target=teacher, proxy=str(tmp_path / "proxy"))
    with pytest.raises(ValueError, match=r"has 1 decoder blocks and the target 2"):
        module.configure_model()
    kept = ProxyAlignModule(target=teacher, proxy=str(tmp_path / "proxy"), align=False)
    kept.configure_model()
    assert kept.proxy.config.num_hidden_layers == 1
