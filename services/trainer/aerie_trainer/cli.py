"""Click commands the project CLI registers: `pull NAME[:VERSION] DEST`."""

from __future__ import annotations

import click


@click.command("pull")
@click.argument("ref", metavar="NAME[:VERSION]")
@click.argument("dest", type=click.Path(file_okay=False))
def pull(ref: str, dest: str) -> None:
    """Fetch a published drafter (default: its latest version) into DEST."""
    from aerie.settings import Settings
    from aerie.store import open_store

    from aerie_trainer.export import pull as pull_drafter, resolve

    store = open_store(Settings.load())
    name, version = resolve(store, ref)
    path = pull_drafter(store, f"{name}:{version}", dest)
    click.echo(f"drafter {name}:{version} -> {path}")


if __name__ == "__main__":
    pull()
