"""aerie.sglang_client on a real local HTTP server that records the headers it is sent: the key
only to configured URLs, the /get_ fallbacks, a refusal in one line naming the setting."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from aerie import sglang_client
from aerie.settings import Settings

KEY = "sekrit-key"


@pytest.fixture(scope="module")
def server():
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            auth = self.headers.get("Authorization")
            seen.append((self.path, auth))
            if self.path == "/server_info" or self.path.startswith("/gone/"):  # an older SGLang: only get_ names
                code, body = 404, {"detail": "Not Found"}
            elif self.path == "/health":
                code, body = 200, {}
            elif auth != f"Bearer {KEY}":
                code, body = 401, {"error": "Unauthorized"}
            else:
                code, body = 200, {"path": self.path, "enable_return_aux_hidden_states": True}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_key_goes_only_to_configured_urls(server):
    url, seen = server
    settings = Settings(engine_urls=[url + "/"], engine_api_key=KEY)
    assert sglang_client.api_key_for(settings, url) == KEY
    assert sglang_client.api_key_for(settings, "http://attacker.example:1") is None
    assert sglang_client.api_key_for(Settings(eval_server=url, engine_api_key=KEY), url) == KEY
    assert sglang_client.api_key_for(Settings(regenerate_urls=[url], engine_api_key=KEY), url) == KEY
    elsewhere = url.replace("127.0.0.1", "localhost")  # the same server named by a message
    seen.clear()
    with sglang_client.http_client(settings, elsewhere, 10) as client:
        with pytest.raises(sglang_client.SGLangUnauthorized, match="AERIE_ENGINE_API_KEY"):
            sglang_client.server_info(client, elsewhere)
    assert seen and all(auth is None for _, auth in seen), seen
    with sglang_client.http_client(settings, url, 10) as client:
        assert sglang_client.server_info(client, url)["path"] == "/get_server_info"


def test_call_answers_refuses_and_names_the_setting(server):
    url, _ = server
    assert sglang_client.call(url, "/generate", {"input_ids": [1]}, api_key=KEY)["path"] == "/generate"
    with pytest.raises(sglang_client.SGLangUnauthorized) as e:
        sglang_client.call(url, "/generate", {"input_ids": [1]}, api_key="wrong")
    assert "401" in str(e.value) and "\n" not in str(e.value) and "wrong" not in str(e.value)
    with pytest.raises(sglang_client.SGLangError, match="no answer.*AERIE_EVAL_SERVER"):
        sglang_client.call("http://127.0.0.1:9", "/x", api_key=KEY, timeout_s=2, setting="AERIE_EVAL_SERVER")
    assert sglang_client.healthy(url) and not sglang_client.healthy("http://127.0.0.1:9", timeout_s=2)
    assert isinstance(sglang_client.http_client(Settings(), url, 1), httpx.Client)


def test_errors_carry_their_kind_and_status(server):
    """Callers choose by class and status, never by message text: a 404 (the fallback of an older
    server's names), a server without SGLang's paths (the engine's mismatch), an unreachable one."""
    from aerie_extractor.engines.sglang import EngineMismatch
    from aerie_extractor.engines.sglang import server_info as engine_server_info

    url, _ = server
    with pytest.raises(sglang_client.SGLangError) as e:
        sglang_client.call(url, "/server_info", api_key=KEY)
    assert e.value.status == 404 and not isinstance(e.value, sglang_client.NotSGLang)
    with httpx.Client(headers=sglang_client.auth_headers(KEY)) as client:
        with pytest.raises(sglang_client.NotSGLang, match="not an SGLang server") as e:
            sglang_client.server_info(client, url + "/gone")
        assert e.value.status == 404
        with pytest.raises(EngineMismatch, match="not an SGLang server"):
            engine_server_info(client, url + "/gone")
    with pytest.raises(sglang_client.SGLangError) as e:
        sglang_client.call("http://127.0.0.1:9", "/x", timeout_s=2)
    assert e.value.status is None
