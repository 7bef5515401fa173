"""The data package's errors: one line naming the file or column and what would be right."""

from __future__ import annotations

from ..config.sections import ConfigError


class DataError(ConfigError):
    """Unusable data (missing, empty, lacking a column, mismatched): one line naming file or column."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data path that does not exist or matches no file."""
