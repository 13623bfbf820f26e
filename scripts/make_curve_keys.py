"""Write a CurveZMQ certificate pair: NAME.key (public, give it to the other side) and
NAME.key_secret (keep it, mode 0600).

    python scripts/make_curve_keys.py DIR daemon     # --curve-secret-key DIR/daemon.key_secret
    python scripts/make_curve_keys.py DIR alice      # put alice.key in the --curve-clients directory
"""

import os
import sys

import zmq.auth


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    directory, name = sys.argv[1], sys.argv[2]
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_file, 0o600)
    print(public_file)
    print(secret_file)


if __name__ == "__main__":
    main()
