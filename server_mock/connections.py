"""What one HTTP connection may hold: a deadline for sending a whole request, and a share of the open connections.

uvicorn's h11 protocol times out only idle keep-alive connections: a client that sends half a request line, or
headers without the body they announce, or nothing at all, holds its connection (a file descriptor) for ever,
and a thousand such clients stop the worker from answering anyone. ``guarded_protocol`` subclasses that protocol
(uvicorn has no setting for either, so this is ours):

- **Deadline.** From connecting, or from the first byte of each request on a kept-alive connection, the client
  has ``--request-timeout`` seconds to send the whole request (headers and body). Past it the connection is
  answered 408 and closed. Once a request is complete the deadline stops: a long poll may wait as long as it
  likes.
- **Caps.** At most ``--max-connections`` open connections, and ``--max-connections-per-peer`` from one IP
  address. A connection over a cap first makes room by closing the longest-open connection that has no complete
  request in it (idle, or still sending), taken from its own peer (per-peer cap) or from the peer holding the
  most connections (total cap). If there is none, a held long poll is ended early (``relieve``, from
  api/long_polls.py: it is answered "not ready yet, poll again", and its connection turns idle) and the new
  connection admitted; only if every connection is busy with other work is the new one answered 503 and closed.
  So neither connections that never finish their request nor complete long polls can keep out one that does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server_mock.config import Connections

logger = logging.getLogger("server_mock")

_RECEIVING = (h11.IDLE, h11.SEND_BODY)  # the client has not finished sending its request


def _plain(status: int, reason: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class ConnectionGuard:
    """The open connections of one server, by peer, and the settings every connection follows."""

    def __init__(self, options: Connections, max_open: int | None = None) -> None:
        self.options = options
        self.max_open = max_open or options.max_connections
        # ends one held long poll (of this peer, or any), making its connection idle; set by the app's owner
        self.relieve: Callable[[str | None], bool] | None = None
        self.relieved = 0  # connections admitted by ending a held long poll
        self.by_peer: dict[str, OrderedDict[GuardedConnection, None]] = {}
        self.open = 0
        self.refused = 0  # connections answered 503
        self.evicted = 0  # connections closed to make room
        self.timed_out = 0  # requests answered 408

    def admit(self, conn: GuardedConnection) -> bool:
        """Count a new connection, making room if a cap is reached; False if there is none to make."""
        mine = self.by_peer.setdefault(conn.peer, OrderedDict())
        if len(mine) >= self.options.max_connections_per_peer and not self._evict_from(mine) \
                and not self._relieve(conn.peer):
            return self._refuse(conn, f"this address has {len(mine)} open connections (limit "
                                      f"max_connections_per_peer={self.options.max_connections_per_peer})")
        if self.open >= self.max_open:
            peers = sorted(self.by_peer.values(), key=len, reverse=True)
            if not any(self._evict_from(peer) for peer in peers) and not self._relieve(None):
                return self._refuse(conn, f"the worker has {self.open} open connections (limit max_connections="
                                          f"{self.max_open})")
        mine[conn] = None
        self.open += 1
        return True

    def forget(self, conn: GuardedConnection) -> None:
        mine = self.by_peer.get(conn.peer)
        if mine is not None and conn in mine:
            del mine[conn]
            self.open -= 1
            if not mine:
                del self.by_peer[conn.peer]

    def _evict_from(self, peer: OrderedDict[GuardedConnection, None]) -> bool:
        for conn in peer:  # oldest first
            if conn.receiving():
                self.evicted += 1
                conn.close_incomplete("the worker needed room for another connection")
                return True
        return False

    def _relieve(self, peer: str | None) -> bool:
        """End a held long poll (``api/long_polls.py``) so that its connection, idle once answered, can be closed
        by the next admission; the new connection is admitted meanwhile."""
        if self.relieve is not None and self.relieve(peer):
            self.relieved += 1
            return True
        return False

    def _refuse(self, conn: GuardedConnection, why: str) -> bool:
        self.refused += 1
        conn.transport.write(_plain(503, "Service Unavailable", f"too many connections: {why}; retry shortly"))
        conn.transport.close()
        return False


class GuardedConnection(H11Protocol):
    """uvicorn's h11 protocol with the deadline and caps of a ``ConnectionGuard`` (bound by ``guarded_protocol``)."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
        self._deadline: asyncio.TimerHandle | None = None
        self._sent_bytes = False  # of the request now being received
        self._admitted = self.guard.admit(self)
        if self._admitted:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_admitted", False):
            self.guard.forget(self)
            self._admitted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return  # refused: closing
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        self._sent_bytes = True
        super().data_received(data)
        if self.conn.their_state not in _RECEIVING:
            self._disarm()  # the request is complete: what the app does with it takes as long as it takes

    def on_response_complete(self) -> None:
        self._disarm()
        self._sent_bytes = False
        super().on_response_complete()

    def receiving(self) -> bool:
        """Whether this connection holds no complete request: idle between requests, or still sending one."""
        return not self.transport.is_closing() and self.conn.their_state in _RECEIVING

    def close_incomplete(self, why: str) -> None:
        """Close the connection: 408 if the client had begun a request no answer was started for."""
        self._disarm()
        if self.transport.is_closing():
            return
        started = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if self._sent_bytes and not started:
            if self.cycle is not None:
                self.cycle.disconnected = True  # the app's answer, if any comes, is not written
            self.transport.write(_plain(408, "Request Timeout", f"request not received in time: {why}"))
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.guard.options.request_timeout, self._timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.conn.their_state in _RECEIVING:
            self.guard.timed_out += 1
            self.close_incomplete(f"a whole request must arrive within request_timeout="
                                  f"{self.guard.options.request_timeout:g} s")


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedConnection]:
    """The protocol class to give ``uvicorn.Config(http=...)``: every connection it makes follows ``guard``."""
    return type("GuardedH11Protocol", (GuardedConnection,), {"guard": guard})
