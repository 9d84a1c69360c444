"""`aerie`: the user's command line. Services add their sub-commands through the `aerie.commands`
entry point group (as Celery's `celery.commands`), so this module imports none of them.

    aerie run                 the whole pipeline on the embedded default (the README's main job)
    aerie capture-ids         capture points -> the layer ids an engine must be given
    aerie pull NAME[:VER] D   fetch a published drafter (this package alone: no torch)
    aerie bench --url U       acceptance length of a drafter served by any SGLang server
    aerie train ...           the train stage in this process (the trainer package registers it)
"""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import click


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures a user causes and can fix (settings, credentials, unreachable services, refused
    names, bad inputs): one line naming the cause, no traceback (`aerie --debug ...` shows it)."""
    from aerie.capture import CaptureError
    from aerie.drafters import DrafterError
    from aerie.queue import QueueError
    from aerie.runs import RunError
    from aerie.settings import SettingsError
    from aerie.stages import StageUnavailable
    from aerie.store import StoreError
    from aerie.target import TargetError

    return (CaptureError, DrafterError, QueueError, RunError, SettingsError, StageUnavailable, StoreError, TargetError)


class _Group(click.Group):
    """Loads service commands from entry points only when asked for; expected failures print one line."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:
            if ctx.params.get("debug") or not isinstance(e, expected_errors()):
                raise
            raise click.ClickException(" ".join(str(e).split())) from None

    def _plugins(self) -> dict:
        return {ep.name: ep for ep in entry_points(group="aerie.commands")}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        ep = self._plugins().get(name)
        return ep.load() if ep is not None else None


@click.group(cls=_Group)
@click.version_option(package_name="aerie")
@click.option("--debug", is_flag=True, help="show the traceback of a failure instead of one line")
def main(debug: bool) -> None:
    """aerie: EAGLE-3 drafters trained on hidden states taken through the serving engine."""


@main.command("capture-ids")
@click.option("--model", "model", required=True, help="target model folder (config.json)")
@click.option("--points", default=None, help="capture points, e.g. 2,30,58 (default [2, N//2, N-3])")
@click.option("--engine", default="sglang", show_default=True, type=click.Choice(["sglang", "vllm", "speculators", "hf"]))
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the flag line")
def capture_ids(model: str, points: str | None, engine: str, as_json: bool) -> None:
    """Translate capture points into the layer ids ENGINE must be told to capture."""
    from aerie.capture import convention_for, default_capture_points, to_engine_ids
    from aerie.target import load_config

    cfg = load_config(model)
    n, arch = int(cfg["num_hidden_layers"]), (cfg.get("architectures") or ["?"])[0]
    pts = [int(p) for p in points.split(",")] if points else default_capture_points(n)
    conv = convention_for(engine, arch)
    ids = to_engine_ids(pts, conv, n)
    if as_json:
        click.echo(json.dumps({"architecture": arch, "num_layers": n, "capture_points": pts, "convention": conv, "layer_ids": ids}))
    elif engine == "sglang":
        click.echo(" ".join(str(i) for i in ids))
    else:
        click.echo(",".join(str(i) for i in ids))


@main.command("pull")
@click.argument("ref", metavar="NAME[:VERSION]")
@click.argument("dest", type=click.Path(file_okay=False))
def pull(ref: str, dest: str) -> None:
    """Fetch a published drafter (default: its latest version) into DEST."""
    from aerie.drafters import pull as pull_drafter, resolve
    from aerie.settings import Settings
    from aerie.store import open_store

    store = open_store(Settings.load())
    name, version = resolve(store, ref)
    path = pull_drafter(store, f"{name}:{version}", dest)
    click.echo(f"drafter {name}:{version} -> {path}")


if __name__ == "__main__":
    main()
