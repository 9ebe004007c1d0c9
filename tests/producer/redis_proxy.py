"""A TCP proxy in front of the test Redis that a test can cut and restore.

Cutting it closes every connection and stops listening (clients see a
refused connection, as when Redis restarts); ``blackhole`` accepts and
never answers (a paused Redis or a dropped route). The data stays in the
real Redis behind it, so a test sees the producer reconnect, not a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit

from shared.embedded_redis import free_port


class RedisProxy:
    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.port = free_port()
        self.url = urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.port}"))
        self.blackhole = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)

    async def cut(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self.blackhole:
            return  # hold the connection open and say nothing
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.add(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.close()
