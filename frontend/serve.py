"""`ember serve [MODEL]`: start the engine core, then the HTTP server in front of it.

Runs in the frontend process. The listening socket is bound first (a taken port fails at once, before
the model loads), then `ember-core` and its workers start and report ready, then uvicorn (uvloop)
serves the Starlette app on that socket. Ctrl-C / SIGTERM: uvicorn drains, then the core is stopped.
"""

from __future__ import annotations

import argparse
import logging
import socket

from coreproc.config import EngineConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: folder name)")
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1 routes")
    p.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (e.g. '*')")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20)
    p.add_argument(
        "--chat-template", default=None, help="a Jinja template file (or text) to override the model's"
    )
    p.add_argument("--shutdown-timeout", type=float, default=30.0)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def describe_engine(address: str) -> str:
    """One line for the operator: model, weight memory by dtype, load and quantization time."""
    from coreproc.client import EngineClient

    with EngineClient(address) as client:
        info = client.info_cache
    weights = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(info.weight_bytes_by_dtype.items()))
    return (
        f"ember serve: {info.model} (quantization {info.quantization or 'none'}): weights {weights} "
        f"from {info.weight_source}; loaded in {info.load_seconds:.2f}s, "
        f"quantized in {info.quantize_seconds:.2f}s; "
        f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens"
    )


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    import uvicorn

    from coreproc.launcher import CoreProcess
    from frontend.api_server import ServerConfig, build_app

    cfg = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        allowed_origins=tuple(args.allowed_origins),
        max_request_bytes=args.max_request_bytes,
        chat_template=args.chat_template,
    )
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    with CoreProcess(config, shutdown_timeout=args.shutdown_timeout) as core:
        print(describe_engine(core.address), flush=True)
        app = build_app(core.address, config.model.model, cfg)
        level = logging.getLevelName(logging.getLogger().level).lower()
        server = uvicorn.Server(
            uvicorn.Config(
                app, loop="uvloop", log_level=level, timeout_graceful_shutdown=args.shutdown_timeout
            )
        )
        print(f"ember serve: listening on http://{host}:{port}", flush=True)
        server.run(sockets=[sock])
    return 0
