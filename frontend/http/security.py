"""Checks on `ember serve`'s security flags: API keys (flags and a key file), TLS files, exposure.

Runs in the frontend process (and in each `--api-server-count` child, which re-reads the same flags),
before the port is taken and the model loads, so a wrong flag costs one line and exit status 2. Keys
are never printed: no message here quotes one. Imports neither starlette nor uvicorn.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import stat
from pathlib import Path

from coreproc.base.errors import ConfigError

# what may appear in an `Authorization: Bearer` header: printable ASCII without spaces
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys in `path`, one a line (blank lines and # comments ignored). ConfigError if the file is
    missing, readable by every user, or holds no key."""
    try:
        info = os.stat(path)
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--api-key-file {path}: {getattr(e, 'strerror', None) or e}") from None
    if info.st_mode & stat.S_IROTH:
        mode = oct(info.st_mode & 0o777)
        raise ConfigError(f"--api-key-file {path} is readable by every user (mode {mode}); chmod 600 it")
    lines = (line.strip() for line in text.splitlines())
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key (one a line; # starts a comment)")
    return keys


def check_keys(keys: tuple[str, ...]) -> None:
    """ConfigError for a key a client could not send (empty: it would have switched the check off)."""
    for i, key in enumerate(keys, start=1):
        if not key:
            raise ConfigError(f"API key {i} is empty (an empty --api-key would leave the server open)")
        if not set(key) <= _KEY_CHARS:
            raise ConfigError(f"API key {i} has spaces or characters outside printable ASCII")


def check_tls(keyfile: str | None, certfile: str | None, ca_certs: str | None) -> None:
    """ConfigError unless the TLS flags make a server context: both of key and certificate or neither,
    each readable, the key matching the certificate, the CA bundle (client certificates) loadable."""
    if (keyfile is None) != (certfile is None):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    if ca_certs is not None and certfile is None:
        raise ConfigError("--ssl-ca-certs (client certificates) needs --ssl-keyfile and --ssl-certfile")
    if keyfile is None or certfile is None:
        return
    files = (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs))
    for flag, path in files:
        if path is not None and not os.access(path, os.R_OK):
            why = "does not exist" if not os.path.exists(path) else "is not readable"
            raise ConfigError(f"{flag} {path} {why}")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"--ssl-certfile / --ssl-keyfile: cannot load them ({e.strerror or e})") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-ca-certs {ca_certs}: cannot load it ({e.strerror or e})") from None


def is_loopback_host(host: str) -> bool:
    """True for `localhost` and loopback addresses (what only this machine can reach)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, has_keys: bool) -> str | None:
    """A warning line when the server is reachable from other machines and asks no key."""
    if is_loopback_host(host) or has_keys:
        return None
    return (
        f"ember serve: WARNING: listening on {host} with no --api-key: anyone who can reach this port "
        "can run requests (see docs/SECURITY.md)"
    )
