"""An alignment report (`aerie align`, contract AlignmentReport) as a person reads it: one table
with the server's identity, the verdict and the causes; and the one line that stops a training.

Shared, so the extractor's command and task and `aerie run` show the same thing; the report is
measured by the extractor (stage `align`) and read here from the contract only.
"""

from __future__ import annotations

from aerie import layout
from aerie.contracts import AlignmentReport


def report_table(report: AlignmentReport):
    from rich.markup import escape
    from rich.table import Table

    s = report.server
    table = Table(
        title=(f"run {report.run} vs {s.url} ({s.server_id}): {len(report.samples)} sequences, {report.tokens} tokens"),
        caption=escape(
            f"{s.model_path} | SGLang {s.sglang_version} | quantization {s.quantization or 'none'} | "
            f"dtype {s.dtype} | TP {s.tp_size} | ids {s.aux_layer_ids} = points {s.aux_points} | {s.transport}; "
            f"thresholds ({report.precision}): mean >= {report.min_cosine}, p1 >= {report.min_cosine_p1}, "
            f"top-1 >= {report.min_top1}"
        ),
    )
    for col in ("point", "cos mean", "cos p1", "cos min", "rel L2", "best server point", "top-1", "verdict"):
        table.add_column(col, justify="right")
    for p in report.points:
        a = p.at_point
        best = "-" if p.best_point is None else f"{p.best_point} ({p.cosines[p.best_point]:.4f})"
        cells = ["-"] * 4 if a is None else [f"{a.mean:.6f}", f"{a.p1:.6f}", f"{a.min:.6f}", f"{a.rel_l2:.2e}"]
        table.add_row(str(p.point), *cells, best, "", "pass" if p.passed else "[red]FAIL[/]")
    sig = report.signal
    if sig is not None:
        f = sig.final
        cells = ["-"] * 4 if f is None else [f"{f.mean:.6f}", f"{f.p1:.6f}", f"{f.min:.6f}", f"{f.rel_l2:.2e}"]
        table.add_row(sig.signal, *cells, "", f"{sig.top1_agreement:.1%}", "pass" if sig.passed else "[red]FAIL[/]")
    return table


def print_report(report: AlignmentReport, console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a pipe: wide enough for the table on one line a row
            console = Console(width=max(console.width, 132))
    console.print(report_table(report))
    t = report.tokenization
    tokens = f"differs at position {t.differs_at}" if t.differs_at is not None else f"{t.checked} samples agree"
    console.print(f"tokenization: {tokens}" + (f" ({t.note})" if t.note else ""))
    verdict = "[green]aligned[/]" if report.passed else "[red]NOT aligned[/]"
    console.print(f"{verdict}: report {layout.alignment_report(report.run, report.server.server_id)}")
    for cause in report.causes:
        console.print(f"  - {cause}", highlight=False, markup=False)


def failure_message(report: AlignmentReport) -> str:
    """One line: why training was stopped, and where the report is."""
    key = layout.alignment_report(report.run, report.server.server_id)
    cause = report.causes[0] if report.causes else "see the report"
    return f"run {report.run!r} is not aligned with {report.server.url} ({key}): {cause}; fix it, or train anyway with --allow-misaligned"
