"""The daemon's open files: every client connection is a descriptor, and libzmq's ipc
listener aborts the process when an accept finds none left (the front-end keeps a reserve
free, see connection_guard). So the daemon takes every descriptor its hard limit allows, and
says at start when that limit is too low for the clients its settings let in."""

import logging
import resource

from cbatch.config import DaemonConfig
from cbatch.workers.daemon.connection_guard import FREE_DESCRIPTORS_FRACTION, MIN_FREE_DESCRIPTORS

log = logging.getLogger("cbatch.daemon")

MAX_OPEN_FILES = 1 << 20  # the soft limit asked for when the hard limit is unlimited
# The daemon's own descriptors: about 24 at start (its sockets, libzmq's, the ring, the
# HTTP listener), with room for a restarting worker's sockets and pipes.
OWN_DESCRIPTORS = 64


def raise_open_file_limit() -> None:
    """Take all the descriptors the hard limit allows (the common soft limit of 1024 is
    about a thousand local clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass  # keep the limit we have


def num_descriptors_needed(num_clients: int) -> int:
    """The open-file limit under which num_clients connections fit beside the daemon's own
    descriptors and the reserve the front-end keeps free (a sixteenth of the limit, at
    least MIN_FREE_DESCRIPTORS)."""
    used = OWN_DESCRIPTORS + num_clients
    return max(used + MIN_FREE_DESCRIPTORS, -(-used * FREE_DESCRIPTORS_FRACTION // (FREE_DESCRIPTORS_FRACTION - 1)))


def warn_if_too_few_descriptors(config: DaemonConfig) -> None:
    """At least one client per request the daemon admits (each priority: --parallel running,
    its queue waiting), plus the HTTP server processes."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    num_clients = sum(config.engine.max_in_flight) + (config.http_processes if config.http_address else 0)
    needed = num_descriptors_needed(num_clients)
    if hard != resource.RLIM_INFINITY and hard < needed:
        log.warning("the open-file hard limit is %d, under the %d that %d clients (one per request in flight, "
                    "--parallel + --max-queue interactive and --parallel + --max-batch-queue batch) need: more "
                    "clients are refused, and a burst of connects can abort the daemon; raise the hard limit "
                    "(ulimit -Hn, systemd's LimitNOFILE=) or lower --max-queue and --max-batch-queue",
                    hard, needed, num_clients)
