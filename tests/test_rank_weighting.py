"""Influence-weighted global rank allocation (``rank_weighting="influence"``): the layer weights against a brute-force
reference (per-example gradients by autograd, float64), the weighted allocation within budget and moving rank to the
layer that carries the score signal, the weights recorded in the plan / report / manifest, and nothing changed when
the option is off (or mixed away)."""
from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch

from iprox_lightning.engine.batch import per_example_loss
from iprox_lightning.compression.callback import IPSVDCallback
from iprox_lightning.compression.apply import CompressionConfig, compress, compress_model, lowrank_layers
from iprox_lightning.compression.plan import plan_compression, plan_global_ranks
from iprox_lightning.data import SFTDataModule
from iprox_lightning.compression.influence_weights import (
    RankWeights,
    influence_rank_weights,
    layer_shares,
    weights_from_shares,
)
from iprox_lightning.models.builtin import builtin_model
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.modules import ProxyAlignModule
from iprox_lightning.compression.probes import collect_probes
from iprox_lightning.compression.ranks import allocate_ranks, plan_weights
from iprox_lightning.engine.target_layers import find_target_linears, linear_shape

from test_probes import make_batches

pytestmark = pytest.mark.usefixtures("one_thread")


def _tasks(batches, names=("mmlu", "bbh", "tydiqa")):
    """The batches with a ``task`` per row, cycling over ``names``."""
    out, k = [], 0
    for b in batches:
        n = b["input_ids"].shape[0]
        out.append({**b, "task": [names[(k + j) % len(names)] for j in range(n)]})
        k += n
    return out


def _example_grads(model, batches, modules):
    """Brute force: per example (its own row, a batch of one), the gradient of its loss L(z) w.r.t. every targeted
    weight by autograd, ``[out, in]`` each; the example's task. The row keeps its right padding: under
    ATEN_CPU_CAPABILITY=avx2 a padded and an unpadded float64 forward differ by up to 2e-7 relative in the tiny random
    model's k_proj gradients (they are a small difference of large terms); with the same padding, 1e-15."""
    names = list(modules)
    out = []
    for b in batches:
        for r in range(b["input_ids"].shape[0]):
            ids, mask, labels = (b[k][r : r + 1] for k in ("input_ids", "attention_mask", "labels"))
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = per_example_loss(logits, labels)[0].sum()
            grads = torch.autograd.grad(loss, [modules[m].weight for m in names], allow_unused=True)
            out.append(({m: (g if g is not None else torch.zeros_like(modules[m].weight)) for m, g in zip(names, grads)},
                        b["task"][r] if "task" in b else "all"))
    return out


def brute_force_weights(model, modules, validation, probes, mix=1.0):
    """The docstring's definitions, term by term, from materialised per-example gradients."""
    names = list(modules)
    val = _example_grads(model, validation, modules)
    tasks = sorted({t for _, t in val})
    v = {t: {m: sum(g[m] for g, tt in val if tt == t) / sum(tt == t for _, tt in val) for m in names} for t in tasks}
    probe = [g for g, _ in _example_grads(model, probes, modules)]
    rows = []  # c[i, T, ℓ]
    for g in probe:
        norm = torch.sqrt(sum((g[m] ** 2).sum() for m in names))
        if norm == 0:
            continue
        rows.append([[float((g[m] * v[t][m]).sum() / norm) for m in names] for t in tasks])
    c = np.array(rows)  # [N, K, L]
    var = c.var(axis=0)  # [K, L]
    shares = var / var.sum(axis=1, keepdims=True)
    top = shares.max(axis=0)
    w = (1 - mix) + mix * top / top.mean()
    return tasks, shares, w, len(rows)


