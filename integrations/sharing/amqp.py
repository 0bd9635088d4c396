"""pika connections that write each AMQP message with one system call.

pika hands a message's method, header and body frames to its transport one by one, and the
transport sends every piece with its own ``send()``: three system calls (and three wake-ups of
the broker on loopback) per message. On a busy machine each costs around 0.1 ms, the largest
part of the CPU a request costs. Joining a message's frames before they reach the transport
keeps the bytes and their order exactly the same.

Also: :func:`request_channel`, the channel jobs and ``share-status`` publish requests on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pika

__all__ = ["SelectConnection", "blocking_connection", "request_channel", "TopologyMissing"]


class SelectConnection(pika.SelectConnection):
    def _output_marshaled_frames(self, marshaled_frames: Sequence[bytes]) -> None:
        if len(marshaled_frames) > 1:
            self.frames_sent += len(marshaled_frames) - 1  # keep pika's frame count right
            marshaled_frames = [b"".join(marshaled_frames)]
        super()._output_marshaled_frames(marshaled_frames)


def blocking_connection(params: Any) -> pika.BlockingConnection:
    """A ``BlockingConnection`` over :class:`SelectConnection` (pika's own hook for the impl)."""
    try:
        return pika.BlockingConnection(params, _impl_class=SelectConnection)
    except TypeError:  # a pika without the hook: the plain connection works the same, slower
        return pika.BlockingConnection(params)


class TopologyMissing(RuntimeError):
    """The request exchange does not exist and this broker user may not declare it."""


def request_channel(conn: Any) -> Any:
    """A channel of ``conn`` (blocking) on which the request exchange is known to exist.

    The manager declares the topology; a job may start first. A user allowed to declare it
    (one broker user for everything, as on a laptop) does so, so its requests wait in the
    queue for the manager; a restricted job user raises :class:`TopologyMissing` instead.
    """
    import pika.exceptions as pex

    from . import protocol as P

    ch = conn.channel()
    try:
        ch.exchange_declare(P.REQUEST_EXCHANGE, passive=True)
        return ch
    except pex.ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
    ch = conn.channel()
    try:
        P.declare_topology(ch)
    except pex.ChannelClosedByBroker as exc:
        if exc.reply_code == 403:
            raise TopologyMissing(
                f"the exchange {P.REQUEST_EXCHANGE} does not exist yet and this broker user may "
                "not declare it (no sharing manager has connected)"
            ) from None
        raise
    return ch
