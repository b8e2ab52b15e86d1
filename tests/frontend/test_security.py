"""Security checks: no pickle on any socket, private sockets, API keys, TLS, exposure warnings.

Unit tests scan the source (AST) of every package for deserializers that run code, check every socket
codec is msgspec, bind ipc sockets under a loose umask (they must come out 0600), refuse loose or
foreign socket directories (the engine's and the preload daemons'), and check the API-key middleware
and the security flags (each a one-line error, no key ever in a message). One end-to-end `ember
serve` runs with a self-signed certificate, two API servers and keys from a flag and a file: HTTPS
only, each key works, a wrong one is 401, and the body and prompt caps hold over TLS. `ember core`
off loopback without CURVE keys is refused.
Run: `pytest -q tests/frontend/test_security.py`.
"""

from __future__ import annotations

import ast
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from starlette.testclient import TestClient

from coreproc.base.errors import ConfigError, EmberError
from coreproc.base.ipc import Codec, bind, check_private_dir, make_runtime_dir, remove_runtime_dir
from coreproc.base.protocol import (
    FROM_WORKER,
    KIND_OF,
    TO_CLIENT,
    TO_CORE,
    TO_WORKER,
    CacheReply,
    CacheRequest,
    ServeExit,
    SpawnReply,
    SpawnServe,
    SpawnWorker,
)
from frontend.cli import build_parser, main
from frontend.http import middleware
from frontend.http.security import check_tls, exposure_warning
from frontend.http.server import build_app
from frontend.http.settings import ServerConfig, server_config
from tests.paths import REPO
from tests.server_util import start_server, stop_server
from workers.weight_cache.fingerprint import check_socket_dir

ROOT = REPO
PACKAGES = ("coreproc", "workers", "frontend", "kernels")
PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
# calls that unpickle what a peer sent: pyzmq's *_pyobj, torch.distributed's *_object* collectives
PICKLING_CALLS = {
    "recv_pyobj",
    "send_pyobj",
    "recv_serialized",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "unsafe_load",
}


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _unsafe(tree: ast.AST) -> list[str]:
    """What in one module's AST can turn bytes from elsewhere into code."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLERS:
            found.append(node.module or "")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, ast.unparse(node.func.value)
            weights_only = _keyword(node, "weights_only")
            if attr in PICKLING_CALLS:
                found.append(f"{owner}.{attr}")
            elif (
                attr == "load"
                and owner == "torch"
                and not (isinstance(weights_only, ast.Constant) and weights_only.value is True)
            ):
                found.append("torch.load without weights_only=True")
            elif attr == "load" and owner in ("np", "numpy") and _keyword(node, "allow_pickle") is not None:
                found.append("numpy.load(allow_pickle=...)")
            elif attr == "load" and owner == "yaml":
                found.append("yaml.load (use yaml.safe_load)")
    return found


@pytest.mark.unit
def test_no_module_can_unpickle_what_a_peer_sends() -> None:
    """Ray pickles its own call arguments (our frames are msgspec bytes inside them): that transport is
    Ray's, documented in docs/SECURITY.md, and needs no import here."""
    modules = _modules()
    assert len(modules) > 100, "the scan must see the packages"
    bad = {str(p.relative_to(ROOT)): u for p in modules if (u := _unsafe(ast.parse(p.read_text())))}
    assert bad == {}
    # the scan itself finds what it looks for
    probe = "import pickle\nfrom dill import loads\ns.recv_pyobj()\n"
    probe += "torch.load(f)\ntorch.load(f, weights_only=True)"
    found = ["pickle", "dill", "s.recv_pyobj", "torch.load without weights_only=True"]
    assert _unsafe(ast.parse(probe)) == found


@pytest.mark.unit
def test_every_socket_message_is_a_msgspec_struct_decoded_by_msgspec() -> None:
    assert all(issubclass(t, msgspec.Struct) for t in KIND_OF)
    for direction in (TO_CORE, TO_CLIENT, TO_WORKER, FROM_WORKER):
        codec = Codec(direction)
        assert all(isinstance(d, msgspec.msgpack.Decoder) for d in codec._decoders.values())
        assert {d.type for d in codec._decoders.values()} == set(direction)
    for typ in (CacheRequest, CacheReply, SpawnWorker, SpawnServe, SpawnReply, ServeExit):  # Unix sockets
        assert issubclass(typ, msgspec.Struct), typ


@pytest.mark.unit
def test_ipc_sockets_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    """Regression: zmq left ipc socket files to the umask (0775 under umask 002: the group could
    connect to the core and submit requests)."""
    run = make_runtime_dir()
    ctx = zmq.Context()
    old = os.umask(0o002)
    try:
        assert os.stat(run).st_mode & 0o777 == 0o700
        for endpoint in (f"ipc://{run}/core", f"ipc://{tmp_path}/core.sock"):
            sock = ctx.socket(zmq.ROUTER)
            bind(sock, endpoint)
            assert os.stat(endpoint[len("ipc://") :]).st_mode & 0o777 == 0o600, endpoint
            sock.close(0)
    finally:
        os.umask(old)
        ctx.term()
        remove_runtime_dir(run)