# ------------------------------------------------------------------------------------------------ the weights
@pytest.mark.parametrize("mix", [1.0, 0.4])
def test_influence_weights_equal_brute_force(mix):
    model = tiny_causal_lm("llama", seed=3).double()
    modules = find_target_linears(model)
    validation = _tasks(make_batches(n_examples=9, batch_size=4, seed=11))
    probes = make_batches(n_examples=7, batch_size=3, seed=12)
    rw = influence_rank_weights(model, modules, validation, probes, mix=mix, progress=False)
    tasks, shares, w, n = brute_force_weights(model, modules, validation, probes, mix)
    assert rw.tasks == tasks == ["bbh", "mmlu", "tydiqa"] and rw.probe_examples == n == 7
    assert rw.validation_examples == {"bbh": 3, "mmlu": 3, "tydiqa": 3} and rw.mix == mix
    names = list(modules)
    got_shares = np.array([[rw.shares[t][m] for m in names] for t in tasks])
    np.testing.assert_allclose(got_shares, shares, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose([rw.weights[m] for m in names], w, rtol=1e-9, atol=1e-12)
    assert np.allclose(got_shares.sum(axis=1), 1.0) and np.mean(list(rw.weights.values())) == pytest.approx(1.0)
    assert all(p.grad is None for p in model.parameters()) and not model.training  # no .grad, mode restored


def test_weights_math_on_a_constructed_case():
    # 4 examples, 3 layers, 2 tasks: task 0's parts vary only in layer 2, task 1's equally in layers 0 and 1
    dots = np.zeros((4, 3, 2))
    dots[:, 2, 0] = [1.0, -1.0, 2.0, -2.0]
    dots[:, 0, 1] = dots[:, 1, 1] = [1.0, 3.0, 1.0, 3.0]
    dots[:, 0, 0] = 5.0  # a constant part moves no example past another: no share
    sq = np.ones((4, 3)) / 3.0  # ‖g(z_i)‖ = 1
    shares = layer_shares(dots, sq)
    np.testing.assert_allclose(shares, [[0, 0, 1], [0.5, 0.5, 0]])
    np.testing.assert_allclose(weights_from_shares(shares), [0.75, 0.75, 1.5])  # max over tasks, mean 1
    np.testing.assert_allclose(weights_from_shares(shares, mix=0.5), [0.875, 0.875, 1.25])
    np.testing.assert_allclose(weights_from_shares(shares, mix=0.0), [1, 1, 1])
    # an example with a zero gradient is left out (not counted as a point at 0)
    sq0 = np.vstack([sq, np.zeros((1, 3))])
    np.testing.assert_allclose(layer_shares(np.concatenate([dots, np.full((1, 3, 2), 9.0)]), sq0), shares)
    with pytest.raises(ValueError, match="at least 2 probe examples"):
        layer_shares(dots[:1], sq[:1])
    with pytest.raises(ValueError, match="no task's score varies"):
        weights_from_shares(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="rank_weight_mix"):
        weights_from_shares(shares, mix=1.5)


# ------------------------------------------------------------------------------------------------ the allocation
def test_weighted_greedy_gives_the_weighted_layer_more_rank_within_budget():
    shapes = {"a": (16, 16), "b": (16, 16), "c": (16, 16)}
    s = torch.tensor([4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.2, 0.1] + [0.05] * 8, dtype=torch.float64)
    spectra = {n: s for n in shapes}
    budget = 3 * 3 * 32 + 1.0
    plain = allocate_ranks(spectra, shapes, budget)
    assert plain == {"a": 3, "b": 3, "c": 3}
    weighted = allocate_ranks(spectra, shapes, budget, weights={"a": 4.0, "b": 1.0, "c": 1.0})
    assert weighted["a"] > plain["a"] and plan_weights(weighted, shapes) <= budget
    assert allocate_ranks(spectra, shapes, budget, weights={"a": 1.0, "b": 1.0, "c": 1.0}) == plain
    with pytest.raises(ValueError, match="finite and >= 0"):
        allocate_ranks(spectra, shapes, budget, weights={"a": -1.0})


def test_the_layer_that_carries_the_score_signal_gets_more_rank():
    """Constructed: the influence weights say one layer carries (nearly) all of the score signal; the weighted global
    plan gives it more rank than the unweighted one, at the same budget, and records the weights."""
    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    model = tiny_causal_lm("llama", seed=0, num_layers=2)
    config = CompressionConfig(sparsity=0.6, num_probe_tokens=24, allocation="global")
    plan = plan_compression(model, config, progress=False)
    modules = find_target_linears(model)
    probes = collect_probes(model, batches, modules, num_tokens=24, progress=False)
    plain = plan_global_ranks(plan, modules, config, probes, progress=False)
    hot = "model.layers.1.mlp.up_proj"
    assert plain.ranks[hot] is not None
    rw = RankWeights(weights={n: (20.0 if n == hot else 0.05) for n in modules}, shares={}, tasks=["t"], mix=1.0)
    weighted = plan_global_ranks(plan, modules, config, probes, progress=False, weights=rw)
    assert weighted.ranks[hot] is None or weighted.ranks[hot] > plain.ranks[hot]
    budget = sum((1 - config.sparsity) * o * i for o, i in plan.shapes.values())
    assert plan_weights(weighted.ranks, plan.shapes) <= budget and plan_weights(plain.ranks, plan.shapes) <= budget
    assert weighted.rank_weighting is rw and json.loads(json.dumps(weighted.to_dict()))["rank_weighting"]["weights"][hot] == 20.0
    assert "rank_weighting" not in plain.to_dict()


def test_compress_with_influence_weighting_records_the_weights(tmp_path):
    probes = make_batches(n_examples=6, batch_size=3, seed=1)
    validation = _tasks(make_batches(n_examples=6, batch_size=3, seed=7), ("x", "y"))
    config = CompressionConfig(sparsity=0.5, num_probe_tokens=24, allocation="global", rank_weighting="influence")
    model, ref = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=0)
    expected = influence_rank_weights(ref, find_target_linears(ref), validation, probes, progress=False)
    with pytest.raises(RuntimeError, match="no output-gradient reached"):  # another model's layers
        influence_rank_weights(ref, find_target_linears(model), validation, probes, progress=False)
    rep = compress(model, iter(probes), config, val_dataloader=validation, progress=False)  # a one-shot iterator
    assert rep.rank_weighting.weights == expected.weights and rep.rank_weighting.tasks == ["x", "y"]
    budget = rep.params_requested - (rep.params_before - rep.target_params_before)
    assert rep.target_params_after <= budget + 1e-6
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["rank_weighting"]["weights"] == pytest.approx(expected.weights)
    assert d["compression"]["rank_weighting"] == "influence" and "block_drop" not in d
    # the manifest records them
    from iprox_lightning.compression.apply import save_proxy

    save_proxy(model, None, tmp_path / "p", rep)
    man = json.loads((tmp_path / "p" / "iprox_proxy.json").read_text())
    assert man["rank_weighting"]["weights"] == pytest.approx(expected.weights)
    assert set(man["rank_weighting"]["shares"]) == {"x", "y"}
    # mix 0: exactly the unweighted plan and factors
    m0, m1 = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=0)
    r0 = compress_model(m0, probes, 0.5, num_probe_tokens=24, allocation="global", rank_weighting="influence",
                        rank_weight_mix=0.0, val_dataloader=validation, progress=False)
    r1 = compress_model(m1, probes, 0.5, num_probe_tokens=24, allocation="global", progress=False)
    assert r0.ranks == r1.ranks and "rank_weighting" not in r1.to_dict()
    assert set(r0.rank_weighting.weights.values()) == {1.0}
    for (n0, a), (n1, b) in zip(lowrank_layers(m0).items(), lowrank_layers(m1).items()):
        assert n0 == n1 and torch.equal(a.A, b.A) and torch.equal(a.B, b.B)


