"""Which waiting request an emuGPU serves next: small, pluggable policy classes.

The manager keeps one policy object per emuGPU. Whenever the GPU is free and requests wait, it
calls ``pick(pending, jobs)`` and runs the chosen request; it then calls ``served(job, seconds)``.
A researcher adds a policy as a class with the same methods and runs
``gpemu share-manager --policy mypkg.mod:MyPolicy``.

    class ShortestFirst(Policy):
        name = "shortest-first"
        def pick(self, pending, jobs):
            return min(pending, key=lambda r: (r.seconds, r.seq))
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Policy", "Fifo", "RoundRobin", "Weighted", "PendingView", "JobView", "load_policy", "BUILTIN"]


@dataclass
class JobView:
    """What a policy may know about a registered job on its emuGPU."""

    job_id: str
    weight: float
    served_s: float = 0.0  # GPU seconds this job has been served
    vtime: float = 0.0  # fair-share virtual time (served_s / weight, offset at registration)


@dataclass
class PendingView:
    """A waiting request: ``seq`` is the manager's arrival order (smaller = earlier)."""

    job_id: str
    seq: int
    seconds: float


class Policy:
    """Base class. Subclasses override :meth:`pick`; the hooks below are optional."""

    name = "policy"

    def pick(self, pending: Sequence[PendingView], jobs: Mapping[str, JobView]) -> PendingView:
        raise NotImplementedError

    def registered(self, job: JobView, jobs: Mapping[str, JobView]) -> None:
        """A job joined this emuGPU (``jobs`` includes it)."""

    def served(self, job: JobView, seconds: float) -> None:
        """``job`` was just served ``seconds`` of GPU time."""


class Fifo(Policy):
    """First come, first served (GPEmu's behaviour): requests run in arrival order."""

    name = "fifo"

    def pick(self, pending: Sequence[PendingView], jobs: Mapping[str, JobView]) -> PendingView:
        return min(pending, key=lambda r: r.seq)


class Weighted(Policy):
    """Weighted fair share: each job gets GPU time in proportion to its weight (priority).

    Serves the waiting job with the least virtual time (served GPU seconds / weight), like
    CFS or stride scheduling. A job that joins starts at the smallest virtual time of the jobs
    already there, so it gets its share from now on instead of catching up on the past.
    """

    name = "weighted"

    def _weight(self, job: JobView) -> float:
        return job.weight

    def pick(self, pending: Sequence[PendingView], jobs: Mapping[str, JobView]) -> PendingView:
        return min(pending, key=lambda r: (jobs[r.job_id].vtime, r.seq))

    def registered(self, job: JobView, jobs: Mapping[str, JobView]) -> None:
        others = [j.vtime for j in jobs.values() if j.job_id != job.job_id]
        job.vtime = min(others) if others else 0.0

    def served(self, job: JobView, seconds: float) -> None:
        job.vtime += seconds / self._weight(job)


class RoundRobin(Weighted):
    """Round-robin fair share between jobs: equal GPU time for every job, whatever its weight.

    With equal request lengths this is a strict rotation; with unequal ones, the job that has
    received the least GPU time goes next (deficit round-robin), so shares are equal in time.
    """

    name = "round-robin"

    def _weight(self, job: JobView) -> float:
        return 1.0


BUILTIN: dict[str, type[Policy]] = {"fifo": Fifo, "round-robin": RoundRobin, "weighted": Weighted}


def load_policy(spec: str) -> type[Policy]:
    """A built-in name (fifo, round-robin, weighted) or ``package.module:ClassName``."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"unknown policy {spec!r}; valid: {', '.join(BUILTIN)}, or package.module:ClassName")
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"cannot load policy {spec!r}: {exc}; give package.module:ClassName of an importable class"
        ) from None
    if not isinstance(cls, type) or not callable(getattr(cls, "pick", None)):
        raise ValueError(
            f"policy {spec!r} must be a class with a pick(pending, jobs) method "
            f"(subclass gpemu.integrations.sharing.policies.Policy)"
        )
    return cls
