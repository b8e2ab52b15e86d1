"""The world outside Ember that a snapshot touches: the CRIU binary, the namespaced launch, /proc.

Runs in the `ember snapshot` controller. `preflight` lists every reason an engine cannot be
snapshotted here. `SnapshotTools` wraps `criu dump/restore/--version` and the
`setsid unshare --pid --fork setsid ...` launch, so tests can hand the controller a fake. The /proc
helpers list a process tree, find io_uring descriptors and TCP connections that leave the tree, and
kill a namespaced tree (its init first: the kernel then kills the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from coreproc.base.errors import EmberError
from frontend.snapshot.manifest import SnapshotError, criu_version, version_at_least

if TYPE_CHECKING:
    from coreproc.base.config import EngineConfig

MIN_CRIU = (4, 1)


class SnapshotTools:
    """The outside tools a snapshot needs: CRIU itself, and the namespaced launch of `ember serve`."""

    def __init__(self, criu: str = "criu") -> None:
        self.criu = criu

    def version(self) -> str:
        return criu_version(self.criu)

    def launch(self, argv: list[str], env: dict[str, str], cwd: str, log: Path) -> subprocess.Popen:
        """`setsid unshare --pid --fork setsid ARGV`: a new session outside and inside a new PID
        namespace, stdin from /dev/null, stdout and stderr appended to `log` (a size-checked file
        would stop the second restore)."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                ["setsid", "unshare", "--pid", "--fork", "setsid", *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
            )

    def dump(self, pid: int, images: Path, work: Path, log: str, tcp_established: bool) -> None:
        cmd = [self.criu, "dump", "-t", str(pid), "-D", str(images), "-W", str(work), "-o", log]
        cmd += ["--tcp-established"] if tcp_established else []
        self._run(cmd, work / log, "dump")

    def restore(self, images: Path, work: Path, log: str, pidfile: Path) -> int:
        cmd = [self.criu, "restore", "-D", str(images), "-W", str(work), "-o", log, "-d"]
        self._run([*cmd, "--pidfile", str(pidfile)], work / log, "restore")
        return int(pidfile.read_text().strip())

    @staticmethod
    def _run(cmd: list[str], log: Path, what: str) -> None:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            raise SnapshotError(f"criu {what} failed ({done.returncode}): {_last_error(log)}")


def _last_error(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"no log at {log}"
    errors = [ln.strip() for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return (errors or lines or ["(empty log)"])[-1] + f" (log: {log})"


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _socket_inodes(pids: list[int]) -> tuple[set[int], list[str]]:
    inodes, uring = set(), []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
            elif target == "anon_inode:[io_uring]":
                uring.append(f"process {pid} holds an io_uring descriptor (fd {fd.name})")
    return inodes, uring


def dump_problems(root: int) -> tuple[list[str], bool]:
    """(reasons not to dump the tree at `root`, whether it has TCP connections inside itself)."""
    pids = tree_pids(root)
    inodes, problems = _socket_inodes(pids)
    established: dict[tuple[str, str], int] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{root}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "01":  # ESTABLISHED
                    established[(f[1], f[2])] = int(f[9])
    internal = False
    for (local, remote), inode in established.items():
        if inode not in inodes:
            continue
        if established.get((remote, local)) in inodes:
            internal = True
        else:
            problems.append(f"an established TCP connection {local} -> {remote} leaves the process tree")
    return problems, internal


def ns_init(proc: subprocess.Popen) -> int | None:
    """The PID (seen from here) of the namespace's first process, the child of `unshare`."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    return None


def kill_tree(proc: subprocess.Popen) -> None:
    init = ns_init(proc)
    if init is not None:  # the kernel kills everything in a PID namespace when its init dies
        with contextlib.suppress(ProcessLookupError):
            os.kill(init, signal.SIGKILL)
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def serve_parser() -> argparse.ArgumentParser:
    from coreproc.base.config import add_engine_arguments
    from frontend import serve

    p = argparse.ArgumentParser(prog="ember serve", add_help=False, exit_on_error=False, allow_abbrev=False)
    serve.add_arguments(p)
    add_engine_arguments(p)
    return p


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    try:
        args, unknown = serve_parser().parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise SnapshotError(f"bad serve arguments: {e}") from None
    if unknown:
        raise SnapshotError(f"unknown serve arguments: {' '.join(unknown)}")
    return args


def preflight(args: argparse.Namespace, tools: SnapshotTools) -> tuple[list[str], EngineConfig | None]:
    """Every reason this engine cannot be snapshotted here (empty: it can), and its config (None when
    the arguments do not make one)."""
    from coreproc.base.config import EngineConfig, engine_options

    reasons = []
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        reasons.append(f"snapshots need Linux on x86-64 (this is {platform.system()} {platform.machine()})")
    if os.geteuid() != 0:
        reasons.append("CRIU needs root")
    have = tools.version()
    if not have:
        reasons.append("CRIU is not installed (tools/install_criu.sh builds 4.1.1)")
    elif not version_at_least(have, MIN_CRIU):
        reasons.append(f"CRIU {have} is too old: {'.'.join(map(str, MIN_CRIU))} or newer is needed")
    reasons += [f"`{tool}` is not on PATH" for tool in ("setsid", "unshare") if not shutil.which(tool)]
    if args.api_key or args.api_key_file:
        reasons.append("--api-key: a snapshot serves one plain unauthenticated HTTP server")
    if args.ssl_keyfile or args.ssl_certfile or args.ssl_ca_certs:
        reasons.append("--ssl-*: a restored snapshot serves plain HTTP (put a TLS proxy in front)")
    if args.snapshot_park:
        reasons.append("--snapshot-park is set by `ember snapshot create` itself")
    if args.api_server_count != 1:
        reasons.append("--api-server-count: a snapshot holds one HTTP server process")
    if args.tensor_parallel_size != 1 or args.data_parallel_size != 1 or args.pipeline_parallel_size != 1:
        reasons.append("tensor, pipeline and data parallelism: a snapshot holds one single-device engine")
    if args.speculative_config:
        reasons.append("--speculative-config: speculative decoding is not snapshotted in this version")
    try:
        config = EngineConfig.create(**engine_options(args))
    except EmberError as e:
        return [*reasons, str(e)], None
    if config.device.resolved_type != "cpu":
        reasons.append(
            f"device {config.device.resolved}: GPU state needs CRIU's CUDA plugin, which this version "
            "does not drive; snapshots hold CPU engines"
        )
    return reasons, config


def keep_logs(folders: list[Path]) -> Path | None:
    """Copy the logs of a failed create (every file in `folders`) to a new folder under the temporary
    directory, before the half-made snapshot is removed; that folder, or None if there was none."""
    import tempfile

    logs = [f for folder in folders if folder.is_dir() for f in folder.iterdir() if f.suffix == ".log"]
    if not logs:
        return None
    kept = Path(tempfile.mkdtemp(prefix="ember-snapshot-failed-"))
    for log in logs:
        with contextlib.suppress(OSError):
            shutil.copy2(log, kept / log.name)
    return kept
