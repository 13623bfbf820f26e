"""SIGHUP reads the API keys file again (`cbatch-worker --api-keys-file`), with nothing
dropped: the front-end's ledger takes the new weights and limits (what each tenant has in
flight and in its token bucket carries over), and each HTTP server process, which checks
the keys itself, is sent SIGHUP in turn. A file that cannot be used keeps the keys there
were, everywhere, and says why in the log.

The signal only sets a flag; the supervisor's loop acts on it (`poll`) within one turn,
never inside a handler that may interrupt the front-end mid-message.
"""

import logging
import signal

from cbatch.api_keys import load_keys
from cbatch.errors import CbatchError
from cbatch.workers.daemon.tenant_ledger import TenantLedger

log = logging.getLogger("cbatch.daemon")


class KeysReload:
    def __init__(self, ledger: TenantLedger, http_servers):
        self.ledger = ledger
        self.http_servers = http_servers  # HttpServers, or None without --http
        self.is_requested = False
        signal.signal(signal.SIGHUP, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.is_requested = True

    def poll(self) -> None:
        if not self.is_requested:
            return
        self.is_requested = False
        if not self.ledger.keys_file:
            log.info("cbatch-worker: SIGHUP: no --api-keys-file to read again")
            return
        try:
            load_keys(self.ledger.keys_file)  # checked once here: the HTTP servers read the same file
            self.ledger.reload()
        except CbatchError as err:
            log.error("cbatch-worker: SIGHUP: keeping the API keys there were: %s", err.message)
            return
        if self.http_servers is not None:
            self.http_servers.reload()
        log.info("cbatch-worker: API keys reloaded from %s: %d tenants", self.ledger.keys_file, len(self.ledger.keys))
