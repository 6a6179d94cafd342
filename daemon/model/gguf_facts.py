"""A GGUF model as it travels from the process that read and checked the file (the supervisor)
to the ranks: the config and the tensor table (ModelFacts). A rank maps the tensors from that
table instead of parsing the file's metadata again (about 0.7 s for a 49k-token vocabulary);
when the file has changed since, it reads the file itself."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

from cpud.model.gguf_model import GGUFModel, TensorInfo, read_gguf_model, remember_gguf_model
from cpud.model.model_config import ModelConfig
from cpud.protocol.launch import ModelFacts, TensorFacts

_Q = GGMLQuantizationType
# Tensor types the gguf package's reader shows as arrays of values (all others: raw bytes).
_VALUE_TYPES = {
    _Q.F16: np.float16,
    _Q.F32: np.float32,
    _Q.F64: np.float64,
    _Q.I8: np.int8,
    _Q.I16: np.int16,
    _Q.I32: np.int32,
    _Q.I64: np.int64,
}


def gguf_facts(path: Path, config: msgspec.Raw) -> ModelFacts:
    """The facts of the file as this process read it (read_gguf_model, cached); without a
    tensor table when the tensors were handed to a loader already or the file is big-endian."""
    model = read_gguf_model(path)
    st = os.stat(model.path)
    tensors = None
    if model.data and all(t.data.dtype.byteorder != ">" for t in model.data.values()):
        tensors = [
            TensorFacts(t.name, int(t.tensor_type), t.shape.tolist(), t.data_offset, t.n_bytes)
            for t in model.data.values()
        ]
    return ModelFacts(config, st.st_size, st.st_mtime_ns, model.architecture, tensors)


def _mapped(mapped: np.ndarray, entry: TensorFacts) -> ReaderTensor:
    """One tensor over the file's mapping, shaped as the gguf package's reader shapes it."""
    qtype = _Q(entry.type)
    shape = tuple(reversed(entry.dims))
    raw = mapped[entry.offset : entry.offset + entry.n_bytes]
    kind = _VALUE_TYPES.get(qtype)
    if kind is None:
        data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
    else:
        data = raw.view(kind).reshape(shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    return ReaderTensor(
        name=entry.name,
        tensor_type=qtype,
        shape=np.array(entry.dims, dtype=np.uint64),
        n_elements=int(np.prod(entry.dims)),
        n_bytes=entry.n_bytes,
        data_offset=entry.offset,
        data=data,
        field=None,
    )


def adopt_gguf_facts(path: Path, facts: ModelFacts, config: ModelConfig) -> bool:
    """Make the facts (with their tensor table) this process's read of the GGUF file at `path`:
    read_gguf_model and mapped_tensors then answer from them. False when the file has changed
    since they were read."""
    if facts.tensors is None or facts.architecture is None:
        raise ValueError("facts without a tensor table")
    try:
        mapped = np.memmap(path, mode="r")
    except (OSError, ValueError):
        return False
    if len(mapped) != facts.file_size:
        return False
    plain = mapped.view(np.ndarray)
    data = {entry.name: _mapped(plain, entry) for entry in facts.tensors}
    infos = {
        entry.name: TensorInfo(
            entry.name,
            _Q(entry.type).name,
            tuple(reversed(entry.dims)),
            entry.n_bytes,
        )
        for entry in facts.tensors
    }
    model = GGUFModel(Path(path).resolve(), facts.architecture, config, infos, data)
    return remember_gguf_model(model, facts.file_size, facts.file_mtime_ns)
