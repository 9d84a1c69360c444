"""A minimal S3 client (AWS Signature V4, standard library only) for the capture sink.

SGLang's environment has no S3 SDK, and the plugin adds no dependency to it: PUT, DELETE and a
listing of the capture prefix (for the bound and the TTL) are all the sink needs. Works against
MinIO, SeaweedFS and AWS S3 (path-style URLs).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import http.client
import urllib.parse
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class S3Error(RuntimeError):
    pass


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    modified: float  # seconds since the epoch (the server's Last-Modified)


def _sign(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class S3Client:
    """Path-style S3 requests against one endpoint (`http(s)://host:port`)."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, region: str = "us-east-1"):
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise S3Error(f"S3 endpoint {endpoint!r} is not http(s)://host:port")
        self.endpoint = endpoint.rstrip("/")
        self._https = url.scheme == "https"
        self._host = url.netloc
        self._access = access_key
        self._secret = secret_key
        self._region = region
        self._conn: http.client.HTTPConnection | None = None

    def _headers(
        self, method: str, path: str, payload_sha256: str, extra: dict[str, str], query: str = ""
    ) -> dict[str, str]:
        now = _dt.datetime.now(_dt.UTC)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": self._host, "x-amz-content-sha256": payload_sha256, "x-amz-date": amz_date}
        headers.update({k.lower(): v for k, v in extra.items()})
        names = sorted(headers)
        canonical = "\n".join(
            [
                method,
                path,
                query,
                "".join(f"{n}:{headers[n].strip()}\n" for n in names),
                ";".join(names),
                payload_sha256,
            ]
        )
        scope = f"{day}/{self._region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = _sign(_sign(_sign(_sign(f"AWS4{self._secret}".encode(), day), self._region), "s3"), "aws4_request")
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self._access}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return headers

    def _request(
        self,
        method: str,
        bucket: str,
        key: str,
        body: Sequence[memoryview | bytes] = (),
        payload_sha256: str = _EMPTY_SHA256,
        extra: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> bytes:
        path = "/" + urllib.parse.quote(f"{bucket}/{key}" if key else bucket, safe="/-_.~")
        query = "&".join(
            f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
            for k, v in sorted((params or {}).items())
        )
        extra = dict(extra or {})
        length = sum(len(memoryview(b).cast("B")) for b in body)
        if method == "PUT":
            extra["content-length"] = str(length)
        headers = self._headers(method, path, payload_sha256, extra, query)
        for attempt in (0, 1):  # a pooled keep-alive connection may have been closed by the server
            if self._conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = cls(self._host, timeout=60)
            try:
                self._conn.putrequest(
                    method, path + (f"?{query}" if query else ""), skip_host=True, skip_accept_encoding=True
                )
                for name, value in headers.items():
                    self._conn.putheader(name, value)
                self._conn.endheaders()
                for part in body:
                    self._conn.send(part)
                response = self._conn.getresponse()
                text = response.read()
                if response.status >= 300:
                    raise S3Error(f"S3 {method} {self.endpoint}{path}: HTTP {response.status} {text[:300]!r}")
                return text
            except (http.client.HTTPException, OSError):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def put(self, bucket: str, key: str, parts: Sequence[memoryview | bytes], payload_sha256: str) -> None:
        """Upload the concatenation of `parts` (sha256 of that concatenation given)."""
        self._request("PUT", bucket, key, parts, payload_sha256, {"content-type": "application/octet-stream"})

    def delete(self, bucket: str, key: str) -> None:
        self._request("DELETE", bucket, key)

    def list(self, bucket: str, prefix: str) -> list[S3Object]:
        """Every object under `prefix` (ListObjectsV2, page by page)."""
        objects, token = [], None
        while True:
            params = {"list-type": "2", "prefix": prefix, **({"continuation-token": token} if token else {})}
            root = ElementTree.fromstring(self._request("GET", bucket, "", params=params))
            for item in root.iterfind("{*}Contents"):
                modified = _dt.datetime.fromisoformat(item.findtext("{*}LastModified", "").replace("Z", "+00:00"))
                objects.append(
                    S3Object(item.findtext("{*}Key", ""), int(item.findtext("{*}Size", "0")), modified.timestamp())
                )
            token = root.findtext("{*}NextContinuationToken")
            if root.findtext("{*}IsTruncated") != "true" or not token:
                return objects

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
