"""The mark of a failure the user causes and can fix.

A service mixes `ExpectedError` into its error classes for bad input, a refused name, a server
that refuses or cannot be reached (`class IngestError(ExpectedError, ValueError)`). `aerie`'s
commands and the Celery sub-commands print such a failure as one line naming the cause and the
setting (`aerie.app.cli.expected_errors`) without importing the service; any other exception is a
bug, and its traceback is printed.
"""

from __future__ import annotations


class ExpectedError(Exception):
    """Mixed into a service's error classes: its message is what the user reads, in one line."""
