"""Python face of the native kernels: torch tensors in, checked, handed to C.

A ``Kernels`` object is bound to one ISA tier for its lifetime; nothing global
changes at run time.  Every method validates dtype, device, shape and the
strides it relies on and raises ``ValueError`` with the argument's name; the C
side re-checks index data (positions, slots, block tables) and the wrappers
turn its error codes into ``ValueError``/``MemoryError``.

Layout conventions (the engine's): activations [T, ...] may have any stride
between tokens as long as each token's inner dims are dense (a q/k/v slice of
a fused qkv output works without a copy); caches, weights and index tensors
are contiguous.  Threads: OpenMP with the calling thread's team size, i.e.
``torch.get_num_threads()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _loader
from .hugepages import huge_empty

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}  # cpud_dtype in cpud_native.h
# KV cache element types (cpud_kv_dtype): a cache tensor's dtype names its row format. int8:
# [.., hd + 4] bytes per row, hd int8 values then their float32 scale (amax / 127);
# float8_e5m2: [.., hd], no scale; float8_e4m3fn: [.., hd + 4], as int8 (scale amax / 448).
KV_DTYPE_CODE = {**DTYPE_CODE, torch.int8: 2, torch.float8_e5m2: 3, torch.float8_e4m3fn: 4}
KV_ROW_EXTRA = {torch.int8: 4, torch.float8_e4m3fn: 4}  # bytes after a row's hd values
_ERRORS = {-1: "ISA tier not supported by this CPU", -2: "invalid argument", -3: "out of memory"}
GEMM_NB = 32  # columns per packed panel (CPUD_GEMM_NB)


def _require() -> None:
    if not _loader.available():
        raise RuntimeError(f"cpud native kernels are not available: {_loader.load_error()}")


def check_rc(rc: int, what: str, hint: str = "") -> None:
    """Raises for a native call's nonzero return code: MemoryError for out of memory,
    ValueError otherwise, naming `what` and adding the hint."""
    if rc == 0:
        return
    msg = f"{what}: {_ERRORS.get(rc, f'error {rc}')}" + (f" ({hint})" if hint else "")
    if rc == -3:
        raise MemoryError(msg)
    raise ValueError(msg)


def _dtype(t: torch.Tensor, name: str) -> int:
    code = DTYPE_CODE.get(t.dtype)
    if code is None:
        raise ValueError(f"{name}: dtype {t.dtype} not supported (float32 or bfloat16)")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be a CPU tensor, got {t.device}")
    return code


def _same_dtype(ref: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: dtype {t.dtype} must match {ref.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be a CPU tensor, got {t.device}")


def _tokens(t: torch.Tensor, name: str, ndim: int) -> int:
    """Checks [T, ...] with dense inner dims; returns the token stride in elements."""
    stride = t.stride()
    if len(stride) != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if stride[-1] != 1 or (ndim == 3 and stride[1] != t.shape[2]):
        raise ValueError(f"{name}: inner dims must be contiguous, got strides {stride}")
    return stride[0]


def gemm_io(
    x: torch.Tensor, n: int, k: int, out: torch.Tensor | None
) -> tuple[int, int, torch.Tensor, int, int]:
    """Checks a GEMM's x [M, k] and out [M, n] (made when None, in x's dtype); returns
    (x dtype code, x row stride, out, out dtype code, out row stride)."""
    xdt = _dtype(x, "x")
    xs = _tokens(x, "x", 2)
    if x.shape[1] != k:
        raise ValueError(f"x: K={x.shape[1]} but the weight has K={k}")
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
    elif out.shape != (x.shape[0], n):
        raise ValueError(f"out: shape {tuple(out.shape)}, expected {(x.shape[0], n)}")
    return xdt, xs, out, _dtype(out, "out"), _tokens(out, "out", 2)


def _shape_matches(dims: Sequence[int], shape: Sequence[int | None]) -> bool:
    """dims equals shape where shape names a size (None: any); a loop, not a generator, as
    the kernels check a few hundred tensors per decode step."""
    if len(dims) != len(shape):
        return False
    for want, got in zip(shape, dims):
        if want is not None and want != got:
            return False
    return True


def _contig(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int | None]) -> None:
    """Checks a contiguous CPU tensor of dtype whose shape matches (None = any)."""
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be a CPU tensor, got {t.device}")
    if not _shape_matches(t.shape, shape):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {want}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def kv_row_width(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Elements in the last dim of a KV cache of cache_dtype: head_dim, + 4 for a scale."""
    return head_dim + KV_ROW_EXTRA.get(cache_dtype, 0)