def test_influence_weighting_refusals():
    with pytest.raises(ValueError, match="allocation='global'"):
        CompressionConfig(allocation="uniform", rank_weighting="influence")
    with pytest.raises(ValueError, match="rank_weighting must be one of"):
        CompressionConfig(rank_weighting="tracin")
    with pytest.raises(ValueError, match="rank_weight_mix"):
        IPSVDCallback(rank_weighting="influence", rank_weight_mix=2.0)
    with pytest.raises(ValueError, match="needs the probe batches and a val_dataloader"):
        compress_model(tiny_causal_lm("llama", seed=0), make_batches(), 0.5, allocation="global",
                       rank_weighting="influence", progress=False)


def test_ipsvd_callback_takes_the_validation_set_of_the_datamodule(tmp_path):
    """From a YAML-style setup: IPSVDCallback(rank_weighting="influence") reads the SFTDataModule's validation sets
    (one task per built-in family) and the probe split; the saved proxy's manifest records the weights."""
    dm = SFTDataModule(builtin_size=200, val_per_task=2, seed=1, construction_fraction=0.1, probe_fraction=0.3,
                       max_length=40, batch_size=4, eval_batch_size=8, train_split="align")
    cb = IPSVDCallback(sparsity=0.5, num_probe_tokens=32, allocation="global", rank_weighting="influence",
                       health_batches=0)
    module = ProxyAlignModule(target=builtin_model(0), align=False, save_dir=str(tmp_path / "proxy"))
    L.Trainer(accelerator="cpu", max_epochs=1, limit_val_batches=0, callbacks=[cb], logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(module, datamodule=dm)
    rw = cb.report.rank_weighting
    assert rw.tasks == sorted(set(dm.validation_tasks)) and len(rw.tasks) > 1
    assert sum(rw.validation_examples.values()) == len(dm.ids("validation"))
    man = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())
    assert man["rank_weighting"]["weights"] == pytest.approx(rw.weights)
    assert man["compression"]["rank_weighting"] == "influence"
    # the same weights as the plain function on the same data and (uncompressed) target
    target = builtin_model(0)
    again = influence_rank_weights(target, find_target_linears(target), dm.val_dataloader(), dm.probe_dataloader(),
                                   progress=False)
    assert again.weights == pytest.approx(rw.weights, rel=1e-6)
    n_budget = sum((1 - 0.5) * o * i for o, i in (linear_shape(m) for m in find_target_linears(target).values()))
    assert cb.report.target_params_after <= n_budget + 1e-6 and lowrank_layers(module.proxy)


