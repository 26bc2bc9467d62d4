"""Data: SFT data module, sources and field mapping, splits, built-in demo data (its model: models.builtin), eval readers."""
from .sft import SFTCollator, SFTDataModule, read_validation_sets
from .sources import DataFormatError, read_records, write_records_jsonl
from .splits import make_splits, split_sizes
from .synthetic import BUILTIN_VALIDATION_FAMILIES, builtin_validation, generate_builtin_dataset, oracle_share

__all__ = [
    "SFTDataModule", "SFTCollator", "read_validation_sets", "DataFormatError", "read_records",
    "write_records_jsonl", "make_splits", "split_sizes", "BUILTIN_VALIDATION_FAMILIES",
    "builtin_validation", "generate_builtin_dataset", "oracle_share",
]
