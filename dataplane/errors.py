"""Operating errors of the data plane: each message names the trajectory and/or file and what to do."""
from __future__ import annotations


class DataPlaneError(Exception):
    """Base class: an expected failure (bad input, missing or corrupt data), never a programmer error."""


class SchemaVersionError(DataPlaneError):
    """The catalog was written by a different schema version than this code reads."""


class BadRecordError(DataPlaneError):
    """A trajectory handed to `put` is malformed (shapes, dtypes, duplicate id...); nothing was written."""


class ShardMissingError(DataPlaneError):
    """A shard file named by the catalog or a plan does not exist (deleted, moved, wrong store root)."""


class ChecksumError(DataPlaneError):
    """Bytes read back do not match the checksum recorded when they were written."""


class StaleRowError(DataPlaneError):
    """A plan points at a trajectory that is no longer where the plan says (deleted, or row replaced)."""