def _kv_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, nkv: int | None, hd: int
) -> int:
    """Checks a pair of caches [num_blocks, nkv, bs, row] of one KV dtype that dtype's
    activations can use; returns its cpud_kv_dtype code."""
    code = KV_DTYPE_CODE.get(key_cache.dtype)
    if code is None or (code <= 1 and code != DTYPE_CODE[dtype] and code != 1):
        raise ValueError(
            f"key_cache: dtype {key_cache.dtype} cannot cache {dtype} keys (the same dtype, "
            "bfloat16, int8, float8_e5m2 or float8_e4m3fn)"
        )
    _contig(
        key_cache,
        "key_cache",
        key_cache.dtype,
        (None, nkv, None, kv_row_width(key_cache.dtype, hd)),
    )
    _contig(value_cache, "value_cache", key_cache.dtype, tuple(key_cache.shape))
    return code


def _norm_weight(x: torch.Tensor, weight: torch.Tensor, hidden: int) -> int:
    """Checks a norm's [hidden] weight: x's dtype, or float32 on bfloat16 x (Gemma form);
    returns its dtype code."""
    if weight.dtype == torch.float32 and x.dtype == torch.bfloat16:
        _contig(weight, "weight", torch.float32, (hidden,))
    else:
        _contig(weight, "weight", x.dtype, (hidden,))
    return DTYPE_CODE[weight.dtype]


