"""Shared-memory collectives for the tensor-parallel ranks of one machine.

The supervisor creates one segment per group incarnation; each rank attaches
with its index and uses the group as its ``TPGroup`` (ranks/parallel.py):

    owner = ShmGroup.create(f"{runtime_dir}/allreduce", world_size=2, max_bytes=8 << 20)
    # in rank r:
    group = ShmGroup.attach(f"{runtime_dir}/allreduce", rank=r, world_size=2)
    group.all_reduce(x)               # in place, bit-identical on every rank
    logits = group.gather_last_dim(y) # rank 0: concatenated; others: None
    # supervisor, when a rank dies: owner.abort(rank) -> waiting ranks raise promptly

The segment is a file (mode 0600, owner only) in a private runtime directory
or /dev/shm: put it on tmpfs.  Tensors larger than ``max_bytes`` are
processed in chunks.  Sums run in rank order 0..world-1 on every rank (fp32
accumulation for bf16), so all ranks hold the same bits afterwards.  A wait
that does not complete raises a ``CollectiveError`` naming the rank at fault
(after ``timeout`` seconds, at once when that rank's process is gone, or when
the group was aborted); the group is unusable afterwards: create a new one.
Nothing here pickles.  A handle is not thread-safe; use one per thread.  The owner's side
(create, abort, unlink) needs no torch: the supervisor never loads it.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import TYPE_CHECKING, Any

from . import _loader

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_TIMEOUT_S = 30.0
MAX_WORLD = 64
_PAGE = 4096
# cpud_shm_err codes (cpud_native.h)
_ETIMEDOUT, _EPEERDEAD, _EABORTED, _EMISMATCH, _EBUSY, _EHEADER = -4, -5, -6, -7, -8, -9


class CollectiveError(RuntimeError):
    """A collective could not complete; ``rank`` is the rank at fault (None: unknown)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class CollectiveTimeout(CollectiveError):
    """A peer did not arrive within the timeout."""


class PeerDied(CollectiveError):
    """A peer's process exited while this rank waited for it."""


class GroupAborted(CollectiveError):
    """The group was aborted (by a member that hit an error, or by its owner)."""


class CollectiveMismatch(CollectiveError):
    """Peers ran different collectives, or the same one with different sizes."""


def _require() -> None:
    if not _loader.available():
        raise RuntimeError(f"cpud native kernels are not available: {_loader.load_error()}")


def _timeout_ns(timeout: float | None) -> int:
    return 0 if timeout is None or timeout <= 0 else int(timeout * 1e9)


