"""Optional accelerators: the same emulated GPU time and memory, less of the emulator's own host time.

Everything here can be switched off (``config.replay=False`` / ``gpemu run`` with
``GPEMU_REPLAY=0``) and the run is charged the same: these modules only make the emulator's host
work per training step smaller, so that it hides behind emulated GPU time as a real program's
host work hides behind a real GPU.

* :mod:`.replay` — an outermost module's recorded forward/backward replayed as one autograd node;
* :mod:`.backward` — engine-free ``loss.backward()`` for an ordinary training step's graph, and
  targeted gradients through a replay whose parameters are not autograd inputs;
* :mod:`.gradients` — a replayed module's parameter gradients kept as one set between steps;
* :mod:`.loss` — ``F.cross_entropy`` replayed as one op after a recorded op-by-op call;
* :mod:`.optimizer` — ``step()`` of SGD/Adam/AdamW skipped once its state exists (no arithmetic to
  do), fast ``zero_grad``.
* :mod:`.value_entries` — with real values (when the others step aside), what they would run as
  the emulator's own work is an emulator entry, so its host time is forgiven as theirs is.

They reach the emulated tensor type through its public fields (``emu_device``, ``emu_block``,
``emu_shadow``, ``emu_key``: read only) and :class:`gpemu.device.TensorState`'s methods (``wrap``,
``build``, ``signature``, ``charge``, ``cost_tap``, ``forget_value``, ``set_block``,
``release``) and its ``memory``/``engine``; ``tests/test_layers.py`` checks both. Each keeps its
per-run state on the runtime (``rt.replay``, ``rt.gradients``, ``rt.loss``,
``rt.optimizer_fastpath``).
"""
