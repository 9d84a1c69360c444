"""An alignment report (`aerie align`, contract AlignmentReport) as a person reads it: the one line
that stops a training (its table is the app's: `aerie.app.views`).

Shared, so the extractor's command and task and `aerie run` show the same thing; the report is
measured by the extractor (stage `align`) and read here from the contract only.
"""

from __future__ import annotations

from aerie import layout
from aerie.contracts import AlignmentReport


def failure_message(report: AlignmentReport) -> str:
    """One line: why training was stopped, and where the report is."""
    key = layout.alignment_report(report.run, report.server.server_id)
    cause = report.causes[0] if report.causes else "see the report"
    return f"run {report.run!r} is not aligned with {report.server.url} ({key}): {cause}; fix it, or train anyway with --allow-misaligned"
