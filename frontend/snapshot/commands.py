"""`ember snapshot create/restore/inspect`: CRIU checkpoints of a fully initialized `ember serve`.

Runs in the user's shell. `create` checks the request can be snapshotted (preflight), starts `ember
serve --snapshot-park` in its own PID namespace and session (so restores never need the same PIDs)
with output appended to DIR/logs/serve.log, waits until it has answered the canary and parked,
refuses io_uring descriptors and established external TCP connections, dumps the tree with CRIU into
DIR/images, then writes DIR/manifest.json complete. Any failure kills the tree and removes DIR.
`restore` checks the manifest (complete, same machine and software, same model) and that the port is
free, writes DIR/state/handoff.json with the address, restores detached, and succeeds only once the
canary over HTTP matches. The CRIU calls and the tree launch sit behind `SnapshotTools` so tests can
replace them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from coreproc.base import trace
from coreproc.base.errors import EmberError
from frontend.atomic_files import write_json_atomic
from frontend.canary import CANARY_PROMPT, canary_request, canary_result
from frontend.http.listen import bind
from frontend.snapshot.criu import (
    SnapshotTools,
    dump_problems,
    keep_logs,
    kill_tree,
    ns_init,
    parse_serve_args,
    preflight,
)
from frontend.snapshot.manifest import (
    Canary,
    Manifest,
    SnapshotError,
    differences,
    folder_changes,
    host_identity,
    model_files,
    now,
    read_manifest,
    relevant_environment,
    write_manifest,
)

LOGPROB_TOLERANCE = 1e-3
WEIGHT_MODES = ("mapped", "image")
RESTORE = "ember snapshot restore"  # the controller's name in a start-up trace
MAX_SOCKET_DIR = 70  # an IPC path (dir + /ember-XXXXXXXX/launcher) must stay under 108 bytes


@dataclass(frozen=True)
class Layout:
    """The files of one snapshot directory."""

    root: Path

    @property
    def images(self) -> Path:  # CRIU's image files
        return self.root / "images"

    @property
    def state(self) -> Path:  # canary.json, handoff.json, restore.lock
        return self.root / "state"

    @property
    def logs(self) -> Path:  # serve.log (every restored copy appends to it)
        return self.root / "logs"

    @property
    def weights(self) -> Path:  # the mapped weights ("mapped" mode)
        return self.root / "weights"

    @property
    def work(self) -> Path:  # CRIU's logs and pid files
        return self.root / "work"

    @property
    def runtime_base(self) -> Path:
        """Where the engine's IPC sockets live; must still be there (or be recreated) at restore."""
        short = self.root / "run"
        if len(str(short)) <= MAX_SOCKET_DIR:
            return short
        import hashlib

        return Path("/tmp") / f"ember-snapshot-{hashlib.sha256(str(self.root).encode()).hexdigest()[:12]}"


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------- create


def create(
    snapshot_dir: Path,
    serve_argv: list[str],
    tools: SnapshotTools,
    timeout: float = 600.0,
    weights: str = "mapped",
) -> Manifest:
    """Snapshot a parked `ember serve SERVE_ARGV` into `snapshot_dir` (which must be new or empty).
    `weights`: "mapped" keeps them in DIR/weights (mapped again on restore; a smaller image, a faster
    restore, pages shared by every restored copy), "image" puts them inside the CRIU image."""
    if weights not in WEIGHT_MODES:
        raise SnapshotError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, not {weights!r}")
    args = parse_serve_args(serve_argv)
    reasons, config = preflight(args, tools)
    if reasons:
        raise SnapshotError("cannot snapshot: " + "; ".join(reasons))
    root = snapshot_dir.resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise SnapshotError(f"{root} exists and is not an empty directory")
    model_dir = config.model.model
    layout = Layout(root)
    proc = None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)  # the image and weights hold the model and the process's memory
        for d in (layout.images, layout.state, layout.logs, layout.work, layout.weights):
            d.mkdir(exist_ok=True)
        layout.runtime_base.mkdir(mode=0o700, parents=True, exist_ok=True)
        manifest = Manifest(
            created_at=now(),
            identity=host_identity(tools.version()),
            snapshot_dir=str(root),
            model=model_files(model_dir),
            argv=list(serve_argv),
            cwd=os.getcwd(),
            environment=relevant_environment(),
            host=args.host,
            port=args.port,
            mode="mapped" if weights == "mapped" else "full",
            adapters={name: model_files(path) for name, path in config.lora.modules()},
        )
        write_manifest(root, manifest)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(layout.runtime_base), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "frontend.cli", "serve", *serve_argv]
        argv += ["--snapshot-park", str(layout.state)]
        if weights == "mapped":
            argv += ["--weights-file", str(layout.weights / "rank0.bin")]
        if args.load_format == "ipc_cache":  # workers forked by the zygote would be outside the tree
            argv += ["--no-worker-zygote"]
        started = time.perf_counter()
        proc = tools.launch(argv, env, manifest.cwd, layout.logs / "serve.log")
        canary = _wait_parked(proc, layout, timeout)
        init_seconds = time.perf_counter() - started
        pid = ns_init(proc)
        if pid is None:
            raise SnapshotError("the engine's process tree disappeared before the dump")
        problems, internal_tcp = dump_problems(pid)
        if internal_tcp and not shutil.which("iptables"):
            problems.append("TCP connections inside the tree need --tcp-established, which needs iptables")
        if problems:
            raise SnapshotError("cannot dump: " + "; ".join(problems))
        started = time.perf_counter()
        tools.dump(pid, layout.images, layout.work, "dump.log", tcp_established=internal_tcp)
        dump_seconds = time.perf_counter() - started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        manifest = msgspec.structs.replace(
            manifest,
            complete=True,
            runtime_dir=canary.pop("runtime_dir"),
            canary=Canary(prompt=CANARY_PROMPT, **canary),
            init_seconds=round(init_seconds, 3),
            dump_seconds=round(dump_seconds, 3),
            image_bytes=sum(f.stat().st_size for f in layout.images.iterdir()),
            weights=model_files(str(layout.weights)) if weights == "mapped" else None,
        )
        write_manifest(root, manifest)
        return manifest
    except BaseException as e:
        if proc is not None:
            kill_tree(proc)
        kept = keep_logs([layout.logs, layout.work])  # the error names them: they outlive the snapshot
        shutil.rmtree(root, ignore_errors=True)
        if layout.runtime_base != root / "run":
            shutil.rmtree(layout.runtime_base, ignore_errors=True)
        if isinstance(e, SnapshotError) and kept is not None:
            said = str(e).replace(str(layout.work), str(kept)).replace(str(layout.logs), str(kept))
            raise SnapshotError(f"{said} (logs kept in {kept})" if said == str(e) else said) from None
        raise


