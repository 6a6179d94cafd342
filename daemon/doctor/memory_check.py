"""Whether the model fits: weights, KV cache and runtime per rank against its NUMA node's
available memory (capped by the cgroup), and the largest KV cache that would fit."""

from __future__ import annotations

from cpud.doctor.planning import Failed, Headroom, Planning
from cpud.doctor.report import Check, gib


def _headroom_value(room: Headroom | None) -> dict[str, object]:
    if room is None:
        return {}
    return {
        "largest_kv_cache_bytes": room.kv_bytes,
        "largest_kv_cache_gib": room.kv_gib,
        "largest_kv_tokens": room.kv_tokens,
        "largest_max_model_len": room.max_model_len,
    }


def _headroom_text(room: Headroom) -> str:
    if room.kv_tokens == 0:
        return "no KV cache fits next to the weights and runtime"
    return (
        f"the largest KV cache that fits is {room.kv_gib:.2f} GiB per rank (--kv-cache-space / "
        f"VLLM_CPU_KVCACHE_SPACE), {room.kv_tokens} tokens: --max-model-len up to "
        f"{room.max_model_len}"
    )


def memory_check(planning: Planning) -> Check:
    config, memory, topology, room = (
        planning.config,
        planning.memory,
        planning.topology,
        planning.headroom,
    )
    value: dict[str, object] = {}
    if not isinstance(config, Failed):
        value |= {
            "model": str(config.model_dir),
            "architecture": config.model.architecture,
            "dtype": str(config.dtype).removeprefix("torch."),
            "tp": config.tp,
            "max_model_len": config.max_model_len,
            "kv_cache_bytes_per_rank": config.kv_cache_bytes_per_rank,
        }
    value |= _headroom_value(room)
    if isinstance(memory, Failed):
        value |= {"fits": False, "error": memory.reason}
        if memory.upstream:
            return Check(
                "memory plan",
                "warn",
                f"not planned ({memory.reason})",
                value,
                ("fix the failed item above first",),
            )
        advice = [memory.reason]
        if room is not None:
            advice.append(_headroom_text(room))
        return Check("memory plan", "fail", "does not fit", value, tuple(advice))

    assert not isinstance(topology, Failed)
    ranks = []
    for rank in memory.ranks:
        node = None if rank.numa_node is None else topology.node(rank.numa_node)
        ranks.append(
            {
                "rank": rank.rank,
                "numa_node": rank.numa_node,
                "weight_bytes": rank.weight_bytes,
                "kv_bytes": rank.kv_bytes,
                "runtime_bytes": rank.overhead_bytes,
                "total_bytes": rank.total_bytes,
                "budget_bytes": rank.budget_bytes,
                "budget_source": rank.budget_source,
                "node_mem_available_bytes": None if node is None else node.mem_available,
            }
        )
    value |= {
        "fits": True,
        "kv_tokens": memory.kv_tokens,
        "num_kv_blocks": memory.num_kv_blocks,
        "kv_cache_dtype": memory.kv_cache_dtype,
        "kv_block_bytes": memory.kv_block_bytes,
        "ranks": ranks,
        "warnings": list(memory.warnings),
    }
    tight = min(memory.ranks, key=lambda r: r.budget_bytes - r.total_bytes)
    summary = (
        f"fits: per rank weights {gib(tight.weight_bytes)} + KV cache {gib(tight.kv_bytes)} "
        f"({memory.kv_tokens} tokens) + runtime {gib(tight.overhead_bytes)} = "
        f"{gib(tight.total_bytes)} of {gib(tight.budget_bytes)}"
    )
    details = list(memory.describe())
    if room is not None:
        details.append(_headroom_text(room))
    status = "warn" if memory.warnings else "ok"
    return Check("memory plan", status, summary, value, tuple(memory.warnings), tuple(details))