def _gated_io(x: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int, torch.Tensor, int, int]:
    """Checks a gated activation's x [T, 2I] and out [T, I] (made when None); returns
    (dtype code, x token stride, out, out token stride, I)."""
    dt = _dtype(x, "x")
    xs = _tokens(x, "x", 2)
    if x.shape[1] % 2:
        raise ValueError(f"x: last dim {x.shape[1]} must be even")
    inter = x.shape[1] // 2
    if out is None:
        out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    else:
        _same_dtype(x, out, "out")
        if out.shape != (x.shape[0], inter):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(x.shape[0], inter)}")
    return dt, xs, out, _tokens(out, "out", 2), inter


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight packed for ``Kernels.gemm_packed``.

    data: [ceil(N/32), ceil(K/2), 32, 2] bf16, zero padded; bias: [N] fp32 or None.
    """

    data: torch.Tensor
    n: int
    k: int
    bias: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        """Bytes streamed per GEMM call (padding included)."""
        return self.data.numel() * self.data.element_size()


def packed_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """[panels, k pairs, columns per panel, 2]: the packed layout of a W[n, k]."""
    return (-(-n // GEMM_NB), -(-k // 2), GEMM_NB, 2)


def empty_packed(n: int, k: int, huge_pages: bool = True) -> torch.Tensor:
    """Storage for a packed W[n, k] (fill it with ``pack_rows``); the rows that pad n up to a
    whole panel are zeroed here, on transparent huge pages unless huge_pages is False."""
    if n < 1 or k < 1:
        raise ValueError(f"w: empty shape {(n, k)}")
    shape = packed_shape(n, k)
    data = (
        huge_empty(shape, torch.bfloat16)
        if huge_pages
        else torch.empty(shape, dtype=torch.bfloat16)
    )
    if n % GEMM_NB:
        data[-1, :, n % GEMM_NB :].zero_()
    return data


def pack_rows(data: torch.Tensor, row0: int, rows: torch.Tensor) -> None:
    """Packs rows [n, k] (any float dtype; rounded to bf16; any row stride) as rows
    [row0, row0 + n) of the packed weight in ``data`` (from ``empty_packed``)."""
    if rows.dim() != 2 or not rows.is_floating_point() or not rows.is_cpu:
        raise ValueError(f"rows: expected a 2-D float CPU tensor, got {rows.dtype} {rows.shape}")
    panels, pairs = data.shape[0], data.shape[1]
    n, k = rows.shape
    if -(-k // 2) != pairs or row0 < 0 or row0 + n > panels * GEMM_NB:
        raise ValueError(
            f"rows: {n} x {k} at row {row0} do not fit a packed weight of "
            f"{panels * GEMM_NB} x {2 * pairs}"
        )
    if rows.dtype not in DTYPE_CODE:
        rows = rows.to(torch.float32)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    _require()
    rc = _loader.lib.cpud_pack_rows(
        rows.data_ptr(), DTYPE_CODE[rows.dtype], rows.stride(0), data.data_ptr(), k, row0, n
    )
    check_rc(rc, "pack_rows")


def packed_with_bias(
    data: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None
) -> PackedWeight:
    """A PackedWeight over filled ``data``, with an optional [n] bias kept in fp32."""
    b = None
    if bias is not None:
        if bias.shape != (n,) or not bias.is_floating_point():
            raise ValueError(f"bias: expected a float [{n}] tensor, got {tuple(bias.shape)}")
        b = bias.detach().to(torch.float32).contiguous()
    return PackedWeight(data=data, n=n, k=k, bias=b)


def pack_weight(
    w: torch.Tensor, bias: torch.Tensor | None = None, huge_pages: bool = True
) -> PackedWeight:
    """Packs W[N, K] (any float dtype; rounded to bf16) for the skinny GEMM, at load time,
    onto transparent huge pages unless huge_pages is False."""
    if w.dim() != 2 or not w.is_floating_point() or not w.is_cpu:
        raise ValueError(f"w: expected a 2-D float CPU tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    data = empty_packed(n, k, huge_pages)
    pack_rows(data, 0, w.detach())
    return packed_with_bias(data, n, k, bias)


def max_threads() -> int:
    """Threads a parallel region started by this thread would use."""
    _require()
    return int(_loader.lib.cpud_max_threads())


def pin_threads(cpus: Sequence[int]) -> list[int]:
    """Pins OpenMP thread i of one len(cpus)-thread region to cpus[i].

    Returns sched_getcpu() per thread (-1: thread did not run, -2: pinning
    failed).  Call from the thread that will run the model, with
    torch.set_num_threads(len(cpus)) so later regions reuse these threads.
    """
    _require()
    n = len(cpus)
    if n == 0:
        return []
    ffi, lib = _loader.ffi, _loader.lib
    out = ffi.new("int[]", n)
    lib.cpud_pin_threads(ffi.new("int[]", [int(c) for c in cpus]), n, out)
    return list(out)


def thread_cpus(n: int | None = None) -> list[int]:
    """sched_getcpu() of each thread of an n-thread region (default: max_threads())."""
    _require()
    ffi, lib = _loader.ffi, _loader.lib
    n = max_threads() if n is None else n
    out = ffi.new("int[]", n)
    lib.cpud_thread_cpus(n, out)
    return list(out)


class Kernels:
    """The native kernels at one ISA tier (default: ``cpud.native.isa()``)."""

    __slots__ = ("_isa", "_code")

    def __init__(self, isa: str | None = None) -> None:
        _require()
        name = _loader.default_isa() if isa is None else isa
        if name not in _loader.supported_isas():
            raise ValueError(
                f"ISA tier {name!r} cannot run here; supported: {_loader.supported_isas()}"
            )
        self._isa = name
        self._code = _loader.ISAS.index(name)

    @property
    def isa(self) -> str:
        return self._isa

    def __repr__(self) -> str:
        return f"Kernels(isa={self._isa!r})"

    # ------------------------------------------------------------ norms

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out = RMSNorm(x) * weight over the last dim; in place when out is None.

        x, out: [T, H] or [T, n, H] (e.g. q/k norm per head); weight: [H] in x's dtype (HF
        LlamaRMSNorm rounding) or float32 on bfloat16 x (Gemma form: x * inv * weight in fp32,
        rounded once).
        """
        dt = _dtype(x, "x")
        xs = _tokens(x, "x", x.dim() if x.dim() in (2, 3) else 2)
        hidden = x.shape[-1]
        wdt = _norm_weight(x, weight, hidden)
        if out is None:
            out, os_ = x, xs
        else:
            _same_dtype(x, out, "out")
            if out.shape != x.shape:
                raise ValueError(f"out: shape {tuple(out.shape)} != x {tuple(x.shape)}")
            os_ = _tokens(out, "out", x.dim())
        heads = x.shape[1] if x.dim() == 3 else 1
        rc = _loader.lib.cpud_rms_norm(
            self._code,
            dt,
            x.data_ptr(),
            xs,
            out.data_ptr(),
            os_,
            weight.data_ptr(),
            wdt,
            x.shape[0],
            heads,
            hidden,
            float(eps),
        )
        check_rc(rc, "rms_norm")
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """residual += x; x = RMSNorm(residual) * weight; both [T, H] in place; weight as in
        ``rms_norm``."""
        dt = _dtype(x, "x")
        xs = _tokens(x, "x", 2)
        _same_dtype(x, residual, "residual")
        rs = _tokens(residual, "residual", 2)
        if residual.shape != x.shape:
            raise ValueError(f"residual: shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        wdt = _norm_weight(x, weight, x.shape[1])
        rc = _loader.lib.cpud_fused_add_rms_norm(
            self._code,
            dt,
            x.data_ptr(),
            xs,
            residual.data_ptr(),
            rs,
            weight.data_ptr(),
            wdt,
            x.shape[0],
            x.shape[1],
            float(eps),
        )
        check_rc(rc, "fused_add_rms_norm")

    # ----------------------------------------------------------- rotary

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor | None,
        cos_sin_cache: torch.Tensor,
        is_neox: bool = True,
    ) -> None:
        """Rotates q [T, nh, hd] and k [T, nkv, hd] in place.

        positions: [T] int64; cos_sin_cache: [max_pos, rot_dim] fp32, cos | sin halves;
        the first rot_dim dims of each head rotate (neox: halves, else gpt-j pairs).
        """
        dt = _dtype(q, "q")
        qs = _tokens(q, "q", 3)
        n_tok, nh, hd = q.shape
        _contig(positions, "positions", torch.int64, (n_tok,))
        _contig(cos_sin_cache, "cos_sin_cache", torch.float32, (None, None))
        ks, nkv, k_ptr = 0, 0, 0
        if k is not None:
            _same_dtype(q, k, "k")
            ks = _tokens(k, "k", 3)
            if k.shape[0] != n_tok or k.shape[2] != hd:
                raise ValueError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
            nkv, k_ptr = k.shape[1], k.data_ptr()
        max_pos, rot = cos_sin_cache.shape
        rc = _loader.lib.cpud_rotary_embedding(
            self._code,
            dt,
            positions.data_ptr(),
            q.data_ptr(),
            qs,
            k_ptr,
            ks,
            cos_sin_cache.data_ptr(),
            n_tok,
            nh,
            nkv,
            hd,
            rot,
            max_pos,
            int(bool(is_neox)),
        )
        check_rc(rc, "rotary_embedding", "positions < max_pos, even rot_dim <= head dim")

    # ------------------------------------------------------- activation

    def silu_and_mul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I] (HF rounding)."""
        dt, xs, out, os_, inter = _gated_io(x, out)
        rc = _loader.lib.cpud_silu_and_mul(
            self._code, dt, x.data_ptr(), xs, out.data_ptr(), os_, x.shape[0], inter
        )
        check_rc(rc, "silu_and_mul")
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, I] = gelu_tanh(x[:, :I]) * x[:, I:] for x [T, 2I]: torch's
        gelu(approximate="tanh") in fp32, rounded to x's dtype, then the product (HF)."""
        dt, xs, out, os_, inter = _gated_io(x, out)
        rc = _loader.lib.cpud_gelu_tanh_and_mul(
            self._code, dt, x.data_ptr(), xs, out.data_ptr(), os_, x.shape[0], inter
        )
        check_rc(rc, "gelu_tanh_and_mul")
        return out

    # ----------------------------------------------------------- argmax

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: index of the first largest value of each row of x [rows, n] (greedy
        sampling); NaN never counts, and a row with nothing above -inf gives 0."""
        dt = _dtype(x, "x")
        xs = _tokens(x, "x", 2)
        if x.shape[1] < 1:
            raise ValueError("x: rows must not be empty")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = _loader.lib.cpud_argmax_rows(
            self._code, dt, x.data_ptr(), xs, x.shape[0], x.shape[1], out.data_ptr()
        )
        check_rc(rc, "argmax")
        return out

    # --------------------------------------------------------- KV cache

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rotated: bool = True,
    ) -> None:
        """key/value [T, nkv, hd] -> caches [num_blocks, nkv, block_size, row] at slot_mapping
        [T] int64 (slot = block * block_size + offset; negative = skip); the caches' dtype
        (KV_DTYPE_CODE) says how rows are stored: converted, or quantized per row, each row
        rotated by a Walsh-Hadamard transform first unless rotated is False (ranks/paged_kv.py
        hadamard: cpud's quantized caches are rotated)."""
        dt = _dtype(key, "key")
        ks = _tokens(key, "key", 3)
        _same_dtype(key, value, "value")
        vs = _tokens(value, "value", 3)
        n_tok, nkv, hd = key.shape
        if value.shape != key.shape:
            raise ValueError(f"value: shape {tuple(value.shape)} != key {tuple(key.shape)}")
        kvt = _kv_caches(key_cache, value_cache, key.dtype, nkv, hd)
        _contig(slot_mapping, "slot_mapping", torch.int64, (n_tok,))
        num_blocks, _, block_size, _ = key_cache.shape
        rc = _loader.lib.cpud_write_kv_cache(
            self._code,
            dt,
            kvt,
            key.data_ptr(),
            value.data_ptr(),
            ks,
            vs,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slot_mapping.data_ptr(),
            n_tok,
            nkv,
            hd,
            num_blocks,
            block_size,
            int(rotated),
        )
        check_rc(rc, "write_kv_cache", "slot beyond the cache")

    # -------------------------------------------------------- attention

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        rotated: bool = True,
    ) -> torch.Tensor:
        """Causal paged attention with GQA for decode and chunked prefill.

        query, out: [T, nh, hd]; caches: [num_blocks, nkv, block_size, row] of any KV dtype
        (write_kv_cache, with the same `rotated`: a rotated cache's attention rotates the
        queries into the rows' basis and its output back);
        query_start_loc: [S+1] int32; seq_lens: [S] int32 (context incl. this step);
        block_tables: [S, max_blocks] int32.  Query i of sequence s is at position
        seq_lens[s] - q_len + i and sees keys j with p - sliding_window < j <= p.
        sinks: [nh] float32 logits joined to each head's softmax denominator (gpt-oss), or None.
        Rows of out outside every sequence are left untouched.
        """
        dt = _dtype(query, "query")
        qs = _tokens(query, "query", 3)
        n_tok, nh, hd = query.shape
        kvt = _kv_caches(key_cache, value_cache, query.dtype, None, hd)
        num_blocks, nkv, block_size, _ = key_cache.shape
        if sinks is not None:
            _contig(sinks, "sinks", torch.float32, (nh,))
        if nh % nkv:
            raise ValueError(f"query heads {nh} not a multiple of kv heads {nkv}")
        n_seq = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        _contig(seq_lens, "seq_lens", torch.int32, (n_seq,))
        _contig(query_start_loc, "query_start_loc", torch.int32, (n_seq + 1,))
        _contig(block_tables, "block_tables", torch.int32, (n_seq, None))
        if out is None:
            out = torch.empty(n_tok, nh, hd, dtype=query.dtype)
        else:
            _same_dtype(query, out, "out")
            if out.shape != query.shape:
                raise ValueError(f"out: shape {tuple(out.shape)} != query {tuple(query.shape)}")
        os_ = _tokens(out, "out", 3)
        rc = _loader.lib.cpud_paged_attention(
            self._code,
            dt,
            kvt,
            query.data_ptr(),
            qs,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            query_start_loc.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            out.data_ptr(),
            os_,
            n_tok,
            n_seq,
            nh,
            nkv,
            hd,
            num_blocks,
            block_size,
            float(scale),
            int(sliding_window),
            0 if sinks is None else sinks.data_ptr(),
            int(rotated),
        )
        check_rc(rc, "paged_attention", "query_start_loc / seq_lens / block_tables")
        return out

    def attention_items(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        nh: int,
        nkv: int,
        hd: int,
        sliding_window: int = 0,
    ) -> int:
        """The work items paged_attention runs these sequences as: one per query tile and kv
        head, and a decode (a sequence's queries that fit one tile) one per fixed range of key
        positions its window leaves."""
        n_seq = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        _contig(seq_lens, "seq_lens", torch.int32, (n_seq,))
        _contig(query_start_loc, "query_start_loc", torch.int32, (n_seq + 1,))
        n = _loader.lib.cpud_attention_items(
            query_start_loc.data_ptr(), seq_lens.data_ptr(), n_seq, nh, nkv, hd, sliding_window
        )
        check_rc(n if n < 0 else 0, "attention_items", "query_start_loc / seq_lens / heads")
        return n

    # ------------------------------------------------------------- GEMM

    def gemm_packed(
        self, x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out [M, N] = x [M, K] @ W^T (+ bias), fp32 accumulation; tuned for M <= 32.

        x and out are bf16 or fp32 (out defaults to x's dtype).  The avx512bf16 tier
        rounds fp32 x to bf16 (vdpbf16ps); the other tiers keep it fp32.
        """
        xdt, xs, out, odt, os_ = gemm_io(x, packed.n, packed.k, out)
        bias = packed.bias
        rc = _loader.lib.cpud_gemm_packed(
            self._code,
            x.data_ptr(),
            xdt,
            xs,
            packed.data.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            0,
            out.data_ptr(),
            odt,
            os_,
            x.shape[0],
            packed.n,
            packed.k,
        )
        check_rc(rc, "gemm_packed")
        return out

    def moe_experts(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        inter: int,
    ) -> torch.Tensor:
        """out [T, H] (x's dtype) = sum over each token's k experts ids[t] of weights[t] *
        down_e(silu(gate_e x) * up_e x); gate_up [E, *packed_shape(2 inter, H)] and down
        [E, *packed_shape(H, inter)] bf16 stacks (native/drivers/moe.c)."""
        tokens, hidden = x.shape
        experts, k = gate_up.shape[0], ids.shape[-1]
        _contig(x, "x", x.dtype, (None, None))
        _contig(gate_up, "gate_up", torch.bfloat16, (experts, *packed_shape(2 * inter, hidden)))
        _contig(down, "down", torch.bfloat16, (experts, *packed_shape(hidden, inter)))
        _contig(ids, "ids", torch.int32, (tokens, k))
        weights = weights.to(torch.float32).contiguous()
        _contig(weights, "weights", torch.float32, (tokens, k))
        out = torch.empty_like(x)
        rc = _loader.lib.cpud_moe_experts(
            self._code, _dtype(x, "x"), x.data_ptr(), tokens, hidden, inter,
            gate_up.data_ptr(), down.data_ptr(), experts, weights.data_ptr(), ids.data_ptr(),
            k, out.data_ptr(),
        )  # fmt: skip
        check_rc(rc, "moe_experts", "an expert id out of range?")
        return out

    def moe_ffn(
        self,
        x: torch.Tensor,
        router: PackedWeight,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        inter: int,
        flags: int,
    ) -> torch.Tensor:
        """The expert layer on x [T, H]: router logits, routing (cpud_moe_flags) and
        ``moe_experts`` in one native call (native/drivers/moe.c)."""
        tokens, hidden = x.shape
        experts = gate_up.shape[0]
        _contig(x, "x", x.dtype, (None, hidden))
        _contig(gate_up, "gate_up", torch.bfloat16, (experts, *packed_shape(2 * inter, hidden)))
        _contig(down, "down", torch.bfloat16, (experts, *packed_shape(hidden, inter)))
        if (router.n, router.k) != (experts, hidden):
            raise ValueError(f"router: {router.n} x {router.k}, expected {experts} x {hidden}")
        out = torch.empty_like(x)
        rc = _loader.lib.cpud_moe_ffn(
            self._code, _dtype(x, "x"), x.data_ptr(), tokens, hidden, inter, experts, top_k,
            flags, router.data.data_ptr(), gate_up.data_ptr(), down.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        check_rc(rc, "moe_ffn")
        return out

    # ------------------------------------------------------------ probe

    def read_probe(self, buf: torch.Tensor) -> int:
        """Streams buf (contiguous, 64-byte aligned, nbytes % 4096 == 0) with all threads,
        each reading its contiguous share; returns a checksum.  Fill buf with random data
        (constant pages read slower on some machines, this one included)."""
        nbytes = buf.numel() * buf.element_size()
        if not buf.is_contiguous() or nbytes % 4096 or buf.data_ptr() % 64:
            raise ValueError("buf: contiguous, 64-byte aligned, size a multiple of 4096 bytes")
        return int(_loader.lib.cpud_read_probe(self._code, buf.data_ptr(), nbytes))

    def compute_probe(self, iters: int) -> float:
        """Runs iters x 16 independent register multiply-adds of this tier's widest kind
        (vdpbf16ps on avx512bf16) on every thread; returns the FLOPs done.  Timed by the
        caller, it gives the instruction peak the GEMM is measured against."""
        if iters < 0:
            raise ValueError(f"iters must be >= 0, got {iters}")
        flops = float(_loader.lib.cpud_compute_probe(self._code, iters))
        check_rc(0 if flops >= 0 else -1, "compute_probe")
        return flops
