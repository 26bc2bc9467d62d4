"""CompressionConfig (Stage 1), AlignConfig (Stage 2) and ScoringConfig (Stage 3): frozen, checked when built, the
same settings whichever front end builds them (keyword function, callback, module), and the keyword form gives the
same proxy / scores."""
import dataclasses
import inspect

import pytest
import torch

from iprox_lightning.callbacks import IPSVDCallback
from iprox_lightning.compression.apply import CompressionConfig, compress, compress_model, lowrank_layers
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.modules import ProxyAlignModule
from iprox_lightning.alignment.module import AlignConfig
from iprox_lightning.scoring import InfluenceScoringModule
from iprox_lightning.scoring.influence import ScoringConfig
from iprox_lightning.scoring.metrics import KFAC, TracIn


def test_compression_config_is_frozen_and_freezes_lists():
    cfg = CompressionConfig(sparsity=0.3, targets=["q_proj", "v_proj"], keep_dense=[r"layers\.0\."])
    assert cfg.targets == ("q_proj", "v_proj") and cfg.keep_dense == (r"layers\.0\.",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sparsity = 0.5
    assert CompressionConfig().resolved_allocation == "global"  # exact IPSVD
    assert CompressionConfig(method="svd").resolved_allocation == "uniform"


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "pca"}, "method must be one of"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"damping_mode": "scaled"}, "damping_mode must be one of"),
    ({"allocation": "greedy"}, "allocation must be one of"),
    ({"method": "random", "allocation": "global"}, "prices truncation with a spectrum"),
    ({"mode": "core", "allocation": "global"}, "exact weighted spectrum"),
])
def test_compression_config_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**kwargs)
    with pytest.raises(ValueError, match=message):  # the callback fails when it is built, not at fit time
        IPSVDCallback(**kwargs)


def test_callback_and_keyword_form_build_the_same_config():
    kw = dict(sparsity=0.7, method="svd", rank_multiple=2, seed=3, keep_dense=[r"\.o_proj$"])
    assert IPSVDCallback(**kw).config == CompressionConfig(**kw)
    fields = {f.name for f in dataclasses.fields(CompressionConfig)}
    callback_options = set(inspect.signature(IPSVDCallback).parameters)
    assert fields <= callback_options  # every compression setting is a callback option of the same name


def test_keyword_form_and_config_form_give_the_same_proxy():
    m1, m2 = tiny_causal_lm("llama", seed=1), tiny_causal_lm("llama", seed=1)
    r1 = compress_model(m1, None, 0.5, method="random", seed=5, progress=False)
    r2 = compress(m2, None, CompressionConfig(sparsity=0.5, method="random", seed=5), progress=False)
    assert r1.compression == r2.compression == CompressionConfig(sparsity=0.5, method="random", seed=5)
    assert r1.ranks == r2.ranks and r1.params_after == r2.params_after
    for (n1, a), (n2, b) in zip(lowrank_layers(m1).items(), lowrank_layers(m2).items()):
        assert n1 == n2 and torch.equal(a.A, b.A) and torch.equal(a.B, b.B)
    assert r1.to_dict()["compression"]["seed"] == 5


def test_align_config_is_what_the_module_uses():
    m = ProxyAlignModule(target="builtin", lr=1e-3, kl_weight=0.0, layers=["model.layers.0.self_attn.q_proj"],
                         lr_schedule="linear", warmup_ratio=0.05)
    assert m.config == AlignConfig(lr=1e-3, kl_weight=0.0, layers=("model.layers.0.self_attn.q_proj",),
                                   lr_schedule="linear", warmup_ratio=0.05)
    assert m.hparams.lr == 1e-3 and m.hparams.kl_weight == 0.0  # hyper-parameters (checkpoints) unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.config.lr = 1.0
    with pytest.raises(ValueError, match="kl_weight must be >= 0"):
        ProxyAlignModule(kl_weight=-1.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        AlignConfig(temperature=0.0)


def test_scoring_config_is_frozen_and_what_the_module_and_scorer_use():
    model = tiny_causal_lm("llama", seed=1)
    kw = dict(method="kfac", per_task=False, damping=1e-2, damping_mode="absolute", kfac_examples=8,
              feature_mode="ghost", target_patterns=["q_proj", "v_proj"])
    m = InfluenceScoringModule(model, **kw)
    assert m.config == ScoringConfig(**kw)
    assert m.config.target_patterns == ("q_proj", "v_proj")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.config.damping = 1.0
    assert isinstance(m.metric, KFAC) and (m.metric.damping, m.metric.damping_mode, m.metric.examples) == (1e-2, "absolute", 8)
    assert isinstance(InfluenceScoringModule(model).metric, TracIn)
    fields = {f.name for f in dataclasses.fields(ScoringConfig)}
    assert fields <= set(inspect.signature(InfluenceScoringModule).parameters)  # same names as the module's options
    # plain JSON values (lists, not tuples); K-FAC records its float32 sums (float64, as before the option: unrecorded)
    assert ScoringConfig(**kw).to_dict() == {**kw, "normalize": True, "kfac_dtype": "float32"}
    assert ScoringConfig(**kw, kfac_dtype="float64").to_dict() == {**kw, "normalize": True}


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "lissa"}, "method must be one of"),
    ({"damping_mode": "scaled"}, "damping_mode must be one of"),
    ({"kfac_examples": 0}, "kfac_examples must be >= 1"),
    ({"method": "kfac", "damping": 0.0}, "damping must be > 0"),
    ({"feature_mode": "fast"}, "feature_mode must be one of"),
])
def test_scoring_config_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScoringConfig(**kwargs)
    with pytest.raises(ValueError, match="InfluenceScoringModule: " + message):  # when the module is built
        InfluenceScoringModule("builtin", **kwargs)