def _wait_parked(proc: subprocess.Popen, layout: Layout, timeout: float) -> dict:
    """The canary the parked server wrote (token_id, text, logprob, runtime_dir, pid)."""
    path = layout.state / "canary.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise SnapshotError(
                f"ember serve exited ({proc.returncode}) before parking: {_tail(layout.logs / 'serve.log')}"
            )
        if time.monotonic() > deadline:
            raise SnapshotError(f"ember serve did not park within {timeout:.0f}s")
        time.sleep(0.05)
    data = json.loads(path.read_text())
    data.pop("pid", None)
    return data


# ---------------------------------------------------------------------------------------- restore


@dataclass(frozen=True)
class Restored:
    pid: int
    url: str
    seconds: float
    canary: Canary


def check_port_free(host: str, port: int) -> int:
    """The port to use (a free one for 0); SnapshotError when it is taken."""
    try:
        sock = bind(host, port)
    except EmberError as e:
        raise SnapshotError(f"cannot restore: {e}") from None
    with sock:
        return sock.getsockname()[1]


@contextlib.contextmanager
def _restore_lock(layout: Layout, timeout: float):
    """One restore of a snapshot at a time: they share state/handoff.json."""
    with open(layout.state / "restore.lock", "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SnapshotError("another restore of this snapshot is still running") from None
                time.sleep(0.01)
        yield


def restore(
    snapshot_dir: Path,
    tools: SnapshotTools,
    host: str | None = None,
    port: int | None = None,
    timeout: float = 120.0,
) -> Restored:
    started = time.perf_counter()
    trace.started(process=RESTORE)
    with trace.phase("check the manifest, host and model", RESTORE):
        layout, manifest, host, port = _checked(snapshot_dir, tools, host, port)
    with _restore_lock(layout, timeout):
        os.makedirs(manifest.runtime_dir, mode=0o700, exist_ok=True)
        write_json_atomic(layout.state / "handoff.json", {"host": host, "port": port})
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        log, pidfile = f"restore-{stamp}.log", layout.work / f"restore-{stamp}.pid"
        with trace.phase("criu restore", RESTORE):
            pid = tools.restore(layout.images, layout.work, log, pidfile)
        try:
            url_host = f"[{host}]" if ":" in host else host
            with trace.phase("wait for /health and the canary token", RESTORE):
                got = _wait_and_ask(url_host, port, pid, manifest.canary.prompt, started + timeout)
            _compare(manifest.canary, got)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise
        finally:
            (layout.state / "handoff.json").unlink(missing_ok=True)
        pidfile.unlink(missing_ok=True)  # CRIU's log stays only when the restore failed
        (layout.work / log).unlink(missing_ok=True)
    return Restored(pid, f"http://{url_host}:{port}", time.perf_counter() - started, got)


def _checked(
    snapshot_dir: Path, tools: SnapshotTools, host: str | None, port: int | None
) -> tuple[Layout, Manifest, str, int]:
    """The snapshot's layout and manifest, the address to restore at; SnapshotError naming every
    reason the snapshot cannot be restored here (incomplete, moved, another host, a changed model,
    a taken port)."""
    layout = Layout(snapshot_dir.resolve())
    manifest = read_manifest(layout.root)
    if not manifest.complete or manifest.canary is None:
        raise SnapshotError(f"{layout.root} is an incomplete snapshot (its create did not finish)")
    if manifest.snapshot_dir != str(layout.root):
        raise SnapshotError(
            f"the snapshot was made at {manifest.snapshot_dir} and moved to {layout.root}; its image "
            "refers to files under the original path, so restore it there"
        )
    problems = differences(manifest.identity, host_identity(tools.version()))
    problems += folder_changes(manifest.model)
    if manifest.weights is not None:
        problems += folder_changes(manifest.weights, "mapped weights")
    for name, files in manifest.adapters.items():  # the image holds their weights as they were then
        problems += folder_changes(files, f"LoRA adapter {name!r}")
    if problems:
        raise SnapshotError("the snapshot does not match this host: " + "; ".join(problems))
    host = host or manifest.host
    return layout, manifest, host, check_port_free(host, manifest.port if port is None else port)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return True


def _wait_and_ask(host: str, port: int, pid: int, prompt: str, deadline: float) -> Canary:
    """Poll /health until 200, then send the canary request; the restored process must stay alive."""
    body = json.dumps(canary_request(prompt))
    while True:
        if not _alive(pid):
            raise SnapshotError("the restored server exited before it was ready (see logs/serve.log)")
        try:
            conn = http.client.HTTPConnection(host.strip("[]"), port, timeout=30)
            conn.request("GET", "/health")
            health = conn.getresponse()
            health.read()
            if health.status == 200:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                data = reply.read()
                if reply.status != 200:
                    raise SnapshotError(f"the canary request failed ({reply.status}): {data[:300]!r}")
                return Canary(prompt=prompt, **canary_result(json.loads(data)))
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        if time.perf_counter() > deadline:
            raise SnapshotError("the restored server did not become healthy in time")
        time.sleep(0.005)


def _compare(recorded: Canary, got: Canary) -> None:
    problems = []
    if got.token_id != recorded.token_id:
        problems.append(f"token {got.token_id} instead of {recorded.token_id}")
    if got.text != recorded.text:
        problems.append(f"text {got.text!r} instead of {recorded.text!r}")
    if abs(got.logprob - recorded.logprob) > LOGPROB_TOLERANCE:
        problems.append(f"logprob {got.logprob:.6f} instead of {recorded.logprob:.6f}")
    if problems:
        raise SnapshotError(
            "canary mismatch after restore: " + ", ".join(problems) + "; the restored engine was killed"
        )


# ---------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="snapshot_command", required=True)
    c = sub.add_parser(
        "create",
        help="start `ember serve ARGS`, check it with a canary, dump it with CRIU into DIR",
        description="ember snapshot create [--weights image] [--timeout S] DIR [--] <ember serve arguments>",
    )
    c.add_argument("dir")
    c.add_argument("--timeout", type=float, default=600.0, help="seconds for the engine to start")
    c.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="mapped",
        help="mapped: weights in DIR/weights, mapped again on restore (default); image: inside the image",
    )
    c.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments of `ember serve`")
    r = sub.add_parser("restore", help="bring a snapshot back and check its canary over HTTP")
    r.add_argument("dir")
    r.add_argument("--host", default=None, help="address to bind (default: the create's --host)")
    r.add_argument("--port", type=int, default=None, help="port (default: the create's --port; 0: any)")
    r.add_argument("--timeout", type=float, default=120.0, help="seconds until the restored server answers")
    i = sub.add_parser("inspect", help="print a snapshot's manifest")
    i.add_argument("dir")


