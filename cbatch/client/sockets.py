"""The socket a client opens towards a daemon: the DEALER to the front-end, with
CurveZMQ when the daemon requires it."""

import os
import secrets

import zmq
import zmq.auth

from cbatch.client import session  # SEND_TIMEOUT_S read at each connect: tests shorten it
from cbatch.errors import INVALID_CONFIG, CbatchError

# How long a closed client's last messages (the cancels of its running requests) may wait
# for the daemon in libzmq's I/O thread; closing never blocks on them (the process-wide
# context is never terminated).
CLOSE_LINGER_MS = 2000


def use_curve(sock, server_key_file: str | None, client_key_file: str | None) -> None:
    """Speak CurveZMQ to a daemon that requires it. server_key_file: the daemon's public
    certificate; client_key_file: this client's secret certificate (without one, a fresh
    key pair, which a daemon that admits only listed clients refuses). Defaults come from
    CBATCH_CURVE_SERVER_KEY and CBATCH_CURVE_CLIENT_KEY."""
    server_key_file = server_key_file or os.environ.get("CBATCH_CURVE_SERVER_KEY")
    client_key_file = client_key_file or os.environ.get("CBATCH_CURVE_CLIENT_KEY")
    if not server_key_file:
        return
    try:
        server_public, _ = zmq.auth.load_certificate(server_key_file)
        if client_key_file:
            client_public, client_secret = zmq.auth.load_certificate(client_key_file)
        else:
            client_public, client_secret = zmq.curve_keypair()
    except (OSError, ValueError) as err:
        raise CbatchError(INVALID_CONFIG, f"cannot read a CurveZMQ certificate: {err}") from None
    if not client_secret:
        raise CbatchError(INVALID_CONFIG, f"{client_key_file} holds no secret key (use the .key_secret file)")
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, client_public, client_secret


def make_dealer(zctx, endpoint: str, server_key_file: str | None, client_key_file: str | None):
    """The client's socket to the front-end. Its routing id is fixed for the client's life,
    so after a reconnect the front-end still knows whose requests these are."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDTIMEO, int(session.SEND_TIMEOUT_S * 1000))
    dealer.setsockopt(zmq.ROUTING_ID, b"c" + secrets.token_bytes(15))  # ids starting 0x00 are libzmq's
    use_curve(dealer, server_key_file, client_key_file)
    dealer.connect(endpoint)
    return dealer


def close_dealer(dealer, last_messages: list[list[bytes]]) -> None:
    """Queue last_messages without blocking (as many as the socket takes now), then close:
    they still go out after the close, for CLOSE_LINGER_MS. Works for a blocking and an
    asyncio socket alike (a plain socket shadows the asyncio one's)."""
    if dealer.closed:
        return
    plain = zmq.Socket.shadow(dealer.underlying)
    for frames in last_messages:
        try:
            plain.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:  # the daemon takes no more now: the rest would block
            break
    dealer.close(linger=CLOSE_LINGER_MS if last_messages else 0)
