"""A TCP relay that records every byte an upstream sends on each connection, and the HTTP
responses in them (parsed with h11): what a server really put on the wire, to compare with what
a client got through something in between."""

from __future__ import annotations

import asyncio
import socket
import threading

import h11


class RecordingRelay:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.streams: list[bytearray] = []  # per connection, upstream -> client, in order
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind((host, 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recording-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")

    @property
    def url(self) -> str:
        return f"http://{self.upstream[0]}:{self.port}"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._client, sock=self._sock)

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.close()

    async def _client(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            down_w.close()
            return
        rec = bytearray()
        self.streams.append(rec)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, record: bytearray | None) -> None:
            try:
                while data := await r.read(65536):
                    if record is not None:
                        record += data
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(down_r, up_w, None), pipe(up_r, down_w, rec))

    def responses(self) -> dict[tuple[int, int], dict]:
        """Every whole response recorded, keyed (connection, position on it): status, headers,
        body (de-chunked)."""
        out: dict[tuple[int, int], dict] = {}
        for ci, raw in enumerate(list(self.streams)):
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # h11 wants a request first
            conn.send(h11.EndOfMessage())
            conn.receive_data(bytes(raw))
            cur: dict | None = None
            while True:
                try:
                    ev = conn.next_event()
                except h11.RemoteProtocolError:
                    break
                if ev is h11.NEED_DATA or ev is h11.PAUSED or isinstance(ev, h11.ConnectionClosed):
                    if ev is h11.PAUSED and conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                        conn.start_next_cycle()
                        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                        conn.send(h11.EndOfMessage())
                        continue
                    break
                if isinstance(ev, h11.Response):
                    cur = {"status": ev.status_code, "headers": list(ev.headers), "body": bytearray()}
                elif isinstance(ev, h11.Data) and cur is not None:
                    cur["body"] += ev.data
                elif isinstance(ev, h11.EndOfMessage) and cur is not None:
                    cur["body"] = bytes(cur["body"])
                    out[(ci, sum(1 for k in out if k[0] == ci))] = cur
                    cur = None
        return out
