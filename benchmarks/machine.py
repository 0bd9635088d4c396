"""The machine a benchmark figure was taken on: every benchmark prints it beside its figures,
because timings from different machines differ 2-4x and must not be compared by mistake.

The CPU's marketing name is not enough: cloud VMs report "AMD EPYC" for every generation from
Zen 2 to Zen 5, and the same host-time benchmark ran 2.4-2.9x faster on one such VM than on
another. So the line also carries the CPU's family / model numbers, its clock, and the time of a
fixed reference loop of interpreter work (:func:`reference_loop_ms`): a host time divided by it
is comparable across machines, to first order.

The scripts in this folder import it through their shared helpers: ``from _common import machine``.
"""

from __future__ import annotations

import functools
import os
import platform

from gpemu.time.launch import measure_reference_loop_ms

__all__ = ["machine", "reference_loop_ms"]


@functools.cache
def reference_loop_ms() -> float:
    """The fastest of 15 timings of a fixed loop of interpreter work, in ms (measured once per
    process; the loop is gpemu's, :func:`gpemu.time.launch.measure_reference_loop_ms`)."""
    return measure_reference_loop_ms()


def _cpu() -> str:
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        return cpu
    cpu = fields.get("model name", cpu)
    ident = [
        f"family {fields['cpu family']}" if "cpu family" in fields else "",
        f"model {fields['model']}" if "model" in fields else "",
        f"{float(fields['cpu MHz']):.0f} MHz" if "cpu MHz" in fields else "",
    ]
    ident = [s for s in ident if s]
    return f"{cpu} ({', '.join(ident)})" if ident else cpu


def machine() -> str:
    """CPU (name, family/model, clock), cores, load average now and the reference loop's time, e.g.
    ``AMD EPYC (family 26, model 2, 2596 MHz), 2 cores, load 0.31 0.70 1.02, reference loop 3.10 ms``."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{_cpu()}, {os.cpu_count()} cores, load {load}, reference loop {reference_loop_ms():.2f} ms"
