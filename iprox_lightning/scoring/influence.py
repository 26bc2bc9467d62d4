"""TracIn and K-FAC influence scores of training examples against a validation set.

Definitions (sign convention: **higher score = more useful for the validation set**)
-------------------------------------------------------------------------------------
* Tracked parameters: for a dense model, the weights of the targeted linear layers in the decoder
  blocks (``find_target_linears``: q/k/v/o, gate/up/down, fused qkv, GPT-2 ``Conv1D``; never
  embeddings, LM head, norms or biases); for a proxy, the ``A`` and ``B`` factors of every
  ``LowRankLinear`` plus any targeted linear left dense.
* Per-example loss ``L(z)``: mean token cross-entropy over the example's response tokens.
  Per-example gradient ``g(z)``: gradient of ``L(z)`` over the tracked parameters, one flat vector.
* Validation gradient of a task ``T``: ``ḡ_T = mean over validation examples z' of task T of g(z')``
  (examples without response tokens count, with ``g = 0``); ``ḡ`` = mean over all validation examples.
* **TracIn** (LESS's SGD variant, one checkpoint): ``score(z) = cos(g(z), ḡ)``; per task
  ``cos(g(z), ḡ_T)``, and LESS's aggregate ``max_T cos(g(z), ḡ_T)`` (``score_max``).
  Multi-checkpoint TracIn: ``Σ_c η_c · cos(g_c(z), ḡ_c)`` (``multi_checkpoint_scores``).
  With ``normalize=False`` the plain inner products ``⟨g(z), ḡ⟩`` are returned instead.
* **K-FAC influence** (Grosse et al. 2023): per tracked weight ``W: [out, in]``,
  ``C_h = E[h hᵀ]`` and ``C_δ = E[δ δᵀ]`` (means over the non-padding tokens of the first
  ``kfac_examples`` training examples, ``h`` the layer input, ``δ = ∂L(z)/∂(W h)``), damped
  ``C_λ = C + λ I`` by the project's damping rule, the same as IPSVD's (:mod:`iprox_lightning.engine.damping`:
  ``λ = damping · trace(C)/dim``, or ``damping`` when the trace is 0, with ``damping_mode="relative"``;
  ``λ = damping`` with ``"absolute"``); ``H = ⊕_layers C_δ,λ ⊗ C_h,λ``, preconditioned validation
  gradient ``H⁻¹ ḡ = C_δ,λ⁻¹ Ḡ C_h,λ⁻¹`` per layer, and
  ``score(z) = ⟨g(z), H⁻¹ ḡ⟩ / (‖H^{-1/2} g(z)‖ · ‖H^{-1/2} ḡ‖)`` — the cosine in the K-FAC metric
  (``normalize=False``: the plain ``⟨g(z), H⁻¹ ḡ⟩``). Per task with ``ḡ_T`` likewise.
* Both are one interface, an influence metric ``M`` (:mod:`.metrics`; TracIn: the identity, K-FAC:
  ``H^{-1/2}``): ``score(z) = ⟨M g(z), M ḡ⟩ / (‖M g(z)‖ ‖M ḡ‖)``. :func:`influence_scores` takes any metric,
  :func:`tracin_scores` is TracIn.
* An example whose gradient is zero (e.g. no response token left after truncation) gets score 0
  and ``zero_grad=True``, never NaN.
* Non-finite values are never hidden: a NaN/inf validation gradient raises an error naming the
  task(s); an example whose gradient is NaN/inf (e.g. an fp16 overflow) keeps NaN scores and is
  flagged ``nonfinite=True`` (``select`` refuses such rows unless told to skip them).

Nothing materialises a flat per-example gradient: per layer, ``features.layer_features`` uses the
ghost or the materialised ``[B, out, in]`` form, whichever is cheaper. Exactness against a
brute-force autograd reference is tested in ``tests/test_scoring_influence.py``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Collection, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import UserInputError
from ..engine.settings import takes_settings
from ..engine.fsdp import is_sharded
from ..engine.host_memory import release_freed_host_memory
from ..engine.norms import squared_norms
from ..engine.tracking import backward_pairs
from ..io.optimizer_state import recorded_lr
from ..io.scores import arrow_table, read_settings, read_table, task_names_of, write_parquet_atomic
from .config import METRIC_FIELDS, ScoringConfig, validation_holding
from .features import (
    FactorSpaceView, ScoreFeatureTracker, ValidationGradientTracker, eval_mode, has_response_tokens,
    progress_bar, to_device, tracked_modules, trim_batch, virtual_linears,
)
from .layer_shards import OwnedLayers, equal_steps, idle_batch
from .metrics import InfluenceMetric, fit_or_load, layer_owners

ALL_TASKS = "all"


# --------------------------------------------------------------------------------------------
# result type
# --------------------------------------------------------------------------------------------
class ScoreTable(Mapping):
    """``id -> score`` (a read-only ``Mapping``) carrying the rest of the result as arrays.

    Attributes (row ``j`` is example ``ids[j]``): ``scores [N]``, ``task_names [K]``,
    ``task_scores [N, K]`` (score against each validation task), ``n_tokens [N]`` (response tokens),
    ``zero_grad [N]`` (bool flag), ``nonfinite [N]`` (bool flag: NaN/inf gradient, scores NaN), ``tasks``
    (the example's own task, or ``None``), ``settings``. ``score_max`` is LESS's aggregate ``max_T`` of
    the per-task scores. On disk: :mod:`iprox_lightning.io.scores`.
    """

    def __init__(self, ids, scores, task_names, task_scores, n_tokens, zero_grad, tasks=None, settings=None,
                 nonfinite=None):
        self.ids = [str(i) for i in ids]
        self.scores = np.asarray(scores, dtype=np.float64).reshape(len(self.ids))
        self.task_names = list(task_names)
        self.task_scores = np.asarray(task_scores, dtype=np.float64).reshape(len(self.ids), len(self.task_names))
        self.n_tokens = np.asarray(n_tokens, dtype=np.int64).reshape(len(self.ids))
        self.zero_grad = np.asarray(zero_grad, dtype=bool).reshape(len(self.ids))
        self.nonfinite = (np.zeros(len(self.ids), bool) if nonfinite is None
                          else np.asarray(nonfinite, dtype=bool).reshape(len(self.ids)))
        self.tasks = None if tasks is None else [None if t is None else str(t) for t in tasks]
        self.settings = dict(settings or {})
        self._index: dict[str, int] = {}
        for j, i in enumerate(self.ids):
            if i in self._index:
                raise UserInputError(f"duplicate example id {i!r} in the scored data (rows {self._index[i]} and {j})")
            self._index[i] = j

    # Mapping protocol
    def __getitem__(self, key: str) -> float:
        return float(self.scores[self._index[key]])

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"ScoreTable({len(self)} examples, tasks={self.task_names}, method={self.settings.get('method')})"

    @property
    def score_max(self) -> np.ndarray:
        """LESS aggregation: ``max_T score_T(z)`` (``[N]``; 0 for flagged examples)."""
        if not self.task_names:
            return self.scores.copy()
        return self.task_scores.max(axis=1)

    def task_score(self, task: str) -> dict[str, float]:
        k = self.task_names.index(task)
        return dict(zip(self.ids, self.task_scores[:, k].tolist()))

    # Arrow (layout and files: iprox_lightning.io.scores) ----------------------------------
    def to_arrow(self):
        return arrow_table(self.ids, self.scores, self.task_names, self.task_scores, self.n_tokens, self.zero_grad,
                           self.nonfinite, self.tasks)

    @classmethod
    def from_arrow(cls, table, settings=None) -> "ScoreTable":
        names = task_names_of(table)
        n = table.num_rows
        ts = np.stack([table.column(f"score/{t}").to_numpy() for t in names], axis=1) if names else np.zeros((n, 0))
        col = lambda c: table.column(c).to_numpy(zero_copy_only=False)  # noqa: E731
        return cls(
            table.column("id").to_pylist(), table.column("score").to_numpy(), names, ts,
            table.column("n_tokens").to_numpy(), col("zero_grad"),
            table.column("task").to_pylist() if "task" in table.column_names else None, settings,
            nonfinite=col("nonfinite") if "nonfinite" in table.column_names else None,
        )

    def save(self, path: str) -> str:
        """Write as Parquet (atomic: temp file + ``os.replace``)."""
        write_parquet_atomic(self.to_arrow(), path)
        return path

    @classmethod
    def load(cls, path: str) -> "ScoreTable":
        """Read a merged score table (a file, or a scoring directory with its ``settings.json``)."""
        p, table = read_table(path)
        return cls.from_arrow(table, read_settings(p.parent) if p.name == "scores.parquet" else None)


def influence_metric(name: str, **options) -> InfluenceMetric:
    """The metric registered as ``name`` (``"tracin"`` | ``"kfac"`` | ``"ekfac"`` | a user's) with the
    :class:`ScoringConfig` fields ``options`` (``damping``, ``kfac_examples``, ``loss_reduction``, ...), checked."""
    return ScoringConfig(method=name, **options).build_metric()




# --------------------------------------------------------------------------------------------
# the scorer (plain object, used by the function API and by the Lightning module)
# --------------------------------------------------------------------------------------------
class InfluenceScorer:
    """Holds the prepared validation gradients (in the influence metric) and scores batches.

    ``config``: the :class:`ScoringConfig` (default: its defaults). ``metric``: the metric to score in, an
    :class:`~.metrics.InfluenceMetric` (default: the one ``config.method`` names, ``config.build_metric()``; from
    Python any metric object, its name and options then recorded in :meth:`settings`).
    ``fit(val_batches, factor_batches)`` runs once; ``score_batch(batch)`` then returns, for the
    examples of one batch, ``{"id", "score", "task_scores" [B, K], "n_tokens", "zero_grad", "task"}``.
    For several processes pass ``shard=(rank, world_size)`` (batch ``j`` is processed by rank
    ``j % world_size``), a ``reduce`` that all-reduces a tensor by sum and a ``gather`` that
    all-gathers a picklable object into a list: the prepared state is then identical on every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ScoringConfig | None = None,
        *,
        metric: InfluenceMetric | None = None,
        feature_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config = config if config is not None else ScoringConfig()
        self.metric = metric if metric is not None else self.config.build_metric()
        target_patterns = None if self.config.target_patterns is None else list(self.config.target_patterns)
        self.modules = tracked_modules(model, target_patterns)
        self.linears = virtual_linears(self.modules)
        p = next(model.parameters())
        self.dtype = feature_dtype or (torch.float64 if p.dtype == torch.float64 else torch.float32)
        self.task_names: list[str] = []
        self.V: dict[str, torch.Tensor] = {}  # key -> [K, out, in]: (whitened) Σ over task-T examples of g
        self.holding = validation_holding(self.config)  # how V is held (ScoringConfig.validation_gradients)
        self.columns: list[int] | None = None  # the task columns V holds (column groups: one group's)
        self.val_counts: np.ndarray | None = None
        self.vnorm_task: torch.Tensor | None = None
        self.vnorm_all: float = 0.0
        self.stats: dict[str, float] = {}
        self.fitted = False
        self.owners: dict[str, int] | None = None  # shard_layers under several processes: weight key -> owning rank
        self.shard = (0, 1)

    # ------------------------------------------------------------------------------------
    @property
    def device(self):
        return next(self.model.parameters()).device

    def settings(self) -> dict:
        """What scored: the metric's name and options, the config's other settings, what was tracked and the
        validation tasks, and the preparation's statistics."""
        c = self.config.to_dict()
        return {
            "method": self.metric.name, "normalize": c["normalize"], "per_task": c["per_task"], **self.metric.settings(),
            "feature_mode": c["feature_mode"], "target_patterns": c["target_patterns"],
            **({"validation_gradients": c["validation_gradients"]} if "validation_gradients" in c else {}),
            "tracked_weights": len(self.linears),
            "tracked_parameters": int(sum(v.out_features * v.in_features for v in self.linears)),
            "task_names": self.task_names,
            "val_counts": None if self.val_counts is None else [int(c) for c in self.val_counts],
            **{k: v for k, v in self.stats.items()},
        }

    def _group(self, batch: Mapping) -> list[str]:
        B = batch["input_ids"].shape[0]
        if not self.config.per_task or "task" not in batch or batch["task"] is None:
            return [ALL_TASKS] * B
        return [str(t) for t in batch["task"]]

    @property
    def lockstep(self) -> bool:
        """Whether every rank must make the same steps: ``shard_layers`` (each weight's pairs go to its owner) or a
        sharded model (FSDP2: each forward gathers the blocks from every rank)."""
        return self.owners is not None or is_sharded(self.model)

    # ------------------------------------------------------------------------------------
    @property
    def hold_device(self):
        """Where the validation gradients are held (``validation_gradients.device``: the model's, or the host)."""
        return torch.device("cpu") if self.holding["device"] == "cpu" else self.device

    @property
    def hold_dtype(self) -> torch.dtype:
        """Their dtype (``validation_gradients.dtype``: the scoring precision, or bfloat16)."""
        return torch.bfloat16 if self.holding["dtype"] == "bfloat16" else self.dtype

    def column_groups(self) -> list[list[int]]:
        """The columns (indexes into ``task_names``) of each pass: ``validation_gradients.column_groups`` contiguous
        groups of near-equal size, at most one per column."""
        K = len(self.task_names)
        n = min(int(self.holding["column_groups"]), max(K, 1))
        return [c.tolist() for c in np.array_split(np.arange(K), n)]

    def _validation_sums(self, batches, group_of, *, groups=None, shard=(0, 1), progress=False,
                         model: nn.Module | None = None, desc: str = "validation gradients"):
        """``(sums[key][group], counts[group])``: Σ over each group's validation examples of ``g(z')`` (only the
        ``groups`` given), accumulated where the validation gradients are held, and this rank's example counts."""
        rank, world = shard
        vmodel = self.model if model is None else model
        hold = torch.device("cpu") if self.host_sums else None
        tracker = ValidationGradientTracker(self.modules, [v.key for v in self.linears], group_of, self.dtype,
                                            groups=groups, device=hold)
        pairs = owned = tracker
        if self.owners is not None:  # shard_layers: each weight's pairs to its owner
            pairs = owned = OwnedLayers(tracker, self.owners, rank, world)
        if model is not None:
            target_patterns = None if self.config.target_patterns is None else list(self.config.target_patterns)
            pairs = FactorSpaceView(tracked_modules(model, target_patterns), owned, self.modules)
        counts: dict[str, int] = {}
        vdevice = next(vmodel.parameters()).device
        with eval_mode(vmodel):
            if self.owners is not None or is_sharded(vmodel):
                self._owned_steps(vmodel, batches, pairs, owned if self.owners is not None else None, counts, shard,
                                  progress, desc)
                return tracker.sums, counts
            for j, batch in enumerate(progress_bar(batches, progress, desc)):
                if j % world != rank:
                    continue
                for g in self._group(batch):  # the tasks' examples, whatever the sums are grouped by
                    counts[g] = counts.get(g, 0) + 1
                b = to_device(batch, vdevice)
                keep = has_response_tokens(b)
                if not bool(keep.any()):
                    continue
                backward_pairs(vmodel, trim_batch(b, keep), [pairs], loss_fn=self.metric.loss_fn)
        return tracker.sums, counts

    def _owned_steps(self, vmodel, batches, pairs, owned, counts, shard, progress, desc) -> None:
        """:meth:`_validation_sums`'s loop under ``shard_layers`` or a sharded model (FSDP2: each forward a
        collective): every rank makes the same number of steps (idle ones send no row or track nothing:
        :func:`~.layer_shards.equal_steps`), a batch without a response token too."""
        vdevice = next(vmodel.parameters()).device
        for batch, real in equal_steps(progress_bar(batches, progress, desc), *shard):
            if real:
                for g in self._group(batch):
                    counts[g] = counts.get(g, 0) + 1
            b = to_device(batch, vdevice)
            keep = has_response_tokens(b) if real else torch.zeros(b["input_ids"].shape[0], dtype=torch.bool)
            self._owned_step(vmodel, b, keep, [pairs], owned)

    def _owned_step(self, model, b, keep, trackers, owned) -> None:
        """One step that every rank makes (``shard_layers``: ``owned``, the :class:`~.layer_shards.OwnedLayers`; or a
        sharded model: ``owned`` None): the rows ``keep``, or none: an idle step on the batch with every token a
        label, so that every layer's exchange and every block's gathering runs (tracking nothing)."""
        if bool(keep.any()):
            b = trim_batch(b, keep)
            if owned is not None:
                owned.active = None
        else:
            b = idle_batch(b)
            if owned is None:
                trackers = []
            else:
                owned.active = torch.zeros(b["input_ids"].shape[0], dtype=torch.bool)
        backward_pairs(model, b, trackers, loss_fn=self.metric.loss_fn)

    @property
    def host_sums(self) -> bool:
        """Whether the validation sums are accumulated in host memory, in the scoring precision (held on the host, or
        in bfloat16: then only the bfloat16 copies, made layer by layer in :meth:`finalize`, reach the device)."""
        return self.holding["device"] == "cpu" or self.holding["dtype"] == "bfloat16"

    def _stacked(self, sums, names, reduce) -> None:
        """``self.V[key]``: the raw sums of ``names`` stacked ``[K, out, in]``, all-reduced (on the model's device),
        on the model's device (or on the host: :attr:`host_sums`); under ``shard_layers`` the owned weights' only,
        whose sums hold every rank's examples already."""
        if self.owners is not None:
            reduce = None
        for v in self.linears:
            if self.owners is not None and self.owners[v.key] != self.shard[0]:
                continue
            acc = sums[v.key]
            where = torch.device("cpu") if self.host_sums else next(iter(acc.values()), None)
            where = where if isinstance(where, torch.device) else where.device if where is not None else self.device
            st = torch.stack([acc[t] if t in acc else torch.zeros(v.out_features, v.in_features, dtype=self.dtype,
                                                                  device=where) for t in names])
            sums[v.key] = acc = {}
            if where.type == "cpu":  # the column sums just freed: their pages back before the next layer's stack
                release_freed_host_memory()
            if reduce is not None:
                st = reduce(st.to(self.device))
            self.V[v.key] = st.cpu() if self.host_sums else st.to(self.device)

    def collect_validation(self, batches: Iterable[Mapping], *, shard=(0, 1), reduce=None, gather=None,
                           progress=False, model: nn.Module | None = None) -> None:
        """Σ over the validation examples of each task of ``g(z')`` (per tracked weight); with column groups
        (``validation_gradients.column_groups``) only the counts and the sum over every example (for the norm of
        ``ḡ``), each group's columns then by :meth:`collect_columns`.

        ``model``: take the validation gradients from this dense model instead (e.g. the target a proxy was built
        from), in the scored model's coordinates (:class:`~.features.FactorSpaceView`)."""
        t0 = time.perf_counter()
        grouped = int(self.holding["column_groups"]) > 1 and self.config.per_task
        group_of = (lambda b: [ALL_TASKS] * b["input_ids"].shape[0]) if grouped else self._group
        sums, counts = self._validation_sums(batches, group_of, shard=shard, progress=progress, model=model)
        # identical task list on every rank
        local = sorted(counts)
        names = sorted(set().union(*gather(local))) if gather is not None else local
        if not names:
            raise UserInputError("the validation data is empty: cannot compute validation gradients")
        self.task_names = names
        cnt = torch.tensor([float(counts.get(t, 0)) for t in names], dtype=torch.float64, device=self.device)
        if reduce is not None:
            cnt = reduce(cnt)
        self.val_counts = cnt.cpu().numpy().astype(np.int64)
        self._stacked(sums, [ALL_TASKS] if grouped else names, reduce)
        self.columns = None if grouped else list(range(len(names)))  # the columns self.V holds (None: their sum)
        self.stats["validation_model"] = "scored" if model is None else "other"
        self.stats["val_seconds"] = time.perf_counter() - t0
        self.stats["val_examples"] = int(self.val_counts.sum())

    def put_validation_sums(self, V: Mapping[str, torch.Tensor], task_names: Sequence[str],
                            val_counts: Sequence[int]) -> None:
        """The raw validation gradient sums of every column, as :meth:`collect_validation` leaves them without column
        groups (e.g. read back from a cache), before :meth:`finalize`."""
        self.V = {k: t.to(self.dtype) for k, t in V.items()}
        self.task_names = list(task_names)
        self.columns = list(range(len(self.task_names)))
        self.val_counts = np.asarray(val_counts, dtype=np.int64)
        self.stats["val_examples"] = int(self.val_counts.sum())

    def collect_columns(self, columns: Sequence[int], val_batches: Iterable[Mapping], *, shard=(0, 1), reduce=None,
                        progress=False, model: nn.Module | None = None) -> None:
        """The validation gradients of the task columns ``columns`` only (one pass of column groups), mapped by the
        metric (:meth:`finalize`): ``self.V`` then holds those columns."""
        t0 = time.perf_counter()
        names = [self.task_names[c] for c in columns]
        sums, _ = self._validation_sums(val_batches, self._group, groups=names, shard=shard, progress=progress,
                                        model=model, desc=f"validation gradients ({len(names)} columns)")
        self._stacked(sums, names, reduce)
        self.columns = list(columns)
        self.finalize()
        self.stats["val_seconds"] = self.stats.get("val_seconds", 0.0) + time.perf_counter() - t0

    def finalize(self) -> None:
        """Map the validation gradients by the metric, hold them as ``validation_gradients`` says and compute
        their norms (from the values held)."""
        for key in self.V:  # layer by layer: one layer's float32 copy on the device at a time
            V = self.metric.matrix(key, self.V[key].to(self.device) if self.host_sums else self.V[key])
            if self.host_sums:
                V = V.to(device=self.hold_device, dtype=self.hold_dtype)
            self.V[key] = V
        if self.host_sums or self.device.type == "cpu":  # the float32 sums just replaced
            release_freed_host_memory()
        n = torch.as_tensor(self.val_counts, dtype=torch.float64)
        cols = self.columns
        names = self.task_names if cols is None else [self.task_names[c] for c in cols]
        sq_task = torch.zeros(len(names) if cols is not None else 1, dtype=torch.float64)
        sq_all = 0.0
        for key, V in self.V.items():
            per_column, of_sum = squared_norms(V)
            sq_task += per_column.cpu()
            sq_all += float(of_sum)
        if self.owners is not None:  # shard_layers: each rank's owned weights' part of the squared norms
            both = self._reduce(torch.cat([sq_task, torch.tensor([sq_all], dtype=torch.float64)]).to(self.device))
            sq_task, sq_all = both[:-1].cpu(), float(both[-1])
        bad = [t for t, v in zip(names, sq_task.tolist()) if not math.isfinite(v)] if cols is not None else []
        if bad or not math.isfinite(sq_all):
            tasks = bad or names
            raise ValueError(
                f"the validation gradient of task(s) {tasks} is not finite (NaN/inf; squared norm "
                f"{sq_task.tolist() if cols is None else [sq_task[names.index(t)].item() for t in tasks]}): the "
                "model overflows or holds NaN weights on those validation examples (try float32/bfloat16 instead of "
                "float16, or check the model); no scores were computed")
        # plain inner products with a metric that maps per-example gradients (EK-FAC): its dual directions, so the
        # training tokens are not rotated; ‖M G‖ is then not computed, ‖G‖ gives the zero / non-finite flags
        self.dual = ({key: self.metric.dual(key, V.to(self.device, self.dtype)).to(self.hold_device, self.hold_dtype)
                      for key, V in self.V.items()}
                     if not self.config.normalize and hasattr(self.metric, "dual") and cols is not None else None)
        if cols is None:  # column groups: the sum over every example gives ‖ḡ‖; the columns come pass by pass
            self.vnorm_task = torch.zeros(len(self.task_names), dtype=torch.float64)
            self.vnorm_all = math.sqrt(sq_all) / max(float(n.sum()), 1.0)
            self.stats["val_grad_norm"] = self.vnorm_all
            self.V = {}
            return
        if len(cols) == len(self.task_names):
            self.vnorm_task = sq_task.sqrt() / n.clamp(min=1)
            self.vnorm_all = math.sqrt(sq_all) / max(float(n.sum()), 1.0)
            self.stats["val_grad_norm"] = self.vnorm_all
        else:
            self.vnorm_task[cols] = sq_task.sqrt() / n[cols].clamp(min=1)
        self.fitted = True

    def fit(self, val_batches, factor_batches=None, *, shard=(0, 1), reduce=None, gather=None, progress=False,
            factors_dir: str | None = None, factors_fingerprint: dict | None = None,
            validation_model: nn.Module | None = None):
        """Prepare the scorer: fit the metric (K-FAC factors on ``factor_batches``; with ``factors_dir`` loaded from
        there when fitted before on the same inputs, ``factors_fingerprint``, else fitted and saved there:
        :func:`~.metrics.fit_or_load`) then the validation gradients (of ``validation_model`` when given:
        :meth:`collect_validation`). With several column groups only the last group's columns are prepared here:
        :meth:`earlier_passes` scores the pool against the others first."""
        keys = [v.key for v in self.linears]
        self.shard, self._reduce = shard, reduce
        if self.config.shard_layers and shard[1] > 1 and reduce is not None:
            self.owners = layer_owners(self.modules, keys, self.config.kfac_partitions, shard[1])
        self.stats.update(fit_or_load(self.metric, self.model, self.modules, keys,
                                      factor_batches, factors_dir=factors_dir, fingerprint=factors_fingerprint,
                                      dtype=self.dtype, shard=shard, reduce=reduce, progress=progress,
                                      save=shard[0] == 0, **({"owners": self.owners} if self.owners else {})))
        self.collect_validation(val_batches, shard=shard, reduce=reduce, gather=gather, progress=progress,
                                model=validation_model)
        self.finalize()
        self._passes = dict(val_batches=val_batches, shard=shard, reduce=reduce, progress=progress,
                            model=validation_model)
        self.earlier: dict[str, np.ndarray] = {}  # id -> dots of the earlier groups' columns (column groups)
        if self.columns is None:
            groups = self.column_groups()
            self.stats["column_groups"] = len(groups)
            if len(groups) == 1:
                self.collect_columns(groups[0], **self._passes)
        if not self.pending_groups:
            self.release_validation_model()
        return self

    def release_validation_model(self) -> None:
        """Drop the scorer's reference to the validation model once every column's validation gradients are
        prepared: a proxy's pool pass then holds the proxy alone (the target is freed when its caller drops it too,
        as :class:`~.module.InfluenceScoringModule` does; ``train.py plan``'s scoring with the proxy counts it so)."""
        if getattr(self, "_passes", None) is not None:
            self._passes["model"] = None

    @property
    def pending_groups(self) -> list[list[int]]:
        """The column groups still to score the pool against before :meth:`score_batch` (column groups)."""
        if self.columns is not None and self.fitted:
            return []
        return self.column_groups()

    def earlier_passes(self, pool_batches: Iterable[Mapping], skip_ids: Collection[str] = ()) -> None:
        """Column groups: score ``pool_batches`` (this rank's share, as :meth:`score_batch` will see it) against every
        group's columns but the last's, each group's validation gradients collected in turn and dropped after its
        pass, the inner products kept per example id; then prepare the last group's, so :meth:`score_batch` gives
        every column (``skip_ids``: examples not to score, e.g. resumed ones)."""
        groups = self.pending_groups
        for group in groups[:-1]:
            self.collect_columns(group, **self._passes)
            batches = progress_bar(pool_batches, self._passes["progress"], f"scoring ({len(group)} columns)")
            for batch in self.rows_to_score(batches, skip_ids):
                _, dots, _, _ = self._features(batch)
                for i, d in zip(batch["id"], dots.numpy()):
                    self.earlier.setdefault(str(i), np.zeros(len(self.task_names)))[group] = d
            self.V = {}
        if groups:
            self.collect_columns(groups[-1], **self._passes)
        self.release_validation_model()

    def rows_to_score(self, pool_batches: Iterable[Mapping], skip_ids: Collection[str] = ()) -> Iterator[dict]:
        """The batches of a replayed pass over the pool with the rows of ``skip_ids`` (e.g. resumed ones) trimmed
        off; a batch with no row left is not yielded, its step taken (:meth:`take_part`) where the ranks keep in step."""
        skip = set(skip_ids)
        for batch in pool_batches:
            keep = torch.tensor([str(i) not in skip for i in batch["id"]], dtype=torch.bool)
            if not bool(keep.any()):
                self.take_part(batch)
            else:
                yield batch if bool(keep.all()) else trim_batch(batch, keep.to(batch["input_ids"].device))

    # ------------------------------------------------------------------------------------
    def _features(self, batch: Mapping, active: torch.Tensor | None = None):
        """``(‖M g‖² [B], ⟨M g, V_k⟩ [B, K'] over the columns held, n_tokens [B], has_response [B])``; ``active``
        (``[B]`` bool): the rows to score (the others are skipped: zeros; under ``shard_layers`` the step is made
        all the same, sending none of them)."""
        B = batch["input_ids"].shape[0]
        K = len(self.columns)
        sq = torch.zeros(B, dtype=torch.float64)
        dots = torch.zeros(B, K, dtype=torch.float64)
        b = to_device(batch, self.device)
        n_tok = (b["labels"][:, 1:] != -100).sum(dim=1).cpu()
        keep = has_response_tokens(b).cpu()
        if active is not None:
            keep = keep & active.cpu()
        if self.lockstep or bool(keep.any()):
            rows = torch.nonzero(keep).flatten()
            tracker = ScoreFeatureTracker(self.modules, self.metric, self.V, K, self.dtype, self.config.feature_mode,
                                          dual=getattr(self, "dual", None))
            with eval_mode(self.model):
                if not self.lockstep:
                    backward_pairs(self.model, trim_batch(b, keep), [tracker], loss_fn=self.metric.loss_fn)
                elif self.owners is None:
                    self._owned_step(self.model, b, keep.to(b["input_ids"].device), [tracker], None)
                else:
                    owned = OwnedLayers(tracker, self.owners, *self.shard)
                    self._owned_step(self.model, b, keep.to(b["input_ids"].device), [owned], owned)
            if bool(keep.any()):
                sq[rows] = tracker.sq.cpu()
                dots[rows] = tracker.dots.cpu()
        return sq, dots, n_tok, keep

    def take_part(self, batch: Mapping) -> None:
        """The step of a batch this rank scores no row of (e.g. every row resumed) where every rank must make the
        same steps (:attr:`lockstep`: the other ranks' pairs still reach this rank's weights, its blocks are still
        gathered); a no-op otherwise."""
        if self.lockstep:
            self._features(batch, active=torch.zeros(batch["input_ids"].shape[0], dtype=torch.bool))

    def score_batch(self, batch: Mapping) -> dict:
        """Scores of the examples of one batch (see class docstring)."""
        if not self.fitted or self.pending_groups:
            raise RuntimeError("InfluenceScorer.score_batch called before fit()" if not self.fitted else
                               "InfluenceScorer.score_batch called before earlier_passes() (column groups)")
        sq, dots, n_tok, keep = self._features(batch)
        if len(self.columns) < len(self.task_names):  # column groups: the earlier groups' inner products by id
            full = torch.zeros(len(sq), len(self.task_names), dtype=torch.float64)
            for r, i in enumerate(batch["id"]):
                if str(i) not in self.earlier:
                    raise RuntimeError(f"example {i!r} was not scored in the earlier column groups' passes: the pool "
                                       "batches differ between passes (a deterministic pool loader is needed)")
                full[r] = torch.from_numpy(self.earlier.pop(str(i)))
            full[:, self.columns] = dots
            dots = full
        n = torch.as_tensor(self.val_counts, dtype=torch.float64)
        dot_all = dots.sum(dim=1) / n.sum().clamp(min=1)
        dot_task = dots / n.clamp(min=1)
        nonfinite = ~torch.isfinite(sq) | ~torch.isfinite(dots).all(dim=1)
        norm = sq.clamp(min=0).sqrt()
        zero = ((norm == 0) | (n_tok == 0)) & ~nonfinite
        if self.config.normalize:
            den_all = norm * self.vnorm_all
            score = torch.where(den_all > 0, dot_all / den_all.clamp(min=1e-300), torch.zeros_like(dot_all))
            den_t = norm[:, None] * self.vnorm_task[None, :]
            task_scores = torch.where(den_t > 0, dot_task / den_t.clamp(min=1e-300), torch.zeros_like(dot_task))
        else:
            score, task_scores = dot_all, dot_task
        score = torch.where(zero, torch.zeros_like(score), score)
        task_scores = torch.where(zero[:, None], torch.zeros_like(task_scores), task_scores)
        nan = torch.full_like(score, float("nan"))
        score = torch.where(nonfinite, nan, score)  # never a silent 0: NaN + the flag
        task_scores = torch.where(nonfinite[:, None], nan[:, None].expand_as(task_scores), task_scores)
        return {
            "id": [str(i) for i in batch["id"]],
            "score": score.numpy(),
            "task_scores": task_scores.numpy(),
            "n_tokens": n_tok.numpy(),
            "zero_grad": zero.numpy(),
            "nonfinite": nonfinite.numpy(),
            "task": list(batch["task"]) if batch.get("task") is not None else None,
        }


# --------------------------------------------------------------------------------------------
# function API
# --------------------------------------------------------------------------------------------
def _table_from_parts(parts: list[dict], task_names: list[str], settings: dict) -> ScoreTable:
    ids, tasks = [], []
    for p in parts:
        ids += p["id"]
        tasks += p["task"] if p["task"] is not None else [None] * len(p["id"])
    K = len(task_names)
    cat = lambda k, shape: np.concatenate([p[k] for p in parts]) if parts else np.zeros(shape)  # noqa: E731
    return ScoreTable(ids, cat("score", (0,)), task_names, cat("task_scores", (0, K)), cat("n_tokens", (0,)),
                      cat("zero_grad", (0,)), tasks if any(t is not None for t in tasks) else None, settings,
                      nonfinite=cat("nonfinite", (0,)))


@takes_settings(ScoringConfig, "scoring")
def influence_scores(
    model: nn.Module,
    train_dataloader: Iterable[Mapping],
    val_dataloader: Iterable[Mapping],
    *,
    metric: InfluenceMetric | str | None = None,
    factor_dataloader: Iterable[Mapping] | None = None,
    progress: bool = True,
    validation_model: nn.Module | None = None,
    scoring: ScoringConfig | None = None,
) -> ScoreTable:
    """Influence score of every training example against the validation set, in the influence metric the
    :class:`ScoringConfig` fields name (``method``, ``damping``, ...: keywords, or ``scoring=ScoringConfig(...)``).

    ``method="tracin"``: ``score(z) = cos(g(z), ḡ)``; ``"kfac"``: cosine in the K-FAC metric
    ``⟨g, H⁻¹ḡ⟩ / (‖H^{-1/2}g‖ ‖H^{-1/2}ḡ‖)`` (see the module docstring for every definition; higher = more useful).
    ``normalize=False`` returns the plain inner products. ``metric``: an :class:`~.metrics.InfluenceMetric` object to
    score in instead (its name and options then recorded in the settings), or a metric name (the same as
    ``method=``).

    ``train_dataloader`` / ``val_dataloader``: any iterables of batches in the project's batch
    format (``input_ids``, ``attention_mask``, ``labels``, ``id``, optional ``task``). A metric fitted on data
    (K-FAC factors: the first ``kfac_examples`` examples) reads ``factor_dataloader`` (default: the
    training batches, which must then be re-iterable). ``per_task``: also score against each
    validation task's mean gradient (``ScoreTable.task_scores``, LESS max in ``score_max``).
    ``validation_model``: a dense model (the target a proxy ``model`` was built from) whose validation gradients
    replace ``model``'s own, in ``model``'s coordinates (factor-space projections ``∇W·Bᵀ``, ``Aᵀ·∇W`` for a
    factorised layer; :class:`~.features.FactorSpaceView`): the few validation examples pay the target's backward,
    the pool only the proxy's.

    Returns a ``ScoreTable`` — a ``Mapping`` ``id -> score`` with per-task scores, response-token
    counts and zero-gradient flags.
    """
    if isinstance(metric, str):
        if scoring.method not in (ScoringConfig.method, metric):
            raise UserInputError(f"influence_scores: metric={metric!r} and method={scoring.method!r} name two metrics")
        scoring, metric = replace(scoring, method=metric), None
    elif metric is not None:  # a metric object carries its own options
        given = [f for f in METRIC_FIELDS if getattr(scoring, f) != getattr(ScoringConfig, f)]
        if given:
            raise TypeError(f"options {given} are for a metric given by name, not {type(metric).__name__}")
    scorer = InfluenceScorer(model, scoring, metric=metric)
    metric = scorer.metric
    scorer.fit(val_dataloader, factor_dataloader if factor_dataloader is not None else train_dataloader,
               progress=progress, validation_model=validation_model)
    scorer.earlier_passes(train_dataloader)  # column groups: a pass over the pool per earlier group (else nothing)
    parts = [scorer.score_batch(b) for b in progress_bar(train_dataloader, progress, f"scoring ({metric.name})")]
    return _table_from_parts(parts, scorer.task_names, scorer.settings())


@takes_settings(ScoringConfig, "scoring", fields=("normalize", "per_task", "feature_mode", "target_patterns",
                                                   "loss_reduction"))
def tracin_scores(
    model: nn.Module,
    train_dataloader: Iterable[Mapping],
    val_dataloader: Iterable[Mapping],
    *,
    progress: bool = True,
    validation_model: nn.Module | None = None,
    scoring: ScoringConfig | None = None,
) -> ScoreTable:
    """TracIn: ``score(z) = cos(g(z), ḡ)`` of every training example (:func:`influence_scores` with
    ``method="tracin"``; same arguments)."""
    return influence_scores(model, train_dataloader, val_dataloader, progress=progress,
                            validation_model=validation_model, scoring=replace(scoring, method="tracin"))


def checkpoint_sum(weights: Sequence[float], scores: Sequence, task_scores: Sequence, zero_grad: Sequence,
                   nonfinite: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The multi-checkpoint combination of the same rows scored at each checkpoint ``c``: ``Σ_c w_c · score_c`` and
    ``Σ_c w_c · task_scores_c`` (``w_c``: the checkpoint's learning rate, LESS's weights); a row is ``zero_grad`` when
    it is at every checkpoint and ``nonfinite`` when it is at any (its sums then NaN). :func:`multi_checkpoint_scores`
    and the predict loop's ``checkpoints`` (:class:`~.module.InfluenceScoringModule`) both combine with it."""
    if len(weights) != len(scores) or not len(weights):
        raise ValueError(f"need one weight per checkpoint, got {len(scores)} checkpoints and {len(weights)} weights")
    s = sum(float(w) * np.asarray(x, dtype=np.float64) for w, x in zip(weights, scores))
    ts = sum(float(w) * np.asarray(x, dtype=np.float64) for w, x in zip(weights, task_scores))
    zero = np.logical_and.reduce([np.asarray(z, dtype=bool) for z in zero_grad])
    bad = np.logical_or.reduce([np.asarray(b, dtype=bool) for b in nonfinite])
    return s, ts, zero, bad


def check_checkpoints(value: Any) -> list[dict] | None:
    """``checkpoints`` of a scoring run checked: ``None``, or a non-empty list of ``{path, weight}`` (``weight`` a
    finite number, or omitted: the learning rate recorded in the checkpoint's optimiser state,
    :func:`~iprox_lightning.io.optimizer_state.recorded_lr`); returns ``[{path, weight}]`` with every weight."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise UserInputError(f"checkpoints must be a non-empty list of {{path, weight}}, got {value!r}")
    out = []
    for j, c in enumerate(value):
        if isinstance(c, (str, bytes)) or hasattr(c, "__fspath__"):
            c = {"path": str(c)}
        if not isinstance(c, Mapping) or "path" not in c or set(c) - {"path", "weight"}:
            raise UserInputError(f"checkpoints[{j}] must be {{path, weight}} (weight optional), got {c!r}")
        w = c.get("weight")
        if w is None:
            w = recorded_lr(c["path"], f"checkpoints[{j}]")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise UserInputError(f"checkpoints[{j}].weight must be a finite number, got {w!r}")
        out.append({"path": str(c["path"]), "weight": float(w)})
    return out


def multi_checkpoint_scores(
    models: Sequence[nn.Module],
    train_dataloader: Iterable[Mapping],
    val_dataloader: Iterable[Mapping],
    *,
    weights: Sequence[float],
    **kwargs,
) -> ScoreTable:
    """Multi-checkpoint scores: ``Σ_c η_c · score_c(z)`` over checkpoints ``models`` with weights ``η_c`` (learning
    rates; :func:`checkpoint_sum`); per-task scores likewise. ``kwargs`` go to :func:`influence_scores` (default metric
    TracIn; ``metric``: a list gives each checkpoint its own metric object, e.g. LESS's with that checkpoint's
    optimiser state); the data loaders must be re-iterable. An example is flagged ``zero_grad`` if it is at every
    checkpoint. The command line's ``--model.checkpoints`` (:class:`~.module.InfluenceScoringModule`) sums the same
    way, batch by batch."""
    if len(models) != len(weights) or not models:
        raise ValueError(f"need one weight per checkpoint, got {len(models)} models and {len(weights)} weights")
    metrics = kwargs.pop("metric", None)
    metrics = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics] * len(models)
    tables = []
    for m, metric in zip(models, metrics):
        t = influence_scores(m, train_dataloader, val_dataloader, metric=metric, **kwargs)
        if tables and (t.ids != tables[0].ids or t.task_names != tables[0].task_names):
            raise ValueError("checkpoints scored different ids or tasks; use a deterministic data loader")
        tables.append(t)
    s, ts, zero, bad = checkpoint_sum(weights, [t.scores for t in tables], [t.task_scores for t in tables],
                                      [t.zero_grad for t in tables], [t.nonfinite for t in tables])
    t = tables[0]
    return ScoreTable(t.ids, s, t.task_names, ts, t.n_tokens, zero, t.tasks,
                      {**t.settings, "checkpoint_weights": list(map(float, weights))}, nonfinite=bad)
