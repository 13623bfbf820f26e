"""What the supervisor hands to each decode worker it starts, and the worker's identity."""

from dataclasses import dataclass

from cbatch.config import EngineConfig


def worker_identity(generation: int) -> bytes:
    """The routing id a worker speaks to the front-end under: one per generation, so the
    front-end can tell a dead worker's last messages from the live one's."""
    return f"worker-{generation}".encode()


@dataclass(frozen=True)
class WorkerPlan:
    """What the supervisor hands to each worker it starts."""

    engine: EngineConfig
    control_endpoint: str  # the front-end's ROUTER for workers
    tick_endpoint: str  # this worker's PUB socket for ring wake-ups
    ring_name: str
    generation: int
