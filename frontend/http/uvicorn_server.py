"""uvicorn's server, told to stop at once: a stop signal or a lost engine ends the serving without
uvicorn's polling delays.

Runs in the HTTP frontend process. uvicorn looks at its exit flag every 0.1 s and, once it is set,
waits another 0.1 s before draining; a supervisor restarting a crashed engine waits for both. Here
`stop()` (safe from any thread or a signal handler) wakes the loop at once, and `stop(drain=False)`
— for an engine that is gone, whose streams have all had their error events — closes the listening
socket and the connections without a drain, then runs the application's shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

TICK_S = 0.1  # uvicorn's own: the date header is refreshed every 10 ticks


class Server(uvicorn.Server):
    """`uvicorn.Server` with `stop()`."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.drain = True

    def stop(self, drain: bool = True) -> None:
        """End the serving now (`drain`: let open requests finish, as on SIGTERM)."""
        self.drain = self.drain and drain
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await self.lifespan.shutdown()  # the application's own clean-up (its engine client, image processes)
