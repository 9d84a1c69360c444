"""`aerie`: the user's command line. Services add their sub-commands through the `aerie.commands`
entry point group (as Celery's `celery.commands`), so this module imports none of them.

    aerie run                 the whole pipeline on the embedded default (the README's main job)
    aerie capture-ids         capture points -> the layer ids an engine must be given
    aerie pull NAME[:VER] D   fetch a published drafter (this package alone: no torch)
    aerie logs TRAIN_ID D     copy a training's TensorBoard files from the store into D
    aerie bench --url U       acceptance length of a drafter served by any SGLang server
    aerie train ...           the train stage in this process (the trainer package registers it)
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from importlib.metadata import entry_points

import click


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures a user causes and can fix (settings, credentials, unreachable services, refused
    names, bad inputs): one line naming the cause, no traceback (`aerie --debug ...` shows it).
    Services mark theirs with aerie.errors.ExpectedError."""
    from aerie.capture import CaptureError
    from aerie.datasets import DatasetRefused
    from aerie.drafters import DrafterError
    from aerie.errors import ExpectedError
    from aerie.presets import PresetError
    from aerie.queue import QueueError
    from aerie.runs import RunError
    from aerie.settings import SettingsError
    from aerie.stages import StageUnavailable
    from aerie.store import StoreError
    from aerie.target import TargetError

    return (
        CaptureError,
        DatasetRefused,
        DrafterError,
        ExpectedError,
        PresetError,
        QueueError,
        RunError,
        SettingsError,
        StageUnavailable,
        StoreError,
        TargetError,
    )


def one_line(error: Exception, debug: bool) -> click.ClickException | None:
    """The one-line form of an expected failure; None for a bug or with --debug (re-raise it)."""
    if debug or not isinstance(error, expected_errors()):
        return None
    return click.ClickException(" ".join(str(error).split()))


def one_line_failures(command: Callable) -> Callable:
    """For a command outside the `aerie` group (the Celery sub-commands): a --debug flag, and its
    expected failures as one line (exit 1) instead of a traceback. Put it above @click.pass_context."""

    @click.option("--debug", is_flag=True, help="show the traceback of a failure instead of one line")
    @functools.wraps(command)
    def run(*args, debug: bool = False, **kwargs):
        try:
            return command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:
            short = one_line(e, debug)
            if short is None:
                raise
            raise short from None

    return run


class _Group(click.Group):
    """Loads service commands from entry points only when asked for; expected failures print one line."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:
            short = one_line(e, bool(ctx.params.get("debug")))
            if short is None:
                raise
            raise short from None

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
@click.option(
    "--engine", default="sglang", show_default=True, type=click.Choice(["sglang", "vllm", "speculators", "hf"])
)
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
        click.echo(
            json.dumps(
                {"architecture": arch, "num_layers": n, "capture_points": pts, "convention": conv, "layer_ids": ids}
            )
        )
    elif engine == "sglang":
        click.echo(" ".join(str(i) for i in ids))
    else:
        click.echo(",".join(str(i) for i in ids))


@main.command("pull")
@click.argument("ref", metavar="NAME[:VERSION]")
@click.argument("dest", type=click.Path(file_okay=False))
def pull(ref: str, dest: str) -> None:
    """Fetch a published drafter (default: its latest version) into DEST."""
    from aerie.drafters import pull as pull_drafter
    from aerie.drafters import resolve
    from aerie.settings import Settings
    from aerie.store import open_store

    store = open_store(Settings.load())
    name, version = resolve(store, ref)
    path = pull_drafter(store, f"{name}:{version}", dest)
    click.echo(f"drafter {name}:{version} -> {path}")


@main.command("logs")
@click.argument("train_id", metavar="TRAIN_ID")
@click.argument("dest", type=click.Path(file_okay=False))
def logs(train_id: str, dest: str) -> None:
    """Copy a training's TensorBoard files (the train id `progress` shows) from the store into
    DEST, for `tensorboard --logdir DEST`."""
    from pathlib import Path

    from aerie import layout
    from aerie.settings import Settings
    from aerie.store import open_store

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", train_id):
        raise click.BadParameter(f"{train_id!r} is not a train id (as `progress` shows it)", param_hint="TRAIN_ID")
    prefix = layout.train_logs_prefix(train_id)
    store = open_store(Settings.load())
    names = [key.removeprefix(prefix) for key in store.list(prefix)]
    names = [n for n in names if "/" not in n and n.startswith("events.out.tfevents.")]  # nothing escapes DEST
    if not names:
        raise click.ClickException(f"no TensorBoard files of training {train_id!r} in {store.url}/{prefix}")
    folder = Path(dest)
    for name in names:
        store.download(layout.train_log(train_id, name), folder / name)
    click.echo(f"{len(names)} TensorBoard file(s) of {train_id} -> {folder}: tensorboard --logdir {folder}")


@main.group("model")
def model() -> None:
    """The packaged target models."""


@model.command("prepare")
@click.argument("name", metavar="NAME")
def model_prepare(name: str) -> None:
    """Prepare the packaged model NAME (smollm2-135m) in AERIE_CACHE_DIR, once, and print its
    folder: the one to pass to --model (its training preset has the same name)."""
    from aerie.target import PACKAGED, TargetError, default_cache_dir

    if name not in PACKAGED:
        raise TargetError(f"no packaged model {name!r}: the packaged ones are {', '.join(PACKAGED)}")
    click.echo(PACKAGED[name](default_cache_dir()))


if __name__ == "__main__":
    main()
