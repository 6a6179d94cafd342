"""Which safetensors files hold a model's weights, and whether their headers are sound.

Only the headers are read (the 8-byte length and the JSON after it), so checking a model of any
size costs milliseconds. The rules are those of the safetensors reader the ranks use (tensors
packed back to back from offset 0, covering the data section exactly), applied here before any
rank starts so that a corrupt file is a one-line ConfigError naming the file and the tensor.
Torch-free: the supervisor imports it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpud.model.model_config import is_int, read_json_object
from cpud.settings.errors import ConfigError

INDEX_NAME = "model.safetensors.index.json"
# The safetensors reader refuses headers above 100 MB; real ones are well under 1 MB.
MAX_HEADER_BYTES = 100_000_000
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The decoded JSON header and the size of the data section after it."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ConfigError(
                    f"{path} is {size} bytes, too short for a safetensors header (truncated?)"
                )
            f.seek(0)
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise ConfigError(
                    f"{path}: safetensors header length {length} is above the "
                    f"{MAX_HEADER_BYTES}-byte limit: not a safetensors file or corrupt"
                )
            if length > size - 8:
                raise ConfigError(
                    f"{path}: safetensors header length {length} but only {size - 8} bytes "
                    f"follow: the file is truncated or corrupt"
                )
            raw = f.read(length)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: safetensors header is not UTF-8 (byte {exc.start}): corrupt file"
        ) from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: safetensors header is not valid JSON: {reason}") from None
    if not isinstance(header, dict):
        kind = type(header).__name__
        raise ConfigError(f"{path}: safetensors header is a JSON {kind}, not an object")
    return header, size - 8 - length


def _tensor(path: Path, name: str, entry: Any, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is {type(entry).__name__}, not an object with dtype/shape")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ConfigError(f"{where} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ConfigError(f"{where} has shape {shape!r}: not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ConfigError(f"{where} has data_offsets {offsets!r}: not [begin, end] with begin<=end")
    begin, end = offsets
    if end > data_len:
        raise ConfigError(
            f"{where} has data_offsets {offsets} past the {data_len} data bytes in the file "
            f"(truncated?)"
        )
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != (end - begin) * 8:
        raise ConfigError(
            f"{where}: dtype {dtype} shape {shape} needs {bits / 8:g} bytes, "
            f"but data_offsets {offsets} span {end - begin}"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def check_safetensors(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors one safetensors file holds, after checking its header against the file."""
    path = Path(path)
    header, data_len = _read_header(path)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ConfigError(f"{path}: __metadata__ must map names to strings")
    tensors = {
        name: _tensor(path, name, entry, data_len)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    end, last = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            problem = "overlaps" if info.begin < end else "leaves a gap after"
            after = f"tensor {last!r}" if last is not None else "the start of the data"
            raise ConfigError(
                f"{path}: tensor {name!r} (data_offsets [{info.begin}, {info.end}]) "
                f"{problem} {after}, which ends at {end}"
            )
        end, last = info.end, name
    if end != data_len:
        raise ConfigError(
            f"{path}: {data_len - end} bytes after the last tensor: the file is corrupt"
        )
    return tensors


def _index_files(model_dir: Path, index: Path) -> dict[str, str]:
    raw = read_json_object(index)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}: weight_map must be an object of tensor name -> file name")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file:
            raise ConfigError(
                f"{index}: weight_map gives {name!r} the file {file!r}, not a file name in "
                f"{model_dir}"
            )
    return weight_map


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else model.safetensors, else
    every *.safetensors in the directory."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        files = [model_dir / name for name in sorted(set(_index_files(model_dir, index).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index.name} lists {missing[0]}, which is missing from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise ConfigError(
        f"no *.safetensors weights in {model_dir} (pytorch_model.bin is not read: "
        f"convert the checkpoint to safetensors)"
    )


def check_weights(model_dir: str | Path) -> list[Path]:
    """weight_files(model_dir), each header checked, no tensor in two files, and the index
    (when there is one) naming the file that really holds each tensor."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    owner: dict[str, str] = {}
    for path in files:
        for name in check_safetensors(path):
            if name in owner:
                raise ConfigError(
                    f"tensor {name!r} is in both {owner[name]} and {path.name} in {model_dir}"
                )
            owner[name] = path.name
    index = model_dir / INDEX_NAME
    if index.is_file():
        for name, file in _index_files(model_dir, index).items():
            if owner.get(name) != file:
                held = f"it is in {owner[name]}" if name in owner else "no file holds it"
                raise ConfigError(f"{index}: weight_map puts {name!r} in {file}, but {held}")
    return files
