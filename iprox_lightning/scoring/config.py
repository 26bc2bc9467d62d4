"""The scoring settings, declared once: :class:`ScoringConfig` (every field's name, type, default, check and
documentation), which every scoring entry point takes (``InfluenceScoringModule``, ``GradientStoreModule``,
``build_store``, ``query``, ``influence_scores``, ``check``, ``plan``) and builds its metric from
(:meth:`ScoringConfig.build_metric`, the metric registry of :mod:`.metrics`).

This module imports neither torch nor the metrics at import time: the commands' signatures (their ``--help``) read it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..engine.damping import check_damping
from ..errors import UserInputError

if TYPE_CHECKING:
    from .metrics import InfluenceMetric

# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoringConfig:
    """The settings of influence scoring (how :class:`InfluenceScorer` scores), checked when built.

    ``InfluenceScoringModule`` builds it from its options (same names) and keeps it as ``module.config``; it is
    passed unchanged to :class:`InfluenceScorer` and written verbatim into the ``"scoring"`` block of the score
    table's ``settings.json`` (:mod:`iprox_lightning.io.scores`). :func:`influence_scores` builds it from its
    keyword arguments.

    Args:
        method: the influence metric by name: ``"tracin"`` (cosine of gradients), ``"kfac"`` (cosine in the
            K-FAC metric), ``"ekfac"`` (eigenvalue-corrected K-FAC) or any registered
            :class:`~.metrics.InfluenceMetric`.
        normalize: cosine scores (paper); ``False`` gives plain inner products.
        per_task: also score against each validation task (LESS max aggregation in ``score_max``).
        damping: K-FAC damping of the factors (the project's damping rule, :mod:`iprox_lightning.engine.damping`).
        damping_mode: ``"relative"`` (``λ = damping·trace(C)/dim``) or ``"absolute"`` (``λ = damping``).
        kfac_examples: training examples the K-FAC factors are estimated on (paper: 1024).
        feature_mode: ``"auto"`` | ``"ghost"`` | ``"materialize"`` per-layer feature computation (identical numbers).
        target_patterns: regexes of the tracked linears, each matched against the leaf name and every dotted tail
            of the module path (PEFT adapters: ``lora_[AB]\\.default``; default: attention + MLP projections).
        loss_reduction: the per-example loss ``L(z)`` over the example's response tokens: ``"mean"`` cross-entropy
            (default) or ``"sum"`` (kronfluence's, bergson's); for the scored, validation and factor gradients alike.
        fisher: the curvature (K-FAC / EK-FAC factors) from the examples' labels, ``"empirical"`` (default), or from
            next tokens sampled from the model, ``"sampled"`` (kronfluence's default; the factor passes only).
        damping_target: K-FAC damps each factor, ``"factors"`` (default), or their Kronecker product,
            ``"product"`` (kronfluence's); EK-FAC always damps its eigenvalue matrix as a whole.
            ``docs/GUIDE.md``, "To match kronfluence / bergson / LESS", has the settings of each peer.
        kfac_dtype: the K-FAC / EK-FAC factor sums and stored eigenvectors, ``"float32"`` (default, kronfluence's)
            or ``"float64"`` (a float64 model's are float64 either way); each eigendecomposition runs in float64, one
            layer at a time. Recorded in the factors' fingerprint.
        kfac_partitions: fit the K-FAC / EK-FAC factors in this many passes over the factor data, one group of the
            tracked layers per pass (balanced by factor size), so only one group's sums are held (default 1: all in
            one pass; identical numbers either way).
        kfac_offload: keep the fitted K-FAC / EK-FAC factors in host memory and copy each layer's to the device when
            it is applied (default ``False``: on the device; identical numbers).
        options: the chosen metric's own options (``{name: value}``, the names its class declares in ``options``);
            ``None``: its defaults.
        validation_gradients: how the per-column (task / subtask) validation gradients ``V: [K, out, in]`` per
            tracked weight are held while the pool is scored, ``{dtype, device, column_groups}`` (``None``: the
            defaults, today's holding): ``dtype`` ``"float32"`` (the scoring precision: float64 for a float64 model)
            or ``"bfloat16"`` (half the bytes; each layer's are widened to the scoring precision when used);
            ``device`` ``"same"`` (the model's) or ``"cpu"`` (host memory: each layer's moved to the model's device
            while a batch is scored, the sums accumulated on the host too); ``column_groups`` ``N`` (>= 1): the
            columns split into ``N`` groups, one group's validation gradients held at a time, each scored in its own
            pass over the validation set and the pool (``N`` times the scoring work, ``1/N`` of the bytes; at most one
            group per column). ``train.py plan`` counts the holding (:mod:`iprox_lightning.analysis.memory`).
        shard_layers: under several processes, each rank holds the K-FAC / EK-FAC factors and validation gradients of
            its largest-first share of the tracked weights only; each weight's pairs ``(h, δ)`` go to its owner
            (:mod:`.layer_shards`). Same scores up to the order of the sums (default ``False``). Not with
            ``factors_dir``.
    """

    method: str = "tracin"
    normalize: bool = True
    per_task: bool = True
    damping: float = 1e-3
    damping_mode: str = "relative"
    kfac_examples: int = 1024
    feature_mode: str = "auto"
    target_patterns: Optional[tuple[str, ...]] = None
    loss_reduction: str = "mean"
    fisher: str = "empirical"
    damping_target: str = "factors"
    kfac_dtype: str = "float32"
    kfac_partitions: int = 1
    kfac_offload: bool = False
    options: Optional[dict[str, Any]] = None
    validation_gradients: Optional[dict[str, Any]] = None
    shard_layers: bool = False

    def __post_init__(self) -> None:
        """Every field's check (whatever the method, so a config is valid or not independently of ``method``)."""
        # the metric registry, the feature modes and the losses live beside torch: read when a config is built,
        # never by a command's --help (which reads this module for the commands' signatures)
        from ..engine.batch import check_loss_reduction  # lazy: --help
        from .features import FEATURE_MODES  # lazy: --help
        from .metrics import metric_names  # lazy: --help

        if self.target_patterns is not None:  # a list from YAML / callers: frozen as a tuple
            object.__setattr__(self, "target_patterns", tuple(self.target_patterns))
        if self.feature_mode not in FEATURE_MODES:
            raise UserInputError(f"feature_mode must be one of {FEATURE_MODES}, got {self.feature_mode!r}")
        if self.method not in metric_registry():
            raise UserInputError(f"method must be one of {metric_names()}, got {self.method!r}")
        check_damping(self.damping, self.damping_mode)
        if self.kfac_examples < 1:
            raise UserInputError(f"kfac_examples must be >= 1, got {self.kfac_examples}")
        check_loss_reduction(self.loss_reduction)
        if self.kfac_dtype not in KFAC_DTYPES:
            raise UserInputError(f"kfac_dtype must be one of {KFAC_DTYPES}, got {self.kfac_dtype!r}")
        if isinstance(self.kfac_partitions, bool) or int(self.kfac_partitions) != self.kfac_partitions \
                or self.kfac_partitions < 1:
            raise UserInputError(f"kfac_partitions must be an integer >= 1, got {self.kfac_partitions!r}")
        if not isinstance(self.kfac_offload, bool):
            raise UserInputError(f"kfac_offload must be true or false, got {self.kfac_offload!r}")
        if not isinstance(self.shard_layers, bool):
            raise UserInputError(f"shard_layers must be true or false, got {self.shard_layers!r}")
        if self.fisher not in FISHERS:
            raise UserInputError(f"fisher must be one of {FISHERS}, got {self.fisher!r}")
        if self.damping_target not in DAMPING_TARGETS:
            raise UserInputError(f"damping_target must be one of {DAMPING_TARGETS}, got {self.damping_target!r}")
        object.__setattr__(self, "validation_gradients", check_validation_gradients(self.validation_gradients))
        own = metric_registry()[self.method].options
        unknown = sorted(set(self.options or {}) - set(own))
        if unknown:
            raise UserInputError(f"options {unknown} are not options of method {self.method!r} (its options: "
                                 f"{sorted(own) or 'none'})")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "ScoringConfig":
        """The config of recorded settings (a store's ``fingerprint.settings``, a score table's ``scoring``): the
        fields they hold, the rest at their defaults; the metric's own options from its recorded settings."""
        from .metrics import KFAC_DTYPE_UNRECORDED, InfluenceMetric  # lazy: --help (torch)

        kw = {f.name: settings[f.name] for f in fields(cls) if f.name in settings and f.name != "options"}
        metric = InfluenceMetric.registry.get(kw.get("method", cls.method))
        if metric is not None and "kfac_dtype" in metric.uses and "kfac_dtype" not in settings:
            kw["kfac_dtype"] = KFAC_DTYPE_UNRECORDED  # recorded before the option, or asked for: float64
        own = {k: settings[k] for k in (metric.options if metric is not None else ()) if k in settings}
        return cls(**kw, options=own or None)

    def build_metric(self) -> "InfluenceMetric":
        """A new :class:`~.metrics.InfluenceMetric` named by ``method``, built from this config (the registry's
        class, :meth:`~.metrics.InfluenceMetric.from_config`)."""
        from .metrics import InfluenceMetric  # lazy: --help (torch)

        return InfluenceMetric.registry[self.method].from_config(self)

    def to_dict(self) -> dict:
        """The settings as plain JSON values (``target_patterns`` a list); the loss and curvature conventions and
        the metric's own options only when they differ from the defaults (the fingerprints of runs with the
        defaults are as before the options)."""
        d = asdict(self)
        if d["target_patterns"] is not None:
            d["target_patterns"] = list(d["target_patterns"])
        for name in (*CONVENTIONS, "kfac_partitions", "kfac_offload", "options", "validation_gradients",
                     "shard_layers"):
            if d[name] == getattr(ScoringConfig, name):
                del d[name]
        from .metrics import KFAC_DTYPE_UNRECORDED  # lazy: --help

        if d["kfac_dtype"] == KFAC_DTYPE_UNRECORDED or "kfac_dtype" not in self.metric_class().uses:
            del d["kfac_dtype"]
        return d

    def metric_class(self) -> type:
        """The registry's :class:`~.metrics.InfluenceMetric` class named by ``method``."""
        from .metrics import InfluenceMetric  # lazy: --help (torch)

        return InfluenceMetric.registry[self.method]


VALIDATION_GRADIENTS = {"dtype": ("float32", "bfloat16"), "device": ("same", "cpu"), "column_groups": None}
"""The keys of :attr:`ScoringConfig.validation_gradients` and their choices (``None``: an integer >= 1)."""
VALIDATION_DEFAULTS = {"dtype": "float32", "device": "same", "column_groups": 1}
"""Today's holding: float32 (the scoring precision) on the model's device, every column in one pass."""


def metric_registry() -> dict:
    """Every influence metric by name (``InfluenceMetric.registry``), whole: LESS's metric, which lives in its own
    module and registers when imported, is imported here first (what every reader of the registry calls)."""
    from . import less  # lazy: --help  # noqa: F401
    from .metrics import InfluenceMetric  # lazy: --help

    return InfluenceMetric.registry


def check_validation_gradients(value: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """``validation_gradients`` checked and completed with the defaults (:data:`VALIDATION_DEFAULTS`); ``None`` when
    it holds only the defaults (so the settings and fingerprints of runs with the defaults are as before it)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise UserInputError(f"validation_gradients must be a mapping like {VALIDATION_DEFAULTS}, got {value!r}")
    unknown = sorted(set(value) - set(VALIDATION_GRADIENTS))
    if unknown:
        raise UserInputError(f"validation_gradients: unknown key(s) {unknown}; its keys: {sorted(VALIDATION_GRADIENTS)}")
    out = {**VALIDATION_DEFAULTS, **value}
    for key, choices in VALIDATION_GRADIENTS.items():
        v = out[key]
        if choices is None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserInputError(f"validation_gradients.{key} must be an integer >= 1, got {v!r}")
        elif v not in choices:
            raise UserInputError(f"validation_gradients.{key} must be one of {choices}, got {v!r}")
    return None if out == VALIDATION_DEFAULTS else out


def validation_holding(config: "ScoringConfig") -> dict[str, Any]:
    """The validation-gradient holding of ``config`` with every key (the defaults where not given)."""
    return {**VALIDATION_DEFAULTS, **(config.validation_gradients or {})}


METRIC_FIELDS = ("method", "damping", "damping_mode", "kfac_examples", "loss_reduction", "fisher", "damping_target",
                 "kfac_dtype", "kfac_partitions", "kfac_offload", "options")
"""The :class:`ScoringConfig` fields that make the metric: what a gradient store and a check take
(``takes_settings(ScoringConfig, ..., fields=...)``), without the scoring loop's own (``normalize``, ``per_task``,
``feature_mode``)."""

CONVENTIONS = ("loss_reduction", "fisher", "damping_target")
"""The :class:`ScoringConfig` fields of the loss and curvature conventions (recorded only when not the default)."""

KFAC_SCALE = ("kfac_dtype", "kfac_partitions", "kfac_offload")
"""The :class:`ScoringConfig` fields of K-FAC at scale. ``kfac_partitions`` and ``kfac_offload`` (the same numbers
either way) are recorded only when not the default. ``kfac_dtype`` is recorded by a metric that uses it (K-FAC,
EK-FAC: the scoring config, the metric's settings, the factors' fingerprint) unless it is
:data:`~.metrics.KFAC_DTYPE_UNRECORDED`."""


KFAC_DTYPES = ("float32", "float64")
FISHERS = ("empirical", "sampled")
DAMPING_TARGETS = ("factors", "product")


STORE_FIELDS = (*METRIC_FIELDS, "target_patterns")
"""The :class:`ScoringConfig` fields a gradient store takes (``GradientStoreModule``, ``build_store``): the metric's
and the tracked layers; the scoring loop's own (``normalize``, ``per_task``, ``feature_mode``) belong to a query."""
