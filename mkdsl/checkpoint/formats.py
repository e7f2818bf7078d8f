"""Checkpoint readers: the stored tensors' names, shapes and types without reading their data
(so a whole checkpoint is checked before anything is loaded), then one tensor at a time.

Shapes are numpy shapes (`[out, in]` for a matrix): GGUF's dims, fastest first, are reversed.
GGUF's block formats Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K are decoded to f32 by mkdsl's own
decoder (`gguf_blocks.py`, as llama.cpp decodes them: Q8_0 `d * q`, Q4_1 `d * q + m`, with f16
`d`, `m`), or read as stored (`read_blocks`) for a weight that keeps them; other block formats
by the `gguf` package's dequantizer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mkdsl.checkpoint import gguf_blocks


class CheckpointError(Exception):
    """A checkpoint that cannot be read or does not fit the spec (the CLI exits 1)."""


@dataclass(frozen=True)
class Stored:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the file's own type name: BF16, F32, Q4_1, ...


# Stored types whose values a spec dtype (numpy name) holds exactly. Block formats decode to f32.
EXACT = {
    "F32": {"float32"},
    "F16": {"float16", "float32"},
    "BF16": {"bfloat16", "float32"},
    "F64": {"float64"},
    "F8_E4M3": {"float8_e4m3fn", "bfloat16", "float32"},
    "F8_E5M2": {"float8_e5m2", "bfloat16", "float32"},
}
BLOCK_EXACT = {"float32"}


def exact(stored: str, target: str) -> bool:
    return target in EXACT.get(stored, BLOCK_EXACT)


def open_checkpoint(path: str | Path):
    """A reader for a safetensors file, a sharded index, a directory holding either, or a GGUF file."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        files = sorted(p.glob("*.safetensors"))
        ggufs = sorted(p.glob("*.gguf"))
        if index.exists():
            return SafetensorsReader.from_index(index)
        if len(files) == 1 or (not files and len(ggufs) == 1):
            return open_checkpoint(files[0] if files else ggufs[0])
        raise CheckpointError(f"{path}: expected model.safetensors.index.json, one .safetensors or one .gguf file")
    if p.name.endswith(".index.json"):
        return SafetensorsReader.from_index(p)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return GGUFReader(p)
    if p.suffix == ".safetensors":
        return SafetensorsReader({None: p})
    raise CheckpointError(f"{path}: neither a GGUF file nor .safetensors")


class SafetensorsReader:
    format = "hf"

    def __init__(self, files: dict[str | None, Path], weight_map: dict[str, str] | None = None):
        import ml_dtypes  # noqa: F401  (numpy learns bfloat16)
        from safetensors import safe_open

        self.root = next(iter(files.values())).parent
        self._handles = {}
        self._where: dict[str, object] = {}
        self._file: dict[str, Path] = {}
        try:
            for key, f in files.items():
                h = self._handles[key] = safe_open(str(f), framework="numpy")
                for name in h.keys():
                    if weight_map is None or weight_map.get(name) == key:  # the index says where each tensor is
                        self._where[name] = h
                        self._file[name] = f
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        if weight_map is not None:
            missing = {n for n in weight_map if n not in self._where}
            if missing:
                raise CheckpointError(f"the index names tensors its files lack: {sorted(missing)[:5]}")

    @classmethod
    def from_index(cls, index: Path) -> SafetensorsReader:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = {f: index.parent / f for f in sorted(set(weight_map.values()))}
        for f in files.values():
            if not f.exists():
                raise CheckpointError(f"{index}: names {f.name}, which does not exist")
        return cls(files, weight_map)

    def names(self) -> list[str]:
        return sorted(self._where)

    def info(self, name: str) -> Stored | None:
        h = self._where.get(name)
        if h is None:
            return None
        s = h.get_slice(name)
        return Stored(name, tuple(s.get_shape()), s.get_dtype())

    def read(self, name: str) -> np.ndarray:
        kind = self._where[name].get_slice(name).get_dtype()
        if kind in RAW_TYPES:  # the safetensors package's numpy reader knows no fp8
            return _read_raw(self._file[name], name, RAW_TYPES[kind])
        return self._where[name].get_tensor(name)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray | None:
        """Rows start..stop of a stored tensor, read by offset from its file (None: not a plain type)."""
        kind = self._where[name].get_slice(name).get_dtype()
        if kind not in ROW_TYPES:
            return None
        import ml_dtypes

        begin, header = _header(self._file[name])
        entry = header[name]
        shape = entry["shape"]
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(_numpy(ROW_TYPES[kind], ml_dtypes)).itemsize
        with open(self._file[name], "rb") as f:
            f.seek(begin + entry["data_offsets"][0] + start * row)
            data = f.read((stop - start) * row)
        return np.frombuffer(data, _numpy(ROW_TYPES[kind], ml_dtypes)).reshape(stop - start, *shape[1:])


