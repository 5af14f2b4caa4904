"""Entry point of one replica process: ``python -m gpuyard.serve.replica REF FD INDEX OPTIONS_JSON``."""

from __future__ import annotations

import json
import socket
import sys

from gpuyard.serve.access import Access
from gpuyard.serve.runner import ServeOptions, serve_replica


def main(argv: list[str]) -> None:
    """Serve on the inherited listening socket ``FD`` as replica ``INDEX``."""
    ref, fd, index, payload = argv
    sock = socket.socket(fileno=int(fd))
    serve_replica(ref, ServeOptions.from_json(json.loads(payload)), sock, int(index), Access.from_env())


if __name__ == "__main__":
    main(sys.argv[1:])
