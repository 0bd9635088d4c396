"""The sharing manager: time-slices each emuGPU among registered jobs, one slot at a time.

Two layers:

* :class:`SharingCore` — the scheduler. Pure state machine, no I/O, clock passed in: every
  input (a message, the passage of time, a job's connection closing) returns the replies to
  send. Unit-testable with a virtual clock.
* :class:`SharingManager` — the daemon: a pika consumer on the durable request queue that
  feeds the core, sleeps until the next absolute deadline (the earliest slot's end, lease
  expiry, status publication), publishes signed replies (acking a request after its reply, on
  the same channel), watches every job's presence queue, and reconnects when the broker goes
  away.

Reliability rules: a GPU-time request is acknowledged to the broker only after it has been
answered, so requests of a manager that dies are redelivered to the next one; request ids make
duplicate deliveries harmless (a request already queued or running is not queued again, one
already answered is answered again, never served again); a job whose broker connection closes
is dropped at once and one silent for a lease period is dropped too, and its slots, queue and
memory are freed. Every message that cannot be parsed, validated or authenticated is
acknowledged and rejected with a logged reason (the log is rate-limited), so no input can stop
the service or come back as a redelivery.

Time slices: a request longer than the quantum (``quantum_s``) is served in slices of at most
one quantum; after each slice the request goes to the back of the queue and the policy chooses
again, so no job holds the emuGPU for more than one quantum while others wait. The job sees
one answer, when its last slice is scheduled.
"""

from __future__ import annotations

from .core import SharingCore
from .daemon import ManagerConflict, SharingManager
from .state import (
    DEFAULT_BACKDATE_S,
    DEFAULT_LOOKAHEAD_S,
    DEFAULT_QUANTUM_S,
    MAX_ACTIVE_PER_JOB,
    MAX_JOBS,
    DeviceSpec,
    Outgoing,
    parse_device,
)

__all__ = [
    "SharingCore",
    "SharingManager",
    "ManagerConflict",
    "Outgoing",
    "DeviceSpec",
    "parse_device",
    "DEFAULT_LOOKAHEAD_S",
    "DEFAULT_BACKDATE_S",
    "DEFAULT_QUANTUM_S",
    "MAX_JOBS",
    "MAX_ACTIVE_PER_JOB",
]
