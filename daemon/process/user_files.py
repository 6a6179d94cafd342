"""Files named by the user (--api-key-file, --chat-template, the model's files), read at start.

Opening a FIFO for reading waits for a writer, and a device (or a huge sparse file) never ends:
either would stall start-up with nothing said. So each is opened without blocking, must be a
regular file, and is read up to a bound; anything else is a ConfigError (exit 2) that names
the file and what it is.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from cpud.settings.errors import ConfigError

MAX_TEMPLATE_BYTES = 4 << 20  # a --chat-template file (real ones: a few KB to ~100 KB)
MAX_SIDE_FILE_BYTES = 256 << 20  # a model's JSON and jinja files (tokenizer.json: ~30 MB)
# The files of a model directory cpud (or its tokenizer library) reads, by suffix.
MODEL_FILE_SUFFIXES = (".json", ".jinja", ".safetensors", ".gguf")
TEXT_SUFFIXES = (".json", ".jinja")

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _not_regular(what: str, path: str | os.PathLike, mode: int) -> ConfigError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
    return ConfigError(f"{what}{path} is {kind}, not a regular file: give the path of a file")


def open_regular(path: str | os.PathLike, what: str = "") -> BinaryIO:
    """`path` opened for reading in binary, without waiting on a FIFO. OSError when it cannot
    be opened; ConfigError (naming it as `what` + path) when it is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(what, path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str | os.PathLike, limit: int, what: str = "") -> str:
    """The UTF-8 text of `path` as Path.read_text gives it (OSError, UnicodeDecodeError as it
    raises them), but ConfigError for a file that is not regular or is over `limit` bytes."""
    with open_regular(path, what) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{what}{path} is over {limit} bytes: too long for this file")
    return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # text mode's newlines


def check_regular(path: str | os.PathLike, what: str = "", limit: int | None = None) -> None:
    """ConfigError unless `path` (followed through links) is a regular file, of at most `limit`
    bytes when given: for files a library opens by name."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{what}{path} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(what, path, st.st_mode)
    if limit is not None and st.st_size > limit:
        raise ConfigError(f"{what}{path} is {st.st_size} bytes, over the {limit}-byte limit")


def check_model_files_are_regular(model: Path) -> None:
    """The --model path, and in a model directory each file cpud reads (by suffix, and the
    additional chat templates), regular files; text ones at most MAX_SIDE_FILE_BYTES. Missing
    ones (dangling links) are left to the readers that need them to say so."""
    if not model.is_dir():
        check_regular(model, "model ")
        return
    entries = list(model.iterdir())
    extra = model / "additional_chat_templates"
    if extra.is_dir():
        entries += list(extra.iterdir())
    for entry in sorted(entries):
        if entry.suffix.lower() in MODEL_FILE_SUFFIXES and entry.exists():
            text = entry.suffix.lower() in TEXT_SUFFIXES
            check_regular(entry, "model file ", MAX_SIDE_FILE_BYTES if text else None)
