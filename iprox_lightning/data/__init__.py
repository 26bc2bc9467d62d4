"""Data: SFT data module, sources and field mapping, splits, built-in demo data (its model: models.builtin), eval readers."""
from .sft import SFTCollator, SFTDataModule, read_validation_sets
from .sources import DataFormatError, read_records, write_records_jsonl
from .splits import make_splits, split_sizes
from .synthetic import BUILTIN_VALIDATION_FAMILIES, builtin_validation, generate_builtin_dataset, oracle_share

# public for the benchmarks: the suites' validation records and forms, the pool reader, the seeded samplers
from .eval_readers import sample_per_group
from .eval_validation import FORMS as VALIDATION_FORMS, eval_validation_records
from .pool import read_pool
from .splits import stratified_sample

__all__ = [
    "SFTDataModule", "SFTCollator", "read_validation_sets", "DataFormatError", "read_records",
    "write_records_jsonl", "make_splits", "split_sizes", "BUILTIN_VALIDATION_FAMILIES",
    "builtin_validation", "generate_builtin_dataset", "oracle_share",
    "sample_per_group", "VALIDATION_FORMS", "eval_validation_records", "read_pool", "stratified_sample",
]
