"""The one error type of the data package (its own module, so that every data module can raise it)."""

from infra.errors import RunError


class DataError(RunError, ValueError):
    """The prepared data is missing, damaged, or does not fit the run."""

    kind = "data"
