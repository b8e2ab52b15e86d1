"""HTTP-side settings of `ember serve`, declared once (coreproc.base.options): the `server` flags, defaults.

Runs in the frontend process; imports neither starlette nor torch, so building the CLI stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import ssl
from dataclasses import dataclass, field
from typing import Any

from coreproc.base import options
from coreproc.base.errors import ConfigError
from coreproc.base.options import option
from coreproc.text.chat_features import FEATURE_SECTIONS, ChatFeatures
from coreproc.text.media_config import MEDIA_SECTIONS, MediaConfig
from frontend.http.security import check_keys, check_tls, read_key_file


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP server listens on, whom it lets in, and how it treats slow clients."""

    host: str = option("address to bind (loopback unless you say otherwise)", "127.0.0.1")
    port: int = option("TCP port (0 picks a free one)", 8000)
    served_model_name: str | None = option("model name in the API (default: the folder name)", None)
    api_key: tuple[str, ...] = option(
        "require a bearer key on /v1 routes; repeat the flag for several keys (other users may see a "
        "command line: prefer --api-key-file)",
        (),
        repeat=True,
        metavar="KEY",
    )
    api_key_file: str | None = option(
        "also accept the keys in this file: one a line, blank lines and # comments ignored; it must "
        "not be readable by every user",
        None,
    )
    ssl_keyfile: str | None = option("serve HTTPS: the private key (PEM), with --ssl-certfile", None)
    ssl_certfile: str | None = option("serve HTTPS: the certificate chain (PEM), with --ssl-keyfile", None)
    ssl_ca_certs: str | None = option(
        "with TLS, require client certificates signed by one of these CAs (PEM bundle)", None
    )
    allowed_origins: tuple[str, ...] = option("CORS origins (e.g. '*'; default: none)", ())
    max_request_bytes: int = option("largest request body (413 beyond)", 16 * 2**20)
    chat_template: str | None = option("a Jinja template file (or text) to override the model's", None)
    max_stream_buffer_tokens: int = option(
        "a streaming client that leaves more tokens than this unread is cut off (its request aborted)", 16384
    )
    stream_send_timeout: float = option(
        "seconds a streaming client may take to accept one chunk before it is cut off", 60.0
    )
    request_read_timeout: float = option(
        "seconds a client has to send a whole request (headers and body) from its first byte, and a new "
        "connection to start one; slower ones are closed (slowloris)",
        30.0,
    )
    shutdown_timeout: float = option("on SIGTERM, seconds running requests may take to finish", 30.0)
    enable_lora_runtime_updates: bool = option(
        "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (without it they are 404); "
        "whoever may call them makes the engine read any folder it can reach: set --api-key",
        False,
    )
    api_server_count: int = option(
        "HTTP frontend processes sharing the port (SO_REUSEPORT) and the engine cores: tokenizing, "
        "templating and streaming spread over them",
        1,
    )
    serve_zygote: bool = option(
        "with --load-format ipc_cache, run the server as a fork of `ember preload`'s zygote (its imports "
        "and the preloaded model's tokenizer ready): the fastest warm restart; the server then lives in "
        "the preload's cgroup and limits (on the launcher's CPUs)",
        True,
    )
    features: ChatFeatures = field(default_factory=ChatFeatures)  # the `openai` flags
    media: MediaConfig = field(default_factory=MediaConfig)  # the `media` flags: image input

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):  # ServerConfig(api_key="k"): one key, not one per character
            object.__setattr__(self, "api_key", (self.api_key,))

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def uvicorn_ssl(self) -> dict[str, Any]:
        """uvicorn.Config's TLS keywords (none without TLS)."""
        if not self.tls:
            return {}
        reqs = ssl.CERT_REQUIRED if self.ssl_ca_certs else ssl.CERT_NONE
        return {
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": reqs,
        }


SERVER_SECTIONS: tuple[tuple[str, type], ...] = (("server", ServerConfig), *FEATURE_SECTIONS, *MEDIA_SECTIONS)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    options.add_arguments(p, SERVER_SECTIONS)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server flags as a config, the key file read (its keys join --api-key's) and every security
    flag checked: ConfigError (one line) before the port is taken and the model loads."""
    values = options.collect(args, SERVER_SECTIONS)
    features = ChatFeatures(**{f.name: values[f.name] for f in dataclasses.fields(ChatFeatures)})
    media = MediaConfig(**{f.name: values[f.name] for f in dataclasses.fields(MediaConfig)})
    names = [f.name for f in dataclasses.fields(ServerConfig) if f.name not in ("features", "media")]
    cfg = ServerConfig(**{name: values[name] for name in names}, features=features, media=media)
    if cfg.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1, got {cfg.api_server_count}")
    if cfg.api_key_file is not None:
        cfg = dataclasses.replace(cfg, api_key=cfg.api_key + read_key_file(cfg.api_key_file))
    check_keys(cfg.api_key)
    check_tls(cfg.ssl_keyfile, cfg.ssl_certfile, cfg.ssl_ca_certs)
    return cfg
