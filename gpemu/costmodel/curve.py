"""The functional form of ops' times: an efficiency curve per kernel, a host cost per op, and the
queue that overlaps the two.

One kernel doing ``work`` (FLOPs for compute classes, bytes for memory-bound classes) on a GPU
whose relevant peak is ``peak`` (FLOP/s or bytes/s) and that has ``sms`` SMs::

    x    = work / sms                          # work per SM: how well the op can fill the GPU
    eff  = e / (1 + k0 * z + (x0 / x) ** p)    # achieved fraction of peak; saturates at e / (1 + k0 z)
    g    = work / (peak * eff)                 # the kernel's time on the GPU

and the host spends ``h`` seconds issuing it (PyTorch's dispatch, autograd, the launch call).
A sequence of ops runs as a queue: op i starts on the GPU when the host has issued it and the
previous op has finished, so a forward or backward pass takes::

    finish_i = max(H_i, finish_(i-1)) + g_i ,  H_i = h_1 + ... + h_i
    T        = finish_n = G_n + max_k (H_k - G_(k-1)),  G_k = g_1 + ... + g_k

Why this form:

* ``eff`` is a saturating curve: small kernels cannot fill the GPU (too few blocks, partial
  waves), large ones reach a plateau ``e``. ``e`` may exceed 1 for convolutions: cuDNN's
  Winograd and FFT algorithms do fewer multiplies than the direct convolution the FLOP count
  describes (V100 reaches ~1.5x its FP32 peak on VGG's 3x3 layers). ``p`` is kept in [0.3, 1]:
  with ``p = 1`` a tiny kernel costs a constant, never more.
* ``work / sms`` rather than ``work`` puts GPUs of different sizes on one axis, so a curve
  calibrated on one GPU can be used, with another GPU's peaks and SM count, for a GPU of the same
  or a neighbouring generation.
* ``z``, the op's shape, one parameter ``k0`` per curve:
  for GEMMs and convolutions ``z = 1 / K``, K (C_in/groups x kernel elements of a convolution,
  in-features of a GEMM) the depth of the implicit GEMM's reduction: a shallow one (the 3-channel
  first layer, K = 27; grouped convolutions with 4-8 channels per group) cannot keep the math
  units fed however large the op is — ``k0`` is the depth at which half the rate is lost.
  For depthwise convolutions and pooling, priced by bytes, ``z`` is their arithmetic intensity
  (FLOPs per byte): a 5x5 depthwise kernel or a stride-1 3x3 pooling window does several times
  the arithmetic per byte of a 3x3 / 2x2 one, so ``bytes x (1 + k0 z)`` is a bandwidth term plus
  an arithmetic term — a smooth roofline.
  The shape term slows the work, not the filling: ``g = work / (peak e) x (1 + k0 z) + the fill
  time``. A shallow kernel streams its work slower, but a tiny one still costs about its fill
  time. (As a product of the two, fitted on ImageNet's K = 27 first layers, a 1-channel MNIST
  layer's backward (K = 9, 0.04 GFLOP) priced at 6 ms on an A100.)
* The queue, not a sum: the host runs ahead of the GPU, so at large batch sizes the host's time
  hides behind long kernels, at small ones the GPU waits for the host, and in between a long
  kernel lets the host bank time for the short ones after it. Adding ``h`` to every op, or
  taking ``max(h, g)`` per op, over-estimates that middle range (batch 16-48 for light models)
  by 10-40%.

:func:`kernel_seconds` is the scalar form the emulator calls per op; :func:`queue_seconds`
overlaps a sequence; the ``*_arrays`` forms are for the fit, with derivatives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Curve", "kernel_seconds", "queue_seconds", "kernel_arrays", "queue_arrays"]


@dataclass(frozen=True)
class Curve:
    """Parameters of one op kind's curve: plateau ``e``, half-way point ``x0`` (work per SM, in
    the work's unit), shape ``p``, shape-term constant ``k0`` (see the module docstring; 0 where
    unused), host time per op ``h`` (seconds), and the peak ``path`` it was calibrated against
    (``"tensor"``, ``"simt"`` or ``"memory"``)."""

    e: float
    x0: float
    p: float
    h: float
    k0: float = 0.0
    path: str = "simt"

    def efficiency(self, x: float, z: float = 0.0) -> float:
        """Achieved fraction of peak at ``x`` work per SM and shape ``z`` (0: no shape term)."""
        if x <= 0:
            return 0.0
        return self.e / (1.0 + self.k0 * z + (self.x0 / x) ** self.p)


def kernel_seconds(work: float, peak: float, sms: int, c: Curve, z: float = 0.0) -> float:
    """GPU time of one kernel (scalar; plain floats so a per-op call costs about a microsecond)."""
    if work <= 0:
        return 0.0
    return work / (peak * c.e) * (1.0 + c.k0 * z + (c.x0 * sms / work) ** c.p)


def queue_seconds(pairs: Iterable[tuple[float, float]]) -> float:
    """Time of a sequence of (host seconds, GPU seconds) ops issued one after another."""
    host = finish = 0.0
    for h, g in pairs:
        host += h
        finish = max(host, finish) + g
    return finish


def kernel_arrays(
    work: np.ndarray,
    peak: np.ndarray,
    sms: float,
    le: np.ndarray,
    lx0: np.ndarray,
    p: np.ndarray,
    lk0: np.ndarray,
    z: np.ndarray,
    grads: bool = True,
):
    """Vectorised :func:`kernel_seconds` with parameters in fitting form (logs of e, x0, k0;
    ``z`` the shape term, 0 where unused). Returns g and, if ``grads``, dg/d(log e),
    dg/d(log x0), dg/dp, dg/d(log k0)."""
    logx = np.log(np.maximum(work, 1e-30) / sms)
    kf = np.exp(lk0) * z  # k0 z
    a = work / (peak * np.exp(le))
    u = np.exp(np.clip(p * (lx0 - logx), -700, 700))
    live = work > 0
    g = np.where(live, a * (1.0 + kf + u), 0.0)
    if not grads:
        return (g,)
    d_le = -g
    d_lx0 = np.where(live, a * u * p, 0.0)
    d_p = np.where(live, a * u * (lx0 - logx), 0.0)
    d_lk0 = np.where(live, a * kf, 0.0)
    return g, d_le, d_lx0, d_p, d_lk0


def queue_arrays(h: np.ndarray, g: np.ndarray, seg_start: np.ndarray, seg_id: np.ndarray, grads: bool = True):
    """:func:`queue_seconds` of many sequences at once.

    Ops are laid out sequence after sequence; ``seg_start`` holds each sequence's first index,
    ``seg_id`` each op's sequence. Returns per-sequence times and, if ``grads``, per-op masks
    dT/dh (1 up to the sequence's critical op) and dT/dg (1 from the critical op on): the
    critical op k* maximises H_k - G_(k-1).
    """
    ch, cg = np.cumsum(h), np.cumsum(g)
    base_h = np.concatenate([[0.0], ch])[seg_start][seg_id]
    base_g = np.concatenate([[0.0], cg])[seg_start][seg_id]
    hk = ch - base_h  # H_k within the sequence
    gprev = cg - base_g - g  # G_(k-1) within the sequence
    d = hk - gprev
    dmax = np.maximum.reduceat(d, seg_start)
    gsum = np.add.reduceat(g, seg_start)
    t = gsum + dmax
    if not grads:
        return (t,)
    pos = np.arange(len(h))
    hit = np.flatnonzero(d >= dmax[seg_id])
    first = np.full(len(seg_start), len(h))
    np.minimum.at(first, seg_id[hit], pos[hit])  # first critical op of each sequence
    k_star = first[seg_id]
    return t, (pos <= k_star).astype(np.float64), (pos >= k_star).astype(np.float64)
