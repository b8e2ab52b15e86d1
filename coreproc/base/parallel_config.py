"""How one engine is spread over processes, devices and hosts: `ParallelConfig`, the `parallel`
section of the engine's configuration (coreproc.base.config).

Part of the shared base: runs in every process (the config travels to workers as JSON) and imports
nothing above it. Tensor-parallel ranks, pipeline stages and their layer split, data-parallel engines
and their routing, the executor backend (local processes, Ray, or other nodes' headless workers) and
the nodes' rendezvous. Derived facts (world size, ranks per node, workers sharing a host) are
properties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coreproc.base import options
from coreproc.base.errors import ConfigError
from coreproc.base.options import at_least, option

__all__ = ["RAY_MISSING", "ParallelConfig"]

RAY_MISSING = "--distributed-executor-backend ray needs Ray: pip install 'ember-serve[ray]'"


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread: tensor parallelism (each worker gets its own copy with `rank` set),
    pipeline stages, data-parallel engines and how requests are routed among them, and which
    distributed runtime places the workers (local processes, Ray, or several hosts)."""

    tensor_parallel_size: int = option("tensor-parallel workers", 1, short="-tp")
    rank: int = 0
    pipeline_parallel_size: int = option("pipeline stages (the layers split among them)", 1, short="-pp")
    pp_layer_partition: str | None = option(
        "layers per pipeline stage, comma-separated (default: as even as possible)", None, metavar="N,N,..."
    )
    data_parallel_size: int = option(
        "data-parallel engines, each with its own workers and KV cache, behind one frontend", 1, short="-dp"
    )
    data_parallel_rank: int = option("this engine's rank among data-parallel engines", 0, hidden=True)
    dp_routing: Literal["least-loaded", "prefix"] = option(
        "how a request picks its data-parallel engine: the least loaded, or the one holding its longest "
        "cached prefix (then the least loaded)",
        "least-loaded",
    )
    distributed_executor_backend: Literal["mp", "ray"] = option(
        "mp: worker processes started here (and `ember worker --headless` on other nodes); "
        "ray: workers as actors of a Ray cluster (pip install 'ember-serve[ray]')",
        "mp",
    )
    placement_strategy: Literal["PACK", "SPREAD"] = option(
        "with the ray backend: the placement group's strategy for the workers' bundles", "PACK"
    )
    nnodes: int = option("hosts the workers span (mp backend)", 1)
    node_rank: int = option("this host's rank among --nnodes (0: the head, with the core)", 0)
    master_addr: str | None = option("the head's address other nodes reach (multi-node)", None)
    master_port: int | None = option(
        "the head's rendezvous port (multi-node; the other nodes' workers also connect to PORT + 1)", None
    )
    curve_keys: str | None = option(
        "directory from `ember keygen`, copied to every node: CurveZMQ keys for the head's link to the "
        "other nodes' workers (required off loopback); `ember core` also requires them of its clients",
        None,
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes")
        _rank_of(self.data_parallel_rank, "data_parallel_rank", self.data_parallel_size, "data_parallel_size")
        _rank_of(self.node_rank, "node_rank", self.nnodes, "nnodes")
        options.check_choices(self)
        if self.distributed_executor_backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ConfigError(RAY_MISSING)
        if self.nnodes > 1:
            self._check_nodes()
        if self.pp_layer_partition is not None:
            self._partition()  # well-formed here; against the model's layer count in `stage_layers`

    @property
    def world_size(self) -> int:
        """Workers of one engine: every pipeline stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_nodes(self) -> None:
        """Several nodes (mp backend): each holds the same number of whole ranks of one engine."""

        def refused(problem: str, *also: str) -> ConfigError:
            return ConfigError(f"nnodes={self.nnodes} {problem}", option="nnodes", also=also)

        if self.distributed_executor_backend != "mp":
            backend = "distributed_executor_backend"
            raise refused(f"is for {backend}=mp; Ray places its workers itself", backend)
        if not self.master_addr or not self.master_port:
            what = "needs master_addr and master_port (the head's address and port)"
            raise refused(what, "master_addr", "master_port")
        if not 0 < self.master_port < 65535:
            port = self.master_port
            raise ConfigError.bad(
                "master_port", f"must be in [1, 65534] (PORT + 1 is the workers' link), got {port}"
            )
        if self.world_size % self.nnodes:
            sizes = ("tensor_parallel_size", "pipeline_parallel_size")
            raise refused(f"must divide the {self.world_size} workers ({' x '.join(sizes)}) evenly", *sizes)
        if self.data_parallel_size > 1:
            raise refused(
                "with data_parallel_size > 1 is not supported in this version", "data_parallel_size"
            )

    @property
    def ranks_per_node(self) -> int:
        """Workers of the engine on each node (global ranks node * ranks_per_node onwards)."""
        return self.world_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node holding global rank `rank`."""
        return rank // self.ranks_per_node

    def node_ranks(self, node: int | None = None) -> range:
        """The global ranks on `node` (default: this node)."""
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    @property
    def node_endpoint(self) -> str:
        """Where the head's core listens for the workers of the other nodes: master address, port + 1."""
        host = self.master_addr or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{(self.master_port or 0) + 1}"

    @property
    def workers_per_host(self) -> int:
        """Workers sharing one host's cores and memory: every data-parallel engine's, spread over
        the nodes."""
        return max(1, self.world_size * self.data_parallel_size // self.nnodes)

    def _partition(self) -> list[int]:
        """`--pp-layer-partition` as layer counts, one positive count per stage."""
        text = self.pp_layer_partition or ""
        name = "pp_layer_partition"
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            raise ConfigError.bad(name, f"must be comma-separated integers, got {text!r}") from None
        if len(counts) != self.pipeline_parallel_size:
            raise ConfigError.bad(
                name,
                f"{text!r} has {len(counts)} stages; pipeline_parallel_size is {self.pipeline_parallel_size}",
                also=("pipeline_parallel_size",),
            )
        if min(counts) < 1:
            raise ConfigError.bad(name, f"{text!r}: every pipeline stage needs at least one layer")
        return counts

    def stage_layers(self, num_layers: int) -> list[tuple[int, int]]:
        """The [start, end) layers of each pipeline stage: the partition given, or as even as possible,
        the spare layers going to the stages before the last (which also runs the LM head)."""
        pp = self.pipeline_parallel_size
        if pp > num_layers:
            raise ConfigError.bad("pipeline_parallel_size", f"{pp} exceeds the model's {num_layers} layers")
        if self.pp_layer_partition is not None:
            counts = self._partition()
            if sum(counts) != num_layers:
                raise ConfigError.bad(
                    "pp_layer_partition",
                    f"{self.pp_layer_partition!r} covers {sum(counts)} layers; the model has {num_layers}",
                )
        else:
            counts = [num_layers // pp] * pp
            for stage in range(num_layers % pp):
                counts[pp - 2 - stage] += 1
        starts = [sum(counts[:i]) for i in range(pp)]
        return [(start, start + n) for start, n in zip(starts, counts)]


def _rank_of(rank: int, name: str, size: int, size_name: str) -> None:
    """`rank` (option `name`) is one of the `size` ranks that option `size_name` says there are."""
    if not 0 <= rank < size:
        raise ConfigError.bad(name, f"must be in [0, {size_name}={size}), got {rank}", also=(size_name,))
