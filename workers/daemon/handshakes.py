"""The front-end's handshakes: which clients said HELLO, whether each reads the ring, and
the WELCOME each gets (again when the worker becomes ready: one sent while the model
loaded lacks the model's description and chat template)."""

from cbatch.config import DaemonConfig
from cbatch.errors import VERSION_MISMATCH, CbatchError
from cbatch.ipc.ring import is_ring_ordered
from cbatch.protocol import PROTOCOL_VERSION, MsgType, field
from cbatch.workers.daemon.client_link import ClientLink
from cbatch.workers.daemon.worker_link import WorkerLink


class Handshakes:
    def __init__(self, clients: ClientLink, config: DaemonConfig, worker: WorkerLink, ring_name: str,
                 tick_endpoint: str):
        self._clients, self._config, self._worker = clients, config, worker
        self.ring_name, self._tick_endpoint = ring_name, tick_endpoint  # the supervisor renames a recreated ring
        self._use_ring: dict[bytes, bool] = {}  # identity -> reads the ring, for every client welcomed

    def reads_ring(self, identity: bytes) -> bool:
        return self._use_ring.get(identity, False)

    def forget(self, identity: bytes) -> None:
        self._use_ring.pop(identity, None)

    def hello(self, identity: bytes, body: dict) -> None:
        version = field(body, "version", int)
        if version != PROTOCOL_VERSION:
            raise CbatchError(VERSION_MISMATCH,
                              f"client speaks protocol {version}, this daemon {PROTOCOL_VERSION}; upgrade cbatch")
        # Off x86-64 the ring's lock-free protocol lacks the fences it would need: relay.
        use_ring = bool(field(body, "use_ring",
                              bool)) and self._config.endpoint.startswith("ipc://") and is_ring_ordered()
        self._use_ring[identity] = use_ring
        self._welcome(identity)

    def welcome_unknown(self, identity: bytes) -> None:
        """A client that speaks without a HELLO to this daemon (its socket reconnected by itself to a
        daemon restarted on the endpoint) holds an old handshake and maybe another ring: it is
        relayed until it says HELLO, and this WELCOME tells it so."""
        if identity not in self._use_ring:
            self.hello(identity, {"version": PROTOCOL_VERSION, "use_ring": False})

    def welcome_all(self) -> None:
        for identity in self._use_ring:
            self._welcome(identity)

    def _welcome(self, identity: bytes) -> None:
        ready, use_ring = self._worker.ready, self._use_ring[identity]
        self._clients.send(identity, MsgType.WELCOME, {
            "version": PROTOCOL_VERSION, "model": ready.model if ready else "",
            "parallel": self._config.engine.parallel,
            "ctx_per_seq": ready.ctx_per_seq if ready else 0, "use_ring": use_ring, **(ready.chat if ready else {}),
            "ring_name": self.ring_name if use_ring else "", "tick_endpoint": self._tick_endpoint if use_ring else ""})
