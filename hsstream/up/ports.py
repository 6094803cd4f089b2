"""Whether a port is free, asked before ``hsstream up`` starts anything.

Checked up front (``Supervisor._prepare``) so a taken port is an ``UpError`` naming the
setting to change, not a child that dies after vLLM has loaded for a minute.
"""

from __future__ import annotations

import socket


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
