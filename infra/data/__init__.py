"""Data: prepare raw text into shards, read them back in a resumable global order."""

from infra.data.loader import DataCursor, ResumableLoader, SampleTrace
from infra.data.shards import DataError, DataIndex, PackedDataset, check_fits_model

__all__ = ["DataCursor", "DataError", "DataIndex", "PackedDataset", "ResumableLoader", "SampleTrace", "check_fits_model"]
