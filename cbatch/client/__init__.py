"""The client library: a ZeroMQ session to the daemon, with tokens read from the shared
ring when the daemon is on this host. `Client` is synchronous, `AsyncClient` asyncio."""

from cbatch.client.async_client import AsyncClient
from cbatch.client.sync_client import Client

__all__ = ["AsyncClient", "Client"]