def _open_private(path: str) -> int:
    """Opens an existing segment file, refusing links, other owners and group/other access."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}; expected 0600"
    if problem:
        os.close(fd)
        raise PermissionError(f"shm segment {path} {problem}")
    return fd


class ShmGroup:
    """One rank's handle on a shared-memory group (or the owner's, with rank -1)."""

    def __init__(
        self,
        mm: mmap.mmap,
        path: str,
        rank: int,
        world_size: int,
        timeout: float | None,
        isa: str | None,
    ) -> None:
        _require()
        ffi, lib = _loader.ffi, _loader.lib
        self.path = path
        self.rank = rank
        self.size = world_size
        self.timeout = timeout
        self._mm: mmap.mmap | None = mm
        self._buf: Any = ffi.from_buffer(mm)
        self._peer = ffi.new("int *")
        self._broken: CollectiveError | None = None
        self._dtype_codes: dict[Any, int] = {}  # torch's, from the first collective on
        tier = _loader.default_isa() if isa is None else isa
        if tier not in _loader.supported_isas():
            self._release_mapping()
            raise ValueError(f"ISA tier {tier!r} cannot run here: {_loader.supported_isas()}")
        err = ffi.new("int *")
        base = int(ffi.cast("intptr_t", self._buf))
        h = lib.cpud_shm_open(base, len(mm), rank, world_size, _loader.ISAS.index(tier), err)
        if h == ffi.NULL:
            self._release_mapping()
            raise self._open_error(err[0])
        self._h: Any = ffi.gc(h, lib.cpud_shm_close)
        self.max_bytes = int(lib.cpud_shm_slot_bytes(h))

    # -------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        path: str,
        world_size: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> ShmGroup:
        """Creates (or atomically replaces) the segment at path, mode 0600; returns the
        owner's handle (rank -1: ``abort``, ``unlink``, ``close``; no collectives)."""
        _require()
        if not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"world_size must be in 1..{MAX_WORLD}, got {world_size}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        slot = -(-max_bytes // _PAGE) * _PAGE
        total = int(_loader.lib.cpud_shm_segment_bytes(world_size, slot))
        if total < 0:
            raise ValueError(f"max_bytes {max_bytes} out of range")
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
            buf = _loader.ffi.from_buffer(mm)
            rc = _loader.lib.cpud_shm_init(
                int(_loader.ffi.cast("intptr_t", buf)), total, world_size, slot
            )
            _loader.ffi.release(buf)
            if rc != 0:
                mm.close()
                raise ValueError(f"cpud_shm_init failed ({rc})")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        return cls(mm, path, -1, world_size, timeout, None)

    @classmethod
    def attach(
        cls,
        path: str,
        rank: int,
        world_size: int,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        isa: str | None = None,
    ) -> ShmGroup:
        """Joins the group at path as rank (0 <= rank < world_size); once per rank.

        timeout: seconds any wait may take (None or <= 0: forever); isa: summation tier."""
        _require()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        fd = _open_private(path)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(mm, path, rank, world_size, timeout, isa)

    # --------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums a contiguous fp32/bf16 CPU tensor over all ranks, in place; returns it."""
        code = (self._dtype_codes or self._load_dtype_codes()).get(tensor.dtype)
        if code is None or not tensor.is_cpu or not tensor.is_contiguous():
            raise ValueError(
                f"all_reduce: expected a contiguous float32/bfloat16 CPU tensor, got "
                f"{tensor.dtype} on {tensor.device} (contiguous={tensor.is_contiguous()})"
            )
        n = tensor.numel()
        if n:
            rc = _loader.lib.cpud_shm_all_reduce(
                self._handle(), code, tensor.data_ptr(), n, _timeout_ns(self.timeout), self._peer
            )
            if rc:
                self._fail(rc, "all_reduce", self.timeout)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenates every rank's tensor along the last dim on rank 0 (None elsewhere).

        All ranks pass contiguous CPU tensors of the same shape and dtype."""
        if tensor.dim() < 1 or not tensor.is_cpu or not tensor.is_contiguous():
            raise ValueError(
                f"gather_last_dim: expected a contiguous CPU tensor with >= 1 dim, got "
                f"shape {tuple(tensor.shape)} on {tensor.device}"
            )
        import torch

        cols = tensor.shape[-1]
        out = None
        if self.rank == 0:
            out = torch.empty(*tensor.shape[:-1], cols * self.size, dtype=tensor.dtype)
        if tensor.numel():
            rc = _loader.lib.cpud_shm_gather_last_dim(
                self._handle(),
                tensor.element_size(),
                tensor.data_ptr(),
                tensor.numel() // cols,
                cols,
                0 if out is None else out.data_ptr(),
                _timeout_ns(self.timeout),
                self._peer,
            )
            if rc:
                self._fail(rc, "gather_last_dim", self.timeout)
        return out

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every rank called barrier; timeout: seconds (None: the group's,
        <= 0: forever), e.g. longer for the first barrier after loading weights."""
        limit = self.timeout if timeout is None else timeout
        rc = _loader.lib.cpud_shm_barrier(self._handle(), _timeout_ns(limit), self._peer)
        if rc:
            self._fail(rc, "barrier", limit)

    def native_collective_args(self) -> tuple[Any, int, Any]:
        """(handle, timeout in ns, peer out-pointer) for native code that runs this group's
        all-reduces itself (the fused decoder); a failure code it returns goes to
        ``raise_collective_error``."""
        return self._handle(), _timeout_ns(self.timeout), self._peer

    def raise_collective_error(self, rc: int, op: str) -> None:
        """Raises the CollectiveError for a failure code of a native collective."""
        self._fail(rc, op, self.timeout)

    # ----------------------------------------------------------- lifecycle

    def abort(self, culprit: int | None = None) -> None:
        """Makes every current and future wait of the group raise GroupAborted naming
        culprit (the rank at fault, if known); for the owner when a rank dies."""
        _loader.lib.cpud_shm_abort(self._handle(), -1 if culprit is None else culprit)

    def aborted_by(self) -> int | None:
        """None while the group runs; else the culprit of the first abort (-1: unknown)."""
        culprit = int(_loader.lib.cpud_shm_abort_culprit(self._handle()))
        return None if culprit == -2 else culprit

    def unlink(self) -> None:
        """Removes the segment file (mappings stay valid until closed)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Releases the handle and the mapping; idempotent."""
        h = getattr(self, "_h", None)
        if h is not None:
            self._h = None
            _loader.ffi.release(h)  # runs cpud_shm_close now
        self._release_mapping()

    def __enter__(self) -> ShmGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmGroup(path={self.path!r}, rank={self.rank}, size={self.size})"

    # ------------------------------------------------------------- helpers

    def _load_dtype_codes(self) -> dict[Any, int]:
        from .kernels import DTYPE_CODE

        self._dtype_codes = DTYPE_CODE
        return DTYPE_CODE

    def _handle(self) -> Any:
        if self._broken is not None:
            raise GroupAborted(f"shm group unusable after: {self._broken}", self._broken.rank)
        h = getattr(self, "_h", None)
        if h is None:
            raise RuntimeError("shm group is closed")
        return h

    def _release_mapping(self) -> None:
        if self._buf is not None:
            _loader.ffi.release(self._buf)
            self._buf = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def _open_error(self, code: int) -> Exception:
        where = f"shm segment {self.path}"
        if code == _EHEADER:
            return ValueError(f"{where} is not a cpud segment for world_size {self.size}")
        if code == _EBUSY:
            return RuntimeError(f"{where}: rank {self.rank} is already attached")
        return ValueError(f"{where}: cannot attach rank {self.rank} (error {code})")

    def _fail(self, rc: int, op: str, timeout: float | None) -> None:
        """Raises the CollectiveError for return code rc (and marks the group broken)."""
        if rc == -2:
            raise ValueError(f"{op}: invalid argument (rank {self.rank} is not a member?)")
        peer = int(self._peer[0])
        who = f"rank {peer}" if peer >= 0 else "an unknown rank"
        me = f"shm {op} on rank {self.rank}/{self.size}"
        err: CollectiveError
        if rc == _ETIMEDOUT:
            err = CollectiveTimeout(f"{me}: {who} did not arrive within {timeout} s", peer)
        elif rc == _EPEERDEAD:
            pid = int(_loader.lib.cpud_shm_pid(self._h, peer))
            err = PeerDied(f"{me}: {who} (pid {pid}) exited while waited for", peer)
        elif rc == _EABORTED:
            err = GroupAborted(f"{me}: group aborted, {who} at fault", peer if peer >= 0 else None)
        elif rc == _EMISMATCH:
            err = CollectiveMismatch(f"{me}: {who} ran another collective or size", peer)
        else:
            err = CollectiveError(f"{me}: error {rc}", None)
        self._broken = err
        raise err
