"""One expert's rows of a GGUF expert stack (blk.N.ffn_{gate,up,down}_exps: [experts, rows,
columns] in the file's block format), dense in the model's dtype; the rest is not read."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from cpud.ranks.gguf_blocks import Blocks, tensor_shape, to_dense
from cpud.settings.errors import ConfigError


def expert_rows(source, expert: int, rows: slice, columns: slice = slice(None)) -> torch.Tensor:
    """Rows and a whole-block column range of `expert` from a GGUF loader's tensor source
    (ranks/gguf_loader.py's TensorSource over a 3-D tensor)."""
    tensor = source.tensor
    shape = tensor_shape(tensor)
    if len(shape) != 3:
        raise ConfigError(f"tensor {tensor.name} has shape {shape}, not [experts, rows, columns]")
    experts, n_rows, n_cols = shape
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    start, stop, _ = columns.indices(n_cols)
    if start % block or stop % block:
        raise ConfigError(
            f"tensor {tensor.name} ({tensor.tensor_type.name}) cannot be read from column "
            f"{start} to {stop}: its blocks hold {block} values"
        )
    raw = tensor.data.view(np.uint8).reshape(experts, n_rows, -1)
    picked = raw[expert, rows, start // block * type_size : stop // block * type_size]
    count = len(range(*rows.indices(n_rows)))
    return to_dense(Blocks(tensor.tensor_type, picked, (count, stop - start)), source.dtype)
