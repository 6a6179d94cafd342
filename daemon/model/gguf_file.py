"""GGUF files (llama.cpp's format) opened with the gguf package's reader, memory mapped: a
damaged file is a ConfigError naming it, and metadata values come back as plain Python values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from cpud.model.gguf_fields import build_fields
from cpud.model.gguf_header import check_gguf_file
from cpud.settings.errors import ConfigError, one_line

MAGIC = b"GGUF"
_MISSING = object()


class FastReader(GGUFReader):
    """GGUFReader reading each value through a plain ndarray view of its memory map. The package
    slices its np.memmap once per value, and memmap's subclass hooks on every slice make a
    49k-token vocabulary take 1.7 s to parse instead of 0.5 s; the bytes read are the same.
    A read past the end of the file is a ValueError (the package returns an empty array and
    goes on). Parse only files check_gguf_file has passed: the package trusts every count."""

    _plain: np.ndarray | None = None

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        if self._plain is None or self._plain.base is not self.data:
            self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count, offset = int(count), int(offset)
        raw = self._plain[offset : offset + dtype.itemsize * count]
        if len(raw) != dtype.itemsize * count or offset < 0:
            raise ValueError(f"{count} x {dtype} at byte {offset} lies past the end of the file")
        arr = raw.view(dtype)
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        return build_fields(self, offs, count)  # the same fields, built ~3x faster


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """The file's reader (memory mapped, nothing copied); ConfigError when it is not a readable
    GGUF file or its header fails check_gguf_file (every parse of a GGUF file goes through
    here, so each is checked once before the reader trusts its counts and offsets)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if magic != MAGIC[: len(magic)]:  # a shorter prefix of it is a truncated file
        raise ConfigError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r} "
            f"(cpud loads GGUF files and Hugging Face directories)"
        )
    try:
        check_gguf_file(path)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        reader = FastReader(path)
    except ConfigError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{path} ({size} bytes) is truncated or damaged: the GGUF reader stopped with "
            f"{_describe(exc)}; download or convert the file again"
        ) from None
    return reader


def _describe(exc: BaseException) -> str:
    return one_line(str(exc).splitlines()[0], 120) if str(exc) else type(exc).__name__


def field_value(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The metadata value under key: int, float, bool, str, or a list of those; `default`
    when the key is absent (ConfigError naming the key when no default is given)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ConfigError(f"{reader.data.filename}: GGUF metadata lacks {key}")
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"{reader.data.filename}: GGUF metadata {key} is unreadable ({_describe(exc)})"
        ) from None


def array_length(reader: GGUFReader, key: str) -> int | None:
    """How many items the array under key holds (without decoding them); None when absent."""
    field = reader.fields.get(key)
    if field is None or not field.types or field.types[0] != GGUFValueType.ARRAY:
        return None
    return len(field.data)
