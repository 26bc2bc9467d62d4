"""Analysis of proxies: influence retention, subspace affinity / diversity, FLOPs, plots, report tables."""
from .flops import LinearShape, ModelShape, alignment_flops, ipsvd_flops, pipeline_flops, probe_flops, scoring_flops
from .tables import flops_rows, format_table, merge_rows, retention_rows, select_top, selection_rows, write_rows
from .retention import (
    kendall, partial_spearman, pearson, per_task_retention, per_task_scores, retention_metrics, spearman, topk_overlap,
    worst_task,
)
from .subspace import (
    KroneckerProjector, mean_nn_distance, nearest_neighbor_distances, per_example_gradients, subspace_affinity,
    subspace_basis,
)

# public for the benchmarks: per-column Spearman (bench/store.py) and the per-layer attribution
# (bench/layer_diagnosis.py)
from .layer_attribution import group_table, layer_blocks, layer_contributions, task_layer_table
from .retention import spearman_columns
# the memory plan (train.py plan) as an API: a model's sizes, one run's settings, the stages' peaks (bench/plan_*.py)
from .memory import Activations, ModelSizes, RunSettings, load_config, plan_stages, training_plan

__all__ = [
    "LinearShape", "ModelShape", "alignment_flops", "ipsvd_flops", "pipeline_flops", "probe_flops",
    "scoring_flops", "flops_rows", "format_table", "merge_rows", "retention_rows", "select_top", "selection_rows", "write_rows",
    "kendall", "partial_spearman", "pearson", "per_task_retention", "per_task_scores", "retention_metrics", "spearman",
    "topk_overlap", "worst_task",
    "KroneckerProjector", "mean_nn_distance", "nearest_neighbor_distances", "per_example_gradients",
    "subspace_affinity", "subspace_basis",
    "group_table", "layer_blocks", "layer_contributions", "task_layer_table", "spearman_columns",
    "Activations", "ModelSizes", "RunSettings", "load_config", "plan_stages", "training_plan",
]
