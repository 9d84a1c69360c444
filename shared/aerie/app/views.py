"""What the operator's terminal shows (rich): an alignment report's table and the trainings'
progress table. The contracts they read are the core's (`aerie.alignment`, `aerie.training`)."""

from __future__ import annotations

from aerie import layout
from aerie.contracts import AlignmentReport, TrainProgress


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


def progress_table(records: list[TrainProgress]):
    """One row a job, readable in 80 columns: the train id folds, every other cell stays whole
    (the drafter is named where the train id does not start with it; `updated` is UTC)."""
    from rich import box
    from rich.table import Table

    table = Table(title="training", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("train id", overflow="fold", min_width=12)
    for col in ("stage", "step", "loss", "tok/s", "ETA", "ranks", "ckpt", "updated"):
        table.add_column(col, justify="left" if col in ("stage", "ranks") else "right", no_wrap=True)
    for r in records:
        step = f"{r.step}/{r.steps}" if r.steps else str(r.step)
        eta = (
            "-"
            if r.eta_s is None or r.stage != "train"
            else f"{r.eta_s / 60:.0f} min"
            if r.eta_s >= 60
            else f"{r.eta_s:.0f} s"
        )
        table.add_row(
            r.train_id if r.train_id.startswith(r.drafter) else f"{r.train_id} ({r.drafter})",
            r.stage,
            step,
            "-" if r.loss is None else f"{r.loss:.3f}",
            "-" if r.tokens_per_second is None else f"{r.tokens_per_second:.0f}",
            eta,
            f"{r.ranks} {r.sharding}" if r.sharding != "single" else str(r.ranks),
            "-" if r.checkpoint_step is None else str(r.checkpoint_step),
            r.updated_at[11:19],
        )
    return table
