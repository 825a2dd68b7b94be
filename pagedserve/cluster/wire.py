"""What an engine replica streams back per request: a batch of engine-core outputs tagged with the
replica that produced it (no Ray imports)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.messages import EngineCoreOutput


@dataclass(slots=True)
class ReplicaChunk:
    """Outputs of one request since the previous chunk (token ids only; text lives in the front end)."""

    replica_id: str
    outputs: list[EngineCoreOutput]
