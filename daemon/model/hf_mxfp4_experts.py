"""A Hugging Face checkpoint's MXFP4 expert stacks (transformers' mxfp4 quantization, gpt-oss:
`...mlp.experts.gate_up_proj_blocks` [E, rows, G, 16] with `..._scales` [E, rows, G], the same
for down_proj) read from the safetensors headers alone, without torch: the memory plan and
doctor count them at their packed size, as the ranks keep them (ranks/gguf_experts.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cpud.model.safetensors_check import check_safetensors, weight_files

BLOCKS, SCALES = "_blocks", "_scales"
STACKS = (".experts.gate_up_proj", ".experts.down_proj")
BLOCK_VALUES = 32  # values of one MXFP4 block: 16 bytes of E2M1 pairs and one E8M0 scale


@dataclass(frozen=True)
class Mxfp4ExpertStack:
    name: str  # the stack's name without `_blocks` / `_scales`
    values: int  # weights the stack holds (experts x rows x columns)
    nbytes: int  # bytes of its blocks and scales as stored


def mxfp4_expert_stacks(model_dir: str | Path) -> list[Mxfp4ExpertStack]:
    """The MXFP4 expert stacks of a checkpoint directory ([] for a GGUF file or a checkpoint
    without them): each `_blocks` tensor with its `_scales`, possibly in another file."""
    if Path(model_dir).is_file():
        return []
    tensors = {}
    for path in weight_files(model_dir):
        tensors.update(check_safetensors(path))
    stacks = []
    for name, blocks in sorted(tensors.items()):
        stem = name.removesuffix(BLOCKS)
        scales = tensors.get(stem + SCALES)
        if stem == name or not stem.endswith(STACKS) or scales is None:
            continue
        values = math.prod(blocks.shape[:-1]) * BLOCK_VALUES
        nbytes = blocks.end - blocks.begin + scales.end - scales.begin
        stacks.append(Mxfp4ExpertStack(stem, values, nbytes))
    return stacks