# Stored types that numpy reads only through ml_dtypes: read from the file's bytes.
RAW_TYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# Stored types whose rows `read_rows` reads by offset (one element per value, no blocks).
ROW_TYPES = {**RAW_TYPES, "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I32": "int32"}
ROW_TYPES |= {"I8": "int8", "U8": "uint8", "I64": "int64"}


def _numpy(name: str, ml_dtypes):
    return getattr(ml_dtypes, name, None) or np.dtype(name)


@functools.lru_cache(maxsize=8)
def _header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header: an 8-byte little-endian length, then JSON (name -> dtype,
    shape, data_offsets relative to the end of the header); the data follows."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def _read_raw(path: Path, name: str, dtype: str) -> np.ndarray:
    """One tensor read from its bytes."""
    import ml_dtypes

    start, header = _header(path)
    entry = header[name]
    lo, hi = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + lo)
        data = f.read(hi - lo)
    return np.frombuffer(data, getattr(ml_dtypes, dtype)).reshape(entry["shape"])


def _checked_gguf_class():
    """gguf's reader, checking the tensors' data before it maps them: every tensor inside the file
    (else "truncated: N of M bytes") and no two sharing bytes (llama.cpp's loader refuses overlaps)."""
    import gguf

    class Checked(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields) -> None:
            extents = sorted(_extent(start_offs, f) for f in fields)
            need = max((end for _, end, _ in extents), default=0)
            if need > len(self.data):
                raise CheckpointError(f"truncated: {len(self.data)} of {need} bytes")
            for (_, end, a), (start, _, b) in zip(extents, extents[1:]):
                if start < end:
                    raise CheckpointError(f"tensors `{a}` and `{b}` overlap in the file (their data offsets)")
            super()._build_tensors(start_offs, fields)

    return Checked


def _extent(start_offs: int, field) -> tuple[int, int, str]:
    """(first byte, end, name) of a tensor's data, from its info field (gguf's own arithmetic)."""
    import gguf

    _, name, _, dims, raw_dtype, offset = field.parts
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
    start = int(start_offs + offset[0])
    return start, start + int(np.prod(dims)) * type_size // block, bytes(name).decode("utf-8", "replace")


def _open_gguf(path: str):
    return _checked_gguf_class()(path)


class GGUFReader:
    format = "gguf"

    def __init__(self, path: Path):
        try:
            self._r = _open_gguf(str(path))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except Exception as e:  # a damaged header
            raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
        self.root = path.parent
        self.path = path
        self._t = {t.name: t for t in self._r.tensors}

    def names(self) -> list[str]:
        return sorted(self._t)

    def info(self, name: str) -> Stored | None:
        t = self._t.get(name)
        if t is None:
            return None
        return Stored(name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)

    def read(self, name: str) -> np.ndarray:
        import gguf

        t = self._t[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type.name in ("F32", "F16"):
            return np.asarray(t.data).reshape(shape)
        if t.tensor_type.name in gguf_blocks.SIZES:
            return gguf_blocks.decode(t.data, t.tensor_type.name, shape)
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)

    def read_blocks(self, name: str) -> np.ndarray:
        """A block-format tensor's bytes as stored ([rows, bytes per row], uint8)."""
        return np.asarray(self._t[name].data, np.uint8)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray | None:
        """Rows start..stop of an F32 or F16 tensor, from the file's memory map at its offset
        (None for block formats, which are decoded whole)."""
        t = self._t[name]
        if t.tensor_type.name not in ("F32", "F16"):
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.array(np.asarray(t.data).reshape(shape)[start:stop])

    def metadata(self, key: str, default=None):
        f = self._r.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except UnicodeDecodeError:
            bad = next((i for i, at in enumerate(f.data) if not _utf8(f.parts[at].tobytes())), 0)
            raise CheckpointError(f"{self.path}: metadata `{key}` item {bad} is not UTF-8 text") from None


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
