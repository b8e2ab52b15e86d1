"""uvicorn's h11 connection with a request read deadline: slow or silent clients cannot hold sockets.

Runs in the HTTP frontend process(es). uvicorn closes an idle keep-alive connection after
`timeout_keep_alive`, but a connection that was just opened, or one that sends a request's headers
or body a byte at a time (slowloris), is held for as long as the client likes: enough such sockets
use up the process's file descriptors. Here a request must arrive whole (headers and body) within
`--request-read-timeout` seconds of its first byte, and a new connection must start one within that
time; otherwise the connection is closed. Streaming the response is not limited by this (slow
readers have `--stream-send-timeout` and `--max-stream-buffer-tokens`).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ember.server")


def read_deadline_protocol(seconds: float) -> type[asyncio.Protocol]:
    """The h11 protocol class for uvicorn's `Config(http=...)` with a read deadline of `seconds`."""

    class DeadlineH11Protocol(H11Protocol):
        read_timeout = seconds
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a new connection must start a request in time

        def data_received(self, data: bytes) -> None:
            waiting_for_request = self._deadline is None and self.conn.their_state is h11.IDLE
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # the whole request is in (or the connection is ending)
            elif waiting_for_request:
                self._arm()  # the first bytes of a request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(self.read_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info("closing a connection that sent no whole request in %gs", self.read_timeout)
                self.transport.close()

    return DeadlineH11Protocol
