"""gpemu's bootstrap: ``gpemu run`` puts this directory first on PYTHONPATH.

Python imports ``sitecustomize`` at every interpreter start, so every Python process of an
emulated run (the script, spawned DataLoader workers, torchrun and mp.spawn children) patches
itself from the GPEMU_* environment before user code runs. Any sitecustomize this one shadows
(a virtualenv's, a distribution's) still runs first.
"""


def _chain_to_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["_gpemu_shadowed_sitecustomize"] = module


def _emulate() -> None:
    import os
    import sys

    try:
        from gpemu.launcher import bootstrap
    except ImportError:
        return  # another interpreter without gpemu installed: leave it alone
    try:
        bootstrap()
    except Exception as exc:  # one clear line, not a half-emulated run that silently uses the CPU
        print(f"[gpemu] error: could not emulate GPUs in this process: {exc}", file=sys.stderr, flush=True)
        # SystemExit inside site's import is reported as a fatal interpreter error; nothing has
        # run yet, so ending here with gpemu's status for bad settings loses nothing.
        os._exit(2)


_chain_to_shadowed_sitecustomize()
_emulate()
