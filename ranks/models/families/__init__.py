"""The families cpud ships, one module each. A new family: a module here declaring FAMILY,
listed below, and its tests (README: Adding a model family)."""

from __future__ import annotations

from cpud.ranks.models.families import llama, mistral, moe, opt, qwen

FAMILIES = (llama.FAMILY, mistral.FAMILY, qwen.FAMILY, moe.FAMILY, opt.FAMILY)
