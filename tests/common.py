"""What many tests share: request parameters and a free port."""

import socket

# Greedy and never ending early: a request's token count is exactly its max_tokens.
GREEDY = {"temperature": 0, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
