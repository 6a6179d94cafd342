"""What a data-parallel replica's supervisor is started with (cpud.replicas writes it, the
replica reads it): the engine and serve settings and its place on the host; nothing secret
(the API key goes to the replica on its stdin)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec

from cpud.placement.replicas import ReplicaPlacement
from cpud.settings.config import EngineArgs, ServeArgs


class ReplicaSpec(msgspec.Struct, frozen=True):
    """What a replica's supervisor needs: nothing secret (the API key comes on its stdin)."""

    engine_args: dict[str, Any]  # EngineArgs' fields
    serve_args: ServeArgs  # without the API key
    placement: ReplicaPlacement


def replica_spec(
    engine_args: EngineArgs, serve_args: ServeArgs, placement: ReplicaPlacement
) -> ReplicaSpec:
    fields = dataclasses.asdict(engine_args)
    if fields["model"] is not None:
        fields["model"] = str(fields["model"])
    public = dataclasses.replace(
        serve_args,
        api_key=None,
        host=placement.host,
        port=placement.port,
        replica=placement.index,
        data_parallel_size=1,
        router=False,
        router_args=None,
    )
    return ReplicaSpec(fields, public, placement)


def write_spec(path: Path, spec: ReplicaSpec) -> None:
    path.write_bytes(msgspec.json.encode(spec))


def read_spec(path: str) -> ReplicaSpec:
    return msgspec.json.decode(Path(path).read_bytes(), type=ReplicaSpec)