def run(args: argparse.Namespace, tools: SnapshotTools | None = None) -> int:
    tools = tools or SnapshotTools()
    root = Path(args.dir)
    if args.snapshot_command == "inspect":
        manifest = read_manifest(root)
        print(msgspec.json.format(msgspec.json.encode(manifest), indent=2).decode())
        return 0 if manifest.complete else 1
    if args.snapshot_command == "create":
        serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        m = create(root, serve_args, tools, args.timeout, args.weights)
        where = "weights inside the image" if m.mode == "full" else "weights mapped from weights/"
        print(
            f"ember snapshot: {root} created ({m.mode} mode: {where}), image "
            f"{m.image_bytes / 2**20:.0f} MiB; engine ready in {m.init_seconds:.2f}s, dumped in "
            f"{m.dump_seconds:.2f}s; canary token {m.canary.token_id} {m.canary.text!r} "
            f"logprob {m.canary.logprob:.4f}"
        )
        return 0
    r = restore(root, tools, args.host, args.port, args.timeout)
    print(
        f"ember snapshot: restored {root} in {r.seconds:.2f}s; listening on {r.url} (pid {r.pid}); "
        f"canary token {r.canary.token_id} {r.canary.text!r} logprob {r.canary.logprob:.4f} matches"
    )
    return 0
