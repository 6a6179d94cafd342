"""A Hugging Face MXFP4 checkpoint tensor (transformers' mxfp4 quantization, gpt-oss): stored as
`NAME_blocks` (uint8 [..., G, 16], byte j holding codes 2j and 2j + 1 of a 32-value block) and
`NAME_scales` (uint8 [..., G], the block's E8M0 exponent), read as one tensor [..., G * 32]
of its values (cpud.native.mxfp4 gives the format): value = E2M1(code) * 2^(e - 127)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from cpud.native.mxfp4 import E2M1_DOUBLED, check_mxfp4_scales, from_hf_blocks
from cpud.ranks.gguf_stack_rows import StackTensor

BLOCKS, SCALES = "_blocks", "_scales"
_VALUES = np.asarray(E2M1_DOUBLED, dtype=np.float32)  # E2M1 doubled: scaled by 2^(e - 128)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32] from blocks [..., G, 16] and scales [..., G] (uint8)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    exponent = scales.astype(np.int32)[..., None] - 128
    values = np.ldexp(_VALUES[codes], exponent)
    return values.reshape(*blocks.shape[:-2], -1)


def _shape(tensor: Any) -> list[int]:
    return list(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)


class Mxfp4Source:
    """A `_blocks` / `_scales` pair as one checkpoint tensor: `get_shape()` and reads by ranges
    of the leading dimensions (the last, the values, whole), float32."""

    def __init__(self, name: str, blocks: Any, scales: Any):
        self.name, self.blocks, self.scales = name, blocks, scales
        shape, scale_shape = _shape(blocks), _shape(scales)
        if len(shape) < 3 or shape[-1] != 16 or scale_shape != shape[:-1]:
            raise ValueError(
                f"{name}: MXFP4 blocks [..., G, 16] and scales [..., G] expected, got "
                f"{shape} and {scale_shape}"
            )
        self.shape = [*shape[:-2], shape[-2] * 32]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) >= len(self.shape) and keys[len(self.shape) - 1] != slice(None):
            raise TypeError(f"{self.name}: MXFP4 values are read whole along the last dimension")
        lead = keys[: len(self.shape) - 1]
        blocks = np.asarray(self.blocks[lead].numpy(), dtype=np.uint8)
        scales = np.asarray(self.scales[lead].numpy(), dtype=np.uint8)
        check_mxfp4_scales(scales, self.name)
        return torch.from_numpy(dequantize(blocks, scales))


def pair_names(names: set[str]) -> dict[str, str]:
    """`_blocks` tensor -> its `_scales` tensor, for each pair the checkpoint has."""
    return {
        name: name.removesuffix(BLOCKS) + SCALES
        for name in names
        if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in names
    }


class Mxfp4Stack:
    """Rows `rows` of every expert of an MXFP4 expert stack (Mxfp4Source [E, rows, columns])
    as GGUF MXFP4 rows, read like a GGUF loader's TensorSource over an expert stack: the experts
    load from it dense or stay in their blocks (the stack's bytes are read once, here)."""

    def __init__(self, source: Mxfp4Source, rows: slice):
        blocks = np.asarray(source.blocks[:].numpy(), dtype=np.uint8)[:, rows]
        scales = np.asarray(source.scales[:].numpy(), dtype=np.uint8)[:, rows]
        check_mxfp4_scales(scales, source.name)
        data = np.ascontiguousarray(from_hf_blocks(blocks, scales))
        experts, count, columns = data.shape[0], data.shape[1], source.shape[-1]
        shape = np.array([columns, count, experts])
        self.tensor = StackTensor(source.name, GGMLQuantizationType.MXFP4, shape, data)
        self.dtype = torch.float32  # expert rows read dense come out in it

    def get_shape(self) -> list[int]:
        columns, count, experts = (int(d) for d in self.tensor.shape)
        return [experts, count, columns]
