"""aerie.app.launcher: the one SGLang server launcher (bench's sweep, the tests, the benchmarks),
checked with a stand-in server process (a /health endpoint and a child) — the real SGLang path
runs through tests/sglang_server.py in the sglang tests."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from aerie.app import launcher

STARTED = time.time()

# --port P --host H appended by the launcher; a child in the same group, whose pid is printed
FAKE = r"""
import http.server, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (reaped by nobody here) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("graceful", [False, True])
def test_a_server_is_healthy_inside_the_block_and_its_whole_group_gone_after(tmp_path, graceful):
    log = tmp_path / "server.log"
    with launcher.launch([sys.executable, "-c", FAKE], timeout_s=30, log_path=log, graceful=graceful) as server:
        assert server.cmd[-4:] == ["--host", "127.0.0.1", "--port", str(server.port)]
        assert httpx.get(server.url + "/health").status_code == 200 and server.start_s > 0
        deadline = time.monotonic() + 10
        while "child" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(server.log_tail().split("child")[1].split()[0])
        assert alive(child) and alive(server.process.pid)
    assert server.process.poll() is not None
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the server's child outlived the block"


def test_a_server_that_dies_first_or_never_answers_raises_with_its_log(tmp_path):
    dying = [sys.executable, "-c", "import sys; print('bad flag --xyz'); sys.exit(3)"]
    with pytest.raises(launcher.LaunchError, match=r"exited with 3 before it was healthy(.|\n)*bad flag --xyz"):
        launcher.start(dying, timeout_s=30, log_path=tmp_path / "a.log")
    silent = [sys.executable, "-c", "import time; print('loading'); time.sleep(600)"]
    started = time.monotonic()
    with pytest.raises(launcher.LaunchError, match=r"not healthy after 2 s(.|\n)*loading"):
        launcher.start(silent, timeout_s=2, log_path=tmp_path / "b.log")
    assert time.monotonic() - started < 20
    with pytest.raises(launcher.LaunchError, match="could not start"):
        launcher.start(["/nonexistent/sglang"], timeout_s=2, log_path=tmp_path / "c.log")


def test_free_ports_are_free():
    import socket

    port = launcher.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if something held it


def test_a_server_started_again_on_its_port_answers_there(tmp_path):
    """`port`: a restarted server where its clients expect it (the deploy tests restart SGLang)."""
    with launcher.launch([sys.executable, "-c", FAKE], timeout_s=30, log_path=tmp_path / "a.log") as first:
        port = first.port
    with launcher.launch([sys.executable, "-c", FAKE], timeout_s=30, log_path=tmp_path / "b.log", port=port) as again:
        assert again.port == port and httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


# reports its argv and what SGLang's ConfigArgumentMerger would read from --config (YAML), the file's
# mode and its folder's, then serves /health; a child in its group
KEYED = r"""
import http.server, json, os, stat, subprocess, sys
import yaml
argv = sys.argv[1:]
path = argv[argv.index("--config") + 1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(json.dumps({"argv": argv, "config": yaml.safe_load(open(path)), "path": path,
                  "mode": stat.S_IMODE(os.stat(path).st_mode),
                  "folder": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)}), flush=True)
port = int(argv[argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
KEY = 'k3y-with-\'quote-"double"-$dollar-\\back-: colon #hash'


def _cmdlines(pgid: int) -> list[str]:
    found = []
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            try:
                if os.getpgid(int(proc)) == pgid:
                    with open(f"/proc/{proc}/cmdline", "rb") as f:
                        found.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except (OSError, ProcessLookupError):
                pass
    return found


def test_the_api_key_goes_in_a_private_yaml_file_that_is_gone_once_the_server_runs(tmp_path):
    """The key as compose and k8s hand it to SGLang: a `.yaml` --config file (SGLang refuses another
    suffix) only this user reads, in a folder only this user enters, read back as the same key; in
    no command line of the server's group; the file removed once the server is healthy."""
    import json

    server = launcher.begin([sys.executable, "-c", KEYED], log_path=tmp_path / "s.log", api_key=KEY)
    try:
        assert server.key_file is not None and server.key_file.is_file()
        server.wait_healthy(30)
        report = json.loads(next(line for line in server.log_tail().splitlines() if line.startswith("{")))
        assert report["config"] == {"api-key": KEY}
        assert oct(server.log_path.stat().st_mode)[-3:] == "600"  # SGLang logs its arguments
        assert report["path"].endswith(".yaml") and report["mode"] == 0o600 and report["folder"] == 0o700
        assert "--config" in report["argv"] and not [a for a in report["argv"] if "k3y" in a]
        lines = _cmdlines(server.process.pid)
        assert len(lines) == 2 and not [line for line in lines if "k3y" in line], lines
        assert server.key_file is None and not os.path.exists(os.path.dirname(report["path"]))
    finally:
        server.stop()
    # a server that never gets healthy leaves no key behind either
    silent = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(launcher.LaunchError):
        launcher.start(silent, timeout_s=1, log_path=tmp_path / "b.log", api_key=KEY)
    assert not [p for p in Path(tempfile.gettempdir()).glob("aerie-sglang-key-*") if p.stat().st_mtime > STARTED]
