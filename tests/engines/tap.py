"""A recording TCP relay: put it between the gate and the engine to keep the exact bytes the engine sent.

The relay copies bytes both ways unchanged and records, per connection, what came back from the engine.
:meth:`Tap.response_bodies` then decodes those bytes as HTTP/1.1 with ``h11`` (chunked transfer coding
included, several responses per kept-alive connection), giving the body the engine sent for each
request. Comparing that with what a client read from the gate proves the gate relays byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib

import h11


class Tap:
    """``await start()`` -> port to use as the gate's upstream; ``response_bodies()`` after the traffic."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.recorded: list[bytearray] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Drop the relayed connections first: an idle kept-alive one would hold ``wait_closed`` up."""
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await task
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)
        record = bytearray()
        self.recorded.append(record)
        to_up = asyncio.create_task(self._pipe(client_r, up_w, None))
        to_client = asyncio.create_task(self._pipe(up_r, client_w, record))
        self._tasks.update((to_up, to_client))
        await asyncio.wait((to_up, to_client), return_when=asyncio.FIRST_COMPLETED)
        for task in (to_up, to_client):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await task
            self._tasks.discard(task)
        for writer in (up_w, client_w):
            writer.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bytearray | None
    ) -> None:
        while data := await reader.read(65536):
            if record is not None:
                record.extend(data)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    def response_bodies(self) -> list[tuple[int, bytes]]:
        """(status, decoded body) of every complete response the engine sent, in connection order."""
        out: list[tuple[int, bytes]] = []
        for raw in self.recorded:
            out.extend(_decode_responses(bytes(raw)))
        return out


def _decode_responses(raw: bytes) -> list[tuple[int, bytes]]:
    """Parse back-to-back HTTP/1.1 responses (as a client would) and return their bodies."""
    conn = h11.Connection(our_role=h11.CLIENT)
    request = h11.Request(method="POST", target="/", headers=[("Host", "engine"), ("Content-Length", "0")])
    out: list[tuple[int, bytes]] = []
    conn.send(request)
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    status, body = 0, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            if event is h11.PAUSED and conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
                conn.send(request)
                conn.send(h11.EndOfMessage())
                continue
            return out
        if isinstance(event, h11.Response):
            status, body = event.status_code, bytearray()
        elif isinstance(event, h11.Data):
            body.extend(event.data)
        elif isinstance(event, h11.EndOfMessage):
            out.append((status, bytes(body)))
