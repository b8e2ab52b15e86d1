"""Reads a GGUF checkpoint: its metadata, its tensor table, and (through gguf_config) the config it implies.

Part of the shared base: the frontend (tokenizer, chat template), `ModelConfig` (architecture, EOS)
and the workers (weights, `workers.gguf.weights`) all open GGUF files through `GGUFFile`. The file is
memory-mapped and only its header is parsed; tensor data stays in the map until a worker copies it.
`open_gguf` shares one parse per file within a process (the configuration, the tokenizer and the loader
each open it).
Values come out as the `gguf` package's reader gives them (`ReaderField.contents()`: str, int,
float, bool, lists), but the header is parsed here in one pass because that reader builds a numpy
view per array element, which takes ~12 s for a 150k-token vocabulary (this takes a fraction of a
second). Type ids, names and block sizes are the `gguf` package's own.
"""

from __future__ import annotations

import copy
import math
import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, overload

from coreproc.base.errors import ConfigError

# numpy and the gguf package are imported where a GGUF file is read: every process imports this module
# (through coreproc.base.config), and the two cost ~0.15 s of each start that serves a Hugging Face folder

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types (the `gguf` package's GGUFValueType) -> struct format of a scalar
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# the tensor types workers.gguf.dequant reads (tests/workers/test_gguf_dequant.py keeps the two equal)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: `shape` in PyTorch order (GGUF lists dimensions reversed)."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


def type_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file a model argument names: the file itself, or the only `.gguf` in a folder that has
    no safetensors weights; None for a Hugging Face folder. ConfigError when a folder holds several."""
    path = Path(path)
    if is_gguf(path):
        if not path.is_file():
            raise ConfigError(f"GGUF file not found: {path}")
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ConfigError(f"{path} holds several GGUF files ({names}); name one")
    return found[0] if found else None


_U64 = struct.Struct("<Q")


class StringArray(Sequence[str]):
    """A GGUF array of strings, decoded on first use: a worker loading weights never reads the
    vocabulary, a tokenizer reads all of it."""

    def __init__(self, buffer: mmap.mmap, start: int, count: int) -> None:
        self._buf, self._start, self._count = buffer, start, count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._strings[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._strings)

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @cached_property
    def _strings(self) -> list[str]:
        length, buf, pos, out = _U64.unpack_from, self._buf, self._start, []
        for _ in range(self._count):
            (size,) = length(buf, pos)
            pos += 8
            out.append(buf[pos : pos + size].decode("utf-8", errors="replace"))
            pos += size
        return out


class _Cursor:
    """Sequential little-endian reads over the mapped header."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buffer, 0, path

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        start, self.pos = self.pos, self.pos + size
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def strings(self, count: int) -> Sequence[str]:
        """`count` strings in a row (a vocabulary: 150k of them), skipped over in one tight loop and
        decoded when first read."""
        length, buf, pos = _U64.unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + length(buf, pos)[0]
        array = StringArray(buf, self.pos, count)
        self.pos = pos
        return array

    def value(self, vtype: int) -> Any:
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise ConfigError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype == STRING:
            return self.strings(count)
        if etype in SCALARS:  # numbers in one read
            import numpy as np

            dtype = np.dtype("<" + SCALARS[etype]) if etype != 7 else np.dtype(np.bool_)
            values = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(etype) for _ in range(count)]  # arrays of arrays


SHARED_FILES = 4
_shared: dict[tuple[str, int, int, int], GGUFFile] = {}  # this process's parsed files, oldest first


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed GGUF file at `path`, shared within this process while the file stays the same (same
    inode, size and modification time): stepping over a 150k-token vocabulary takes ~50 ms a parse.
    The process keeps the last four opened (`_shared`)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from None
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _shared:
        while len(_shared) >= SHARED_FILES:
            _shared.pop(next(iter(_shared)))
        _shared[key] = GGUFFile(key[0])
    return _shared[key]


def forget_gguf_files() -> None:
    """Drop the files `open_gguf` shares, and their pages from this process's memory: a worker that
    has packed the weights keeps only views of a few tensors (the embedding rows it looks up), which
    fault their pages back in from the page cache when read; a preload daemon, none (the mapping
    closes)."""
    for gguf in _shared.values():
        gguf.drop_pages()
    _shared.clear()


class GGUFFile:
    """A memory-mapped GGUF file: `metadata`, `tensors` (name -> TensorInfo), `data(info)`. Its arrays of
    strings are `StringArray`s, decoded when first read (a worker loading weights never reads them)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read GGUF file {self.path}: {e}") from None
        if self._map[:4] != MAGIC:
            raise ConfigError(f"{self.path} is not a GGUF file (no GGUF magic)")
        try:
            self._parse()
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{self.path}: corrupt GGUF header ({e})") from None

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.path)
        cur.pos = 4
        self.version = cur.scalar("I")
        if self.version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", self.version))[0]
            what = "big-endian GGUF files are not supported" if swapped in (2, 3) else "unsupported version"
            raise ConfigError(f"{self.path}: {what} (version field {self.version})")
        tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))
        table = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
            table.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, dims, qtype, offset in table:
            elements = math.prod(dims)
            known = qtype in GGMLQuantizationType._value2member_map_  # others fail when loaded, by name
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] if known else (1, 0)
            info = TensorInfo(
                name, qtype, tuple(reversed(dims)), self.data_start + offset, elements // block * size
            )
            if info.offset + info.nbytes > len(self._map):
                raise ConfigError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = info

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "(none)"))

    def check_types(self) -> None:
        """ConfigError naming the first tensor whose type Ember cannot dequantize."""
        for info in self.tensors.values():
            if info.type_name not in SUPPORTED_TYPES:
                raise ConfigError(
                    f"{self.path}: tensor {info.name} has GGUF type {info.type_name}, which Ember does not "
                    f"read; supported: {', '.join(SUPPORTED_TYPES)}"
                )

    @property
    def header(self) -> bytes:
        """The raw header (metadata and tensor table): what the fingerprint hashes."""
        return bytes(self._map[: self.data_start])

    def data(self, info: TensorInfo) -> memoryview:
        """A tensor's bytes, zero-copy from the map."""
        return memoryview(self._map)[info.offset : info.offset + info.nbytes]

    def drop_pages(self) -> None:
        """Unmap the file's pages from this process (they stay in the page cache; a view that reads
        them later faults them back in): what packing read is no longer counted in its memory."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def sample(self, offset: int, size: int) -> bytes:
        return bytes(self._map[offset : offset + size])

    @property
    def size(self) -> int:
        return len(self._map)

    @property
    def hf_config(self) -> dict[str, Any]:
        """The config.json a Hugging Face folder of this model would have (a copy of its own: the parsed
        file is shared)."""
        return copy.deepcopy(self._hf_config)

    @cached_property
    def _hf_config(self) -> dict[str, Any]:
        from coreproc.base.gguf_config import ROPE_FACTORS, hf_config

        factors = {name: self.floats(self.tensors[name]) for name in ROPE_FACTORS if name in self.tensors}
        return hf_config(self.metadata, tuple(self.tensors), str(self.path), factors)

    def floats(self, info: TensorInfo) -> list[float]:
        """A small float32 tensor's values (ConfigError for another type)."""
        if info.type_name != "F32":
            raise ConfigError(f"{self.path}: tensor {info.name} must be F32, not {info.type_name}")
        return list(struct.unpack(f"<{info.nbytes // 4}f", self.data(info)))
