"""One thread owns each ZeroMQ socket (sockets are not thread-safe): the common start/stop.

A bind failure (address in use, no permission on the ipc directory) surfaces in ``start``,
in the caller's thread, with the real error — not as a silent dead thread.
"""

from __future__ import annotations

import threading


class SocketThread:
    name = "hsstream-socket"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._bound.wait(10)
        if self._error:
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _main(self) -> None:
        try:
            state = self.bind()
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            self._bound.set()
            return
        self._bound.set()
        self.serve(state)

    def bind(self) -> object:  # pragma: no cover - abstract
        raise NotImplementedError

    def serve(self, state: object) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()
