"""pika connections that write each AMQP message with one system call.

pika hands a message's method, header and body frames to its transport one by one, and the
transport sends every piece with its own ``send()``: three system calls (and three wake-ups of
the broker on loopback) per message. On a busy machine each costs around 0.1 ms, the largest
part of the CPU a request costs. Joining a message's frames before they reach the transport
keeps the bytes and their order exactly the same.
"""

from __future__ import annotations

from typing import Any, Sequence

import pika

__all__ = ["SelectConnection", "blocking_connection"]


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