@pytest.mark.unit
def test_loose_or_foreign_socket_directories_are_refused(tmp_path: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o775)
        shared.chmod(0o775)
        with pytest.raises(EmberError, match="writable by other users"):
            bind(sock, f"ipc://{shared}/core")
        sticky = tmp_path / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)  # like /tmp: others cannot replace our file
        bind(sock, f"ipc://{sticky}/core")
        if os.getuid() == 0:
            foreign = tmp_path / "foreign"
            foreign.mkdir(mode=0o700)
            os.chown(foreign, 65534, 65534)
            with pytest.raises(EmberError, match="owned by uid 65534"):
                bind(sock, f"ipc://{foreign}/core")
            with pytest.raises(EmberError, match="owned by uid 65534"):
                check_private_dir(foreign)
    finally:
        sock.close(0)
        ctx.term()
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(EmberError, match="mode 0o755; want 0700"):
        check_private_dir(loose)
    (tmp_path / "link").symlink_to(make_dir := tmp_path / "private")
    make_dir.mkdir(mode=0o700)
    with pytest.raises(EmberError, match="not a real directory"):
        check_private_dir(tmp_path / "link")


def _app(keys: tuple[str, ...]) -> TestClient:
    return TestClient(build_app(["ipc:///nowhere"], "/models/llama", ServerConfig(api_key=keys)))


@pytest.mark.unit
def test_any_of_several_keys_opens_the_protected_routes() -> None:
    http = _app(("first-key", "second-key"))
    for key in ("first-key", "second-key"):
        r = http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code != 401, key
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer first-key2"},
        {"Authorization": "Bearer first-key second-key"},
        {"Authorization": "Basic first-key"},
        {"Authorization": "first-key"},
    ):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/openapi.json").status_code == 200  # probes and docs stay open


@pytest.mark.unit
def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = middleware.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", counting)
    mw = middleware.ApiKey(lambda *a: None, ("k1", "a-much-longer-key-2", "k3"))  # type: ignore[arg-type]
    for token, ok in ((b"k1", True), (b"k3", True), (b"nope", False), (b"", False)):
        calls.clear()
        assert mw.allows(token) is ok
        assert calls == [32, 32, 32], "every key, and digests of one length"


def _serve_args(*argv: str) -> ServerConfig:
    return server_config(build_parser("serve").parse_args(["serve", *argv]))


@pytest.mark.unit
def test_api_key_flags_and_key_file(tmp_path: Path) -> None:
    assert _serve_args().api_key == ()
    assert _serve_args("--api-key", "a").api_key == ("a",)  # one key, as before
    assert _serve_args("--api-key", "a", "--api-key", "b").api_key == ("a", "b")
    assert ServerConfig(api_key="abc").api_key == ("abc",), "a string is one key, not three"
    keys = tmp_path / "keys"
    keys.write_text("# production\nfile-key-1\n\n  file-key-2  \n")
    keys.chmod(0o600)
    got = _serve_args("--api-key", "a", "--api-key-file", str(keys)).api_key
    assert got == ("a", "file-key-1", "file-key-2")
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    empty.chmod(0o600)
    keys.chmod(0o644)
    for argv, message in (
        (["--api-key", ""], "API key 1 is empty"),  # regression: "" switched the check off
        (["--api-key", "a", "--api-key", "two words"], "API key 2 has spaces"),
        (["--api-key-file", str(keys)], r"readable by every user \(mode 0o644\)"),
        (["--api-key-file", str(empty)], "holds no key"),
        (["--api-key-file", str(tmp_path / "missing")], "No such file"),
    ):
        with pytest.raises(ConfigError, match=message) as e:
            _serve_args(*argv)
        assert "file-key" not in str(e.value) and "two words" not in str(e.value)
    assert exposure_warning("0.0.0.0", has_keys=False) is not None
    assert exposure_warning("::", has_keys=False) is not None
    assert exposure_warning("0.0.0.0", has_keys=True) is None
    assert exposure_warning("127.0.0.1", has_keys=False) is None
    assert exposure_warning("::1", has_keys=False) is None


