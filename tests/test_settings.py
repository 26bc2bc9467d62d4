"""Settings declared once (iprox_lightning/settings.py): every class and function that takes a stage's config
dataclass offers exactly its fields, with its defaults, as flat keywords (Python, YAML, command line), builds the same
config from them, documents each field with the dataclass's text, and keeps the flat hyper-parameters."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
from jsonargparse import ArgumentParser

from iprox_lightning.callbacks import IPSVDCallback
from iprox_lightning.compression.apply import CompressionConfig, compress_model
from iprox_lightning.errors import UserInputError
from iprox_lightning.alignment.module import AlignConfig, ProxyAlignModule
from iprox_lightning.scoring.influence import ScoringConfig
from iprox_lightning.scoring.module import InfluenceScoringModule
from iprox_lightning.engine.settings import field_docs, takes_settings

CONSUMERS = [(IPSVDCallback, CompressionConfig, "compression"), (compress_model, CompressionConfig, "compression"),
             (ProxyAlignModule, AlignConfig, "alignment"), (InfluenceScoringModule, ScoringConfig, "scoring")]
# one non-default value per field, each valid alone
CHANGED = {CompressionConfig: {"sparsity": 0.3, "method": "svd", "damping": 1e-2, "keep_dense": ["a"], "seed": 7},
           AlignConfig: {"lr": 1e-4, "kl_weight": 0.0, "layers": ["model.layers.0.mlp.up_proj"], "keep_best": False},
           ScoringConfig: {"method": "kfac", "normalize": False, "target_patterns": ["q_proj"], "kfac_examples": 8}}


def _built(consumer, param, **kw):
    """The config a consumer builds from ``kw`` (``compress_model``: the one it hands to ``compress``)."""
    if inspect.isclass(consumer):
        return consumer(**kw).config
    import iprox_lightning.compression.apply as c

    seen, orig = {}, c.compress
    c.compress = lambda model, loader, config, **_: seen.setdefault("config", config)
    try:
        consumer(None, None, **kw)
    finally:
        c.compress = orig
    return seen["config"]


@pytest.mark.parametrize("consumer,config_cls,param", CONSUMERS)
def test_signature_is_the_config_fields_with_their_defaults(consumer, config_cls, param):
    params = inspect.signature(consumer).parameters
    for f in dataclasses.fields(config_cls):
        assert f.name in params, f"{consumer.__qualname__} lacks {f.name}"
        assert params[f.name].default == f.default
    assert param not in params  # the whole config is a Python-only way in: one spelling per setting in the CLI
    docs = field_docs(config_cls)
    assert set(docs) == {f.name for f in dataclasses.fields(config_cls)}  # every field documented, once
    init_doc = (consumer.__init__ if inspect.isclass(consumer) else consumer).__doc__
    for name, text in docs.items():
        assert f"    {name}: {text}" in init_doc


@pytest.mark.parametrize("consumer,config_cls,param", CONSUMERS)
def test_keywords_and_the_whole_config_build_the_same_config(consumer, config_cls, param):
    kw = CHANGED[config_cls]
    assert _built(consumer, param) == config_cls()
    assert _built(consumer, param, **kw) == config_cls(**kw)
    assert _built(consumer, param, **{param: config_cls(**kw)}) == config_cls(**kw)
    assert _built(consumer, param, **{param: dict(kw)}) == config_cls(**kw)
    owner = consumer.__qualname__.removesuffix(".__init__")
    first = next(iter(kw))
    with pytest.raises(UserInputError, match=f"{owner}: give the settings either as {param}="):
        _built(consumer, param, **{param: config_cls(), first: kw[first]})
    with pytest.raises(TypeError, match=f"{owner}: got an unexpected keyword argument 'no_such_setting'"):
        _built(consumer, param, no_such_setting=1)


def test_a_bad_value_is_a_user_error_named_by_its_owner():
    with pytest.raises(UserInputError, match=r"^IPSVDCallback: method must be one of"):
        IPSVDCallback(method="bogus")
    with pytest.raises(UserInputError, match=r"^ProxyAlignModule: kl_weight must be >= 0"):
        ProxyAlignModule(kl_weight=-1.0)
    with pytest.raises(UserInputError, match=r"^InfluenceScoringModule: feature_mode must be one of"):
        InfluenceScoringModule(feature_mode="nope")


def test_sparsity_stays_positional_where_it_was():
    assert IPSVDCallback(0.25).config.sparsity == 0.25
    assert _built(compress_model, "compression", sparsity=0.25).sparsity == 0.25
    with pytest.raises(TypeError):
        IPSVDCallback(0.25, "svd")  # method was never meant by position: keyword only


def test_yaml_and_command_line_keep_the_flat_keys():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(IPSVDCallback, "cb")
    parser.add_class_arguments(ProxyAlignModule, "model")
    cfg = parser.parse_args(["--cb.sparsity", "0.3", "--cb.keep_dense", '["a"]', "--cb.save_dir", "x",
                             "--model.lr", "1e-4", "--model.layers", '["p"]', "--model.save_dir", "y"])
    init = parser.instantiate(cfg)
    assert init.cb.config == CompressionConfig(sparsity=0.3, keep_dense=("a",)) and init.cb.save_dir == "x"
    assert init.model.config == AlignConfig(lr=1e-4, layers=("p",)) and init.model.hparams.save_dir == "y"


def test_hyperparameters_stay_flat():
    m = ProxyAlignModule(target="builtin", lr=1e-3, layers=["p"], save_dir="s")
    expected = {"target": "builtin", "proxy": None, "save_dir": "s", "dtype": "float32", "log_layer_cosines": True,
                **dataclasses.asdict(AlignConfig(lr=1e-3, layers=("p",)))}
    expected["layers"] = ["p"]
    assert dict(m.hparams) == expected
    s = InfluenceScoringModule("builtin", method="kfac", factors_dir="f")
    assert dict(s.hparams) == {"model": "builtin", **ScoringConfig(method="kfac").to_dict(), "kfac_split": "pool",
                               "factors_dir": "f", "dtype": "float32", "attn_implementation": "sdpa",
                               "gguf_file": None, "trust_remote_code": False}


def test_a_callable_declaring_a_field_itself_is_refused():
    with pytest.raises(TypeError, match=r"declares \['sparsity'\] itself"):
        @takes_settings(CompressionConfig, "compression")
        def f(sparsity: float = 0.5, compression=None):
            return compression
    with pytest.raises(TypeError, match="has no parameter 'compression'"):
        @takes_settings(CompressionConfig, "compression")
        def g(x=1):
            return x