def test_issue22_keys_are_documented_in_build_proxy_yaml_and_validate(tmp_path, capsys):
    """Every new key is in configs/build_proxy.yaml's comments (defaults off), and set from a YAML overlay the CLI
    accepts it (``--print_config`` validates against the signatures)."""
    from pathlib import Path

    import yaml

    from iprox_lightning.cli import main

    shipped = Path(__file__).resolve().parents[1] / "configs" / "build_proxy.yaml"
    text = shipped.read_text()
    for key, default in (("rank_rounding", "nearest"), ("probe_labels", "response"), ("rank_weighting", "none"),
                         ("rank_weight_mix", "1.0"), ("fidelity_per_task", "false")):
        assert f"# {key}: {default}" in text
    cfg = yaml.safe_load(text)
    assert not set(cfg["trainer"]["callbacks"][0]["init_args"]) & {"rank_rounding", "probe_labels", "rank_weighting"}
    overlay = tmp_path / "levers.yaml"
    overlay.write_text(yaml.safe_dump({
        "trainer": {"callbacks": [{"class_path": "iprox_lightning.callbacks.IPSVDCallback", "init_args": {
            "allocation": "global", "rank_weighting": "influence", "rank_weight_mix": 0.5, "probe_labels": "all",
            "rank_multiple": 128, "rank_rounding": "up"}}]},
        "model": {"init_args": {"fidelity_examples": 64, "fidelity_per_task": True, "monitor": "val/fidelity_worst_loss",
                                "kl_weight": 0.0}}}))
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(shipped), "--config", str(overlay), "--print_config"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None), out
    printed = yaml.safe_load(out)
    cb = printed["trainer"]["callbacks"][0]["init_args"]
    assert (cb["rank_weighting"], cb["rank_rounding"], cb["probe_labels"]) == ("influence", "up", "all")
    assert printed["model"]["init_args"]["fidelity_per_task"] is True