def _self_signed(directory: Path, name: str = "server") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.crt"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.mark.unit
def test_tls_flags_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    other_key, _ = _self_signed(tmp_path, "other")
    check_tls(str(key), str(cert), None)
    check_tls(None, None, None)
    for args, message in (
        ((str(key), None, None), "go together"),
        ((None, str(cert), None), "go together"),
        ((None, None, str(cert)), "needs --ssl-keyfile"),
        ((str(tmp_path / "nope.key"), str(cert), None), "--ssl-keyfile .*nope.key does not exist"),
        ((str(other_key), str(cert), None), "cannot load them"),
        ((str(key), str(cert), str(key)), "--ssl-ca-certs"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_tls(*args)
    cfg = _serve_args("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(cert))
    assert cfg.tls and cfg.uvicorn_ssl()["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert ServerConfig().uvicorn_ssl() == {}


@pytest.mark.unit
def test_the_cli_says_a_bad_security_flag_in_one_line(llama: str, tmp_path: Path, capsys) -> None:
    key, _ = _self_signed(tmp_path)
    for argv, message in (
        (["--ssl-keyfile", str(key)], "--ssl-keyfile and --ssl-certfile go together"),
        (["--api-key", "secret-one", "--api-key", ""], "API key 2 is empty"),
    ):
        assert main(["serve", llama, "--port", "0", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "secret-one" not in err


@pytest.mark.unit
def test_preload_socket_directories_are_checked_in_one_line(llama: str, tmp_path: Path, capsys) -> None:
    """Regression: a foreign or loose --socket-dir ended `ember preload` with a traceback; a directory
    others may write into (where they could swap the daemon's socket) was accepted."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by other users"):
        check_socket_dir(shared, create=False, strict=False)
    shared.chmod(0o1777)
    check_socket_dir(shared, create=False, strict=False)  # sticky: others cannot replace our files
    shared.chmod(0o777)
    assert main(["preload", llama, "--socket-dir", str(shared), "--wait", "--timeout", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "writable by other users" in err and "\n" not in err


@pytest.fixture(scope="module")
def llama(make_ckpt) -> str:
    return str(make_ckpt("llama"))


@pytest.mark.e2e
def test_core_off_loopback_without_curve_keys_is_refused(llama: str) -> None:
    cmd = [sys.executable, "-m", "frontend.cli", "core", llama, "--listen", "tcp://0.0.0.0:0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "reachable from other hosts: give --curve-keys" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_a_running_engine_s_sockets_are_0600_under_umask_002(llama: str, tmp_path: Path) -> None:
    """The core, worker and launcher sockets of a live engine (children inherit the umask)."""
    from coreproc.base.config import EngineConfig
    from coreproc.startup.launcher import CoreProcess

    old = os.umask(0o002)
    try:
        config = EngineConfig.create(llama, dtype="float32")
        with CoreProcess(config, listen=f"ipc://{tmp_path}/core.sock") as core:
            sockets = [p for p in [*core.runtime_dir.iterdir(), tmp_path / "core.sock"] if p.is_socket()]
            assert {p.name for p in sockets} >= {"core.sock", "workers", "launcher"}
            assert {p.name: p.stat().st_mode & 0o777 for p in sockets} == {p.name: 0o600 for p in sockets}
            assert core.runtime_dir.stat().st_mode & 0o777 == 0o700
    finally:
        os.umask(old)


@pytest.mark.e2e
def test_https_with_keys_from_flag_and_file_on_two_api_servers(llama: str, tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    keys = tmp_path / "keys"
    keys.write_text("# the file's key\nfile-key\n")
    keys.chmod(0o600)
    trust = ssl.create_default_context(cafile=str(cert))
    proc, url = start_server(
        llama,
        *("--ssl-keyfile", str(key), "--ssl-certfile", str(cert)),
        *("--api-key", "flag-key", "--api-key-file", str(keys)),
        *("--api-server-count", "2", "--max-request-bytes", "20000", "--max-model-len", "128"),
        verify=trust,
    )
    try:
        assert url.startswith("https://127.0.0.1:")
        with pytest.raises(httpx.HTTPError):  # no clear-text HTTP on the port
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # an untrusted certificate is not accepted silently
            httpx.get(f"{url}/health", timeout=5)
        for i in range(8):  # new connections: the kernel spreads them over both API servers
            with httpx.Client(base_url=url, verify=trust, timeout=30) as http:
                key_used = ("flag-key", "file-key")[i % 2]
                ok = http.get("/v1/models", headers={"Authorization": f"Bearer {key_used}"})
                assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "llama"
                assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        auth = {"Authorization": "Bearer file-key"}
        with httpx.Client(base_url=url, verify=trust, timeout=30, headers=auth) as http:
            r = http.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            r = http.post("/v1/completions", json={"model": "llama", "prompt": [5] * 200, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", "longer than the context"
            r = http.post("/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 1000})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

            def chunks():  # no Content-Length: the limit is counted as the body arrives
                yield b'{"model": "llama", "prompt": "'
                for _ in range(30):
                    yield b"x" * 1000
                yield b'"}'

            r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    finally:
        stop_server(proc)
