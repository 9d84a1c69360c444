"""Loading the binary-capture plugin through SGLang's own plugin loader, each case in a fresh
SGLang process (`.venv-sglang`, where `aerie-sglang` is pip-installed: its entry point is real).

- installed is not enabled: without `AERIE_SGLANG_BINARY=1` it hooks nothing;
- on sglang 0.5.23 every hook applies; on another version the plugin refuses, with a message
  that says what to do, and hooks nothing (the server then runs stock and advertises nothing);
- a broken sink configuration refuses to load, naming the variable;
- the back-pressure bound and the reservations of admitted requests.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.services import clean_env
from tests.sglang_server import REPO, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # each case imports SGLang afresh (~10-50 s)

_PRELUDE = """
import importlib.metadata, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
"""


def _run(code: str, env: dict[str, str] | None = None) -> str:

    child_env = {k: v for k, v in clean_env().items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    child_env.update({"SGLANG_PLUGINS": "aerie_capture", "AERIE_SGLANG_BINARY": "1", **(env or {})})
    proc = subprocess.run(
        [str(sglang_python()), "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_plugin_hooks_every_target_on_its_sglang_version_once_enabled():
    out = _run("""
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from aerie_sglang.plugin import HOOKS, register
        os.environ.pop("AERIE_SGLANG_BINARY")
        register()                                    # installed, not enabled: hooks nothing
        print("OFF", [t for t in HOOKS if t in HookRegistry._hooks])
        os.environ["AERIE_SGLANG_BINARY"] = "1"
        load_plugins()
        missing = [t for t in HOOKS if t not in HookRegistry._patched]
        print("MISSING", missing)
        from sglang.srt.utils.common import build_server_info
        print("WRAPPED", hasattr(build_server_info, "__wrapped__"))
    """)
    assert "OFF []" in out and "installed but off: set AERIE_SGLANG_BINARY=1" in out
    assert "MISSING []" in out and "WRAPPED True" in out


def test_the_plugin_refuses_another_sglang_version_and_hooks_nothing():
    out = _run("""
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: "0.5.22" if name == "sglang" else real(name)
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from aerie_sglang.plugin import HOOKS
        load_plugins()
        print("HOOKED", [t for t in HOOKS if t in HookRegistry._hooks])
    """)
    assert "HOOKED []" in out
    assert "aerie_capture plugin refused to load: it hooks sglang==0.5.23 internals and this is sglang==0.5.22" in out
    assert "Install sglang==0.5.23" in out


def test_an_s3_sink_without_credentials_refuses_to_load_naming_the_variables():
    out = _run(
        """
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from aerie_sglang.plugin import HOOKS
        load_plugins()
        print("HOOKED", [t for t in HOOKS if t in HookRegistry._hooks])
        """,
        env={"AERIE_STORE": "http://127.0.0.1:9", "AERIE_S3_ACCESS_KEY": "k"},
    )
    assert "HOOKED []" in out and "AERIE_S3_SECRET_KEY is not set" in out


def test_the_bound_counts_files_queued_captures_and_reservations(tmp_path):
    out = _run(f"""
        import gc
        from pathlib import Path
        from aerie_sglang.plugin.sink import Sinks, CaptureSinkSettings, SinkFull
        sinks = Sinks(CaptureSinkSettings(shm_dir=Path({str(tmp_path)!r}), max_unclaimed_bytes=1000, ttl_s=900))
        class Req: pass
        a, b = Req(), Req()
        sinks.admit(a, 600)
        try:
            sinks.admit(b, 600); print("ADMITTED-OVER")
        except SinkFull as e:
            print("REFUSED", "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES=1000" in str(e))
        del a; gc.collect()                      # an aborted request releases its reservation
        sinks.admit(b, 600); print("ADMITTED-AFTER-RELEASE")
        Path({str(tmp_path)!r}, "x.safetensors").write_bytes(b"0" * 500)   # an unclaimed file
        try:
            sinks.admit(Req(), 100); print("ADMITTED-OVER")
        except SinkFull:
            print("REFUSED-FILE")
        try:
            sinks.admit(Req(), 2000)
        except SinkFull as e:
            print("TOO-BIG", "more than the bound" in str(e))
    """)
    assert "ADMITTED-OVER" not in out
    assert "REFUSED True" in out and "ADMITTED-AFTER-RELEASE" in out and "REFUSED-FILE" in out and "TOO-BIG True" in out
