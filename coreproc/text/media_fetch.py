"""Image bytes from where a chat request points: `data:` URLs, `http(s)://` and `file://`.

Runs where requests come in (the HTTP frontend, in a thread off its event loop; batch mode and the
offline API, inline), for `coreproc.text.media`. Receives a URL and the part it came from
(`messages[0].content[1]`); returns the encoded image, unchecked beyond its size (decoding is the image
process's job). Every refusal is a `RequestError` (HTTP 400) naming the part and the problem: bad
base64, a scheme other than data / http / https / file, a domain not in `--allowed-media-domains`
(checked at every redirect, at most `MAX_REDIRECTS`; without that list, any public host, but none
that resolves to a loopback, private, link-local or otherwise internal address), a fetch past
`--media-fetch-timeout`, more bytes than `--max-image-bytes` (counted while streaming), a file outside
`--allowed-local-media-path`.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

from coreproc.text.openai_protocol import RequestError

MAX_REDIRECTS = 3
SHOWN_URL_CHARS = 80  # of a URL quoted in an error message


def _shown(url: str) -> str:
    return url if len(url) <= SHOWN_URL_CHARS else url[: SHOWN_URL_CHARS - 3] + "..."


def fetch(
    url: str,
    where: str,
    *,
    timeout: float,
    max_bytes: int,
    allowed_domains: frozenset[str] = frozenset(),
    local_root: str | None = None,
) -> bytes:
    """The bytes `url` points at (`allowed_domains` empty: any host; `local_root` None: no file://)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return from_data_url(url, where, max_bytes)
    if scheme in ("http", "https"):
        return from_http(url, where, timeout, max_bytes, allowed_domains)
    if scheme == "file":
        return from_file(url, where, max_bytes, local_root)
    raise RequestError(
        f"{where}: the image URL must be a data:, http(s):// or file:// URL, not {_shown(url)!r}", where
    )


def too_large(where: str, max_bytes: int) -> RequestError:
    return RequestError(f"{where}: the image is larger than {max_bytes} bytes (--max-image-bytes)", where)


def from_data_url(url: str, where: str, max_bytes: int) -> bytes:
    """`data:image/...;base64,...` decoded."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise RequestError(f"{where}: the data URL has no ',' before its data", where)
    params = header[len("data:") :].split(";")
    mime = params[0].strip().lower()
    if not mime.startswith("image/"):
        raise RequestError(f"{where}: the data URL's media type is {mime or 'missing'!r}, not image/*", where)
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise RequestError(f"{where}: only base64 data URLs are taken (data:image/...;base64,...)", where)
    if len(payload) // 4 * 3 > max_bytes + 2:  # before decoding any of it
        raise too_large(where, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the data URL is not valid base64", where) from None
    if len(data) > max_bytes:
        raise too_large(where, max_bytes)
    return data


def _check_host(url: str, where: str, allowed: frozenset[str], hop: int) -> None:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme.lower() not in ("http", "https"):
        raise RequestError(
            f"{where}: the image URL redirects to {_shown(url)!r}, which is not http(s)", where
        )
    host = (parsed.hostname or "").lower()
    if not host:
        raise RequestError(f"{where}: the image URL {_shown(url)!r} names no host", where)
    via = " (after a redirect)" if hop else ""
    if allowed and host not in allowed:
        raise RequestError(
            f"{where}: the image URL's domain {host!r}{via} is not allowed (--allowed-media-domains)", where
        )
    if not allowed and _internal(host, parsed.port):
        raise RequestError(
            f"{where}: the image URL's host {host!r}{via} is an internal address; a server fetches from "
            "it only when --allowed-media-domains names it",
            where,
        )


def _internal(host: str, port: int | None) -> bool:
    """Whether any address `host` resolves to is not a public one (loopback, private, link-local,
    reserved, ...): a request must not make the server reach into its own network."""
    try:
        infos = socket.getaddrinfo(host, port or 80, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False  # unresolvable: the fetch itself fails with a clear message
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if not address.is_global:
            return True
    return False


def from_http(url: str, where: str, timeout: float, max_bytes: int, allowed: frozenset[str]) -> bytes:
    """GET `url`, following at most MAX_REDIRECTS redirects (each host checked), within `timeout`
    seconds in all, refusing more than `max_bytes` as soon as they are announced or received."""
    import httpx

    deadline = time.monotonic() + timeout
    timed_out = RequestError(f"{where}: fetching the image took longer than {timeout:g}s", where)
    try:
        with httpx.Client(follow_redirects=False) as client:
            for hop in range(MAX_REDIRECTS + 1):
                _check_host(url, where, allowed, hop)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timed_out
                with client.stream("GET", url, timeout=left) as r:
                    if r.is_redirect and "location" in r.headers:
                        url = str(r.url.join(r.headers["location"]))
                        continue
                    if r.status_code != 200:
                        raise RequestError(
                            f"{where}: fetching the image failed: HTTP {r.status_code} from {_shown(url)}",
                            where,
                        )
                    return _read_limited(r, where, max_bytes, deadline, timed_out)
    except httpx.TimeoutException:
        raise timed_out from None
    except httpx.HTTPError as e:
        raise RequestError(f"{where}: fetching the image failed: {type(e).__name__}: {e}", where) from None
    raise RequestError(f"{where}: the image URL redirects more than {MAX_REDIRECTS} times", where)


def _read_limited(r: Any, where: str, max_bytes: int, deadline: float, timed_out: RequestError) -> bytes:
    length = r.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large(where, max_bytes)
    body = bytearray()
    for chunk in r.iter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise too_large(where, max_bytes)
        if time.monotonic() > deadline:  # a server that trickles bytes within each read's timeout
            raise timed_out
    return bytes(body)


def from_file(url: str, where: str, max_bytes: int, local_root: str | None) -> bytes:
    """A file under `local_root` (symlinks resolved first, so none leads out of it)."""
    if local_root is None:
        raise RequestError(
            f"{where}: file:// image URLs are refused (the server has no --allowed-local-media-path)", where
        )
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise RequestError(f"{where}: a file:// URL names no host (got {parsed.netloc!r})", where)
    root = Path(local_root).resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise RequestError(f"{where}: the file is outside the allowed local media path", where)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise RequestError(f"{where}: no such file: {parsed.path}", where) from None
    except OSError as e:  # a folder, no permission, ...
        raise RequestError(f"{where}: cannot read {parsed.path}: {e.strerror}", where) from None
    if len(data) > max_bytes:
        raise too_large(where, max_bytes)
    return data
