"""The errors autosched raises for misuse and broken infrastructure.

A candidate schedule that fails to build, crashes or computes a wrong answer is *not* an error in
this sense: it becomes a failed measurement result and is stored as such.
"""

from __future__ import annotations


class AutoschedError(Exception):
    """Base class of every error autosched raises on purpose.

    The command line prints these as one line (without a traceback unless ``--debug``) and exits
    with :attr:`exit_code`.
    """

    exit_code = 1


class UsageError(AutoschedError):
    """Raised for bad input: an unknown operator, a malformed shape, an unsupported dtype or target."""

    exit_code = 2


class DeviceError(AutoschedError):
    """Raised when the requested device is missing or unusable (e.g. ``--target cuda`` without a GPU)."""


class DatabaseError(AutoschedError):
    """Raised when the tuning database cannot be opened, read or written."""


class DatabaseUsageError(DatabaseError):
    """Raised when ``--db`` names no usable database: a missing file where one is read, a folder, a path in a
    folder that does not exist, a malformed URL. Bad input, so exit code 2 as for other bad input."""

    exit_code = 2


class DatabaseLockedError(DatabaseError):
    """Raised when the database stayed locked by another process for longer than the busy timeout."""


class DatabaseCorruptError(DatabaseError):
    """Raised when the database file is not a readable SQLite database (or not an autosched one): bad
    input, exit code 2."""

    exit_code = 2


class SchemaVersionError(DatabaseError):
    """Raised when the database was written by an older or newer autosched schema than this one."""


class SpaceError(AutoschedError):
    """Raised when no schedule space applies to a workload on a target."""


class TemplateBugError(SpaceError):
    """A kernel template's generator raised on a point it had accepted: a bug in the space, which stops the run
    (with the generator's traceback) instead of failing every candidate that reaches it."""
