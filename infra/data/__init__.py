"""Data: prepare raw text into shards, open them as a recipe's `Data`, read them back in a resumable global order."""

from infra.data.arguments import DataArguments
from infra.data.errors import DataError
from infra.data.loader import DataCursor, ResumableLoader, SampleTrace, eval_batches
from infra.data.opened import Data, open_datasets
from infra.data.shards import DataIndex, PackedDataset, SampleRange, check_fits_model

__all__ = [
    "Data",
    "DataArguments",
    "DataCursor",
    "DataError",
    "DataIndex",
    "PackedDataset",
    "ResumableLoader",
    "SampleRange",
    "SampleTrace",
    "check_fits_model",
    "eval_batches",
    "open_datasets",
]
