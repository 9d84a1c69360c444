"""The one HTTP client of an SGLang server: auth, timeouts, server info with its fallbacks, JSON calls.

Torch-free (httpx + orjson) so the extractor, the trainer's evaluation, align and `aerie bench`
share it. The bearer token of SGLang's `--api-key` (AERIE_ENGINE_API_KEY) goes ONLY to a URL the
settings configure (AERIE_ENGINE_URLS, AERIE_REGENERATE_URLS, AERIE_EVAL_SERVER): a URL that
arrives in a message (an `aerie.align` request's server) gets no key, so a message cannot make a
worker hand the key to a host of the sender's choosing. A refused key is one line naming
AERIE_ENGINE_API_KEY.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import orjson

from aerie.errors import ExpectedError

if TYPE_CHECKING:
    from aerie.settings import Settings

SERVER_INFO = ("/server_info", "/get_server_info")  # 0.5.23 names first; older servers only the get_ ones
MODEL_INFO = ("/model_info", "/get_model_info")


class SGLangError(ExpectedError, RuntimeError):
    """An SGLang server that cannot be reached, refuses the request, or is not an SGLang server.
    `status`: the HTTP status it answered, None when it did not answer."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SGLangUnauthorized(SGLangError):
    """HTTP 401/403: the server runs with --api-key and the request carried another key or none."""


class NotSGLang(SGLangError):
    """The server answers, but none of the paths an SGLang server serves."""


def _norm(url: str) -> str:
    return url.strip().rstrip("/")


def configured_urls(settings: Settings) -> set[str]:
    """The URLs the operator configured: the only ones the API key is sent to."""
    urls = [*settings.engine_urls, *settings.regenerate_urls]
    if settings.eval_server:
        urls.append(settings.eval_server)
    return {_norm(u) for u in urls}


def api_key_for(settings: Settings, url: str) -> str | None:
    """AERIE_ENGINE_API_KEY when `url` is a configured server, else None (never to a message's URL)."""
    key = settings.engine_api_key
    if key is None or _norm(url) not in configured_urls(settings):
        return None
    return key.get_secret_value()


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_client(settings: Settings, url: str, timeout: float) -> httpx.Client:
    """A client for one server, carrying the key only when `url` is configured."""
    return httpx.Client(timeout=timeout, headers=auth_headers(api_key_for(settings, url)))


def unauthorized(url: str, status: int) -> str:
    return (
        f"SGLang server {url} refused the request (HTTP {status}): it runs with --api-key; "
        "set AERIE_ENGINE_API_KEY to that key"
    )


def get_first(
    client: httpx.Client, url: str, paths: tuple[str, ...], setting: str = "AERIE_ENGINE_URLS"
) -> dict[str, Any]:
    """GET the first of `paths` the server knows; `setting` names where the URL came from."""
    last = None
    for path in paths:
        try:
            r = client.get(url + path)
        except httpx.HTTPError as e:
            raise SGLangError(
                f"SGLang server {url} unreachable ({type(e).__name__}: {e}): is it up? ({setting})"
            ) from e
        if r.status_code in (401, 403):
            raise SGLangUnauthorized(unauthorized(url, r.status_code), r.status_code)
        if r.status_code == 404:
            last = r
            continue
        if r.status_code != 200:
            raise SGLangError(f"SGLang server {url}{path} answered HTTP {r.status_code}: {r.text[:300]}", r.status_code)
        return orjson.loads(r.content)
    status = last.status_code if last is not None else None
    raise NotSGLang(
        f"SGLang server {url} has none of {', '.join(paths)} (HTTP {status}): not an SGLang server?", status
    )


def server_info(client: httpx.Client, url: str, setting: str = "AERIE_ENGINE_URLS") -> dict[str, Any]:
    return get_first(client, url, SERVER_INFO, setting)


def model_info(client: httpx.Client, url: str, setting: str = "AERIE_ENGINE_URLS") -> dict[str, Any]:
    return get_first(client, url, MODEL_INFO, setting)


def call(
    url: str,
    path: str,
    payload: dict[str, Any] | None = None,
    *,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    setting: str = "AERIE_ENGINE_URLS",
) -> dict[str, Any]:
    """One JSON request (GET without a payload, POST with one) -> the decoded answer."""
    url = _norm(url)
    try:
        with httpx.Client(timeout=timeout_s, headers=auth_headers(api_key)) as client:
            if payload is None:
                r = client.get(url + path)
            else:
                r = client.post(url + path, content=orjson.dumps(payload), headers={"content-type": "application/json"})
    except httpx.HTTPError as e:
        raise SGLangError(f"SGLang server {url}: no answer ({type(e).__name__}: {e}): is it up? ({setting})") from None
    if r.status_code in (401, 403):
        raise SGLangUnauthorized(unauthorized(url, r.status_code), r.status_code)
    if r.status_code != 200:
        raise SGLangError(f"SGLang server {url}{path}: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
    return orjson.loads(r.content)


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    """GET /health (it needs no key) answered 200."""
    try:
        return httpx.get(_norm(url) + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
