"""Analysis of proxies: influence retention, subspace affinity / diversity, FLOPs, plots, report tables."""
from __future__ import annotations

from ..lazy import lazy_names

_HOMES = {
    'LinearShape': '.flops',
    'ModelShape': '.flops',
    'alignment_flops': '.flops',
    'ipsvd_flops': '.flops',
    'pipeline_flops': '.flops',
    'probe_flops': '.flops',
    'scoring_flops': '.flops',
    'flops_rows': '.tables',
    'format_table': '.tables',
    'merge_rows': '.tables',
    'retention_rows': '.tables',
    'select_top': '.tables',
    'selection_rows': '.tables',
    'write_rows': '.tables',
    'kendall': '.retention',
    'partial_spearman': '.retention',
    'pearson': '.retention',
    'per_task_retention': '.retention',
    'per_task_scores': '.retention',
    'retention_metrics': '.retention',
    'spearman': '.retention',
    'topk_overlap': '.retention',
    'worst_task': '.retention',
    'KroneckerProjector': '.subspace',
    'mean_nn_distance': '.subspace',
    'nearest_neighbor_distances': '.subspace',
    'per_example_gradients': '.subspace',
    'subspace_affinity': '.subspace',
    'subspace_basis': '.subspace',
    'group_table': '.layer_attribution',
    'layer_blocks': '.layer_attribution',
    'layer_contributions': '.layer_attribution',
    'task_layer_table': '.layer_attribution',
    'spearman_columns': '.retention',
    'Activations': '.memory',
    'ModelSizes': '.memory',
    'RunSettings': '.memory',
    'load_config': '.memory',
    'plan_stages': '.memory',
    'training_plan': '.memory',
    'build_proxy_plan': '.memory',  # bench/plan_memory.py: Stage 1's plan against its measured peak
    'saved_activation_bytes': '.memory',
    'run_activations': '.memory',  # bench/plan_stage2.py
    'validation_gradient_bytes': '.memory',  # bench/validation_holding.py
    'with_layers': '.memory',
    'fit_target': '.fit',  # bench/plan_targets.py: the README's target table
    'scoring_plan': '.memory',  # bench/plan_memory.py, bench/gpu_check.py: scoring's plan beside its measured peak
    'NAMED_SHAPES': '.memory',  # bench/plan_stage2.py
    'proxy_sizes': '.memory',  # bench/plan_proxy.py: the proxy's ranks, built and measured against the plan
}
"""Each public name and the module it lives in: imported on first use (PEP 562), so importing the package loads
none of them (``train.py <command> --help`` stays fast)."""


__getattr__, __dir__ = lazy_names(__name__, _HOMES)

__all__ = [
    "LinearShape", "ModelShape", "alignment_flops", "ipsvd_flops", "pipeline_flops", "probe_flops",
    "scoring_flops", "flops_rows", "format_table", "merge_rows", "retention_rows", "select_top", "selection_rows", "write_rows",
    "kendall", "partial_spearman", "pearson", "per_task_retention", "per_task_scores", "retention_metrics", "spearman",
    "topk_overlap", "worst_task",
    "KroneckerProjector", "mean_nn_distance", "nearest_neighbor_distances", "per_example_gradients",
    "subspace_affinity", "subspace_basis",
    "group_table", "layer_blocks", "layer_contributions", "task_layer_table", "spearman_columns",
    "Activations", "ModelSizes", "RunSettings", "load_config", "plan_stages", "training_plan",
    "build_proxy_plan", "saved_activation_bytes", "run_activations", "validation_gradient_bytes", "with_layers",
    "fit_target", "scoring_plan", "NAMED_SHAPES", "proxy_sizes",
]
