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
    except ImportError as exc:
        _cannot_emulate(exc)
        return
    try:
        bootstrap()
    except Exception as exc:  # one clear line, not a half-emulated run that silently uses the CPU
        print(f"[gpemu] error: could not emulate GPUs in this process: {exc}", file=sys.stderr, flush=True)
        # SystemExit inside site's import is reported as a fatal interpreter error; nothing has
        # run yet, so ending here with gpemu's status for bad settings loses nothing.
        os._exit(2)


def _cannot_emulate(exc: ImportError) -> None:
    """An interpreter without gpemu in an emulated run (a `python` on PATH that is not the one
    gpemu is installed in): it would run on the CPU as if no GPU were asked for. The command
    ``gpemu run`` started (its process id, kept by exec) stops with one line naming the Python
    to use; a deeper process (a tool some script starts) runs on, with a warning."""
    import os
    import sys

    if os.environ.get("GPEMU_ENABLE") != "1":
        return  # not an emulated run: nothing was asked of this interpreter
    what = f"this Python ({sys.executable}) cannot import gpemu ({exc})"
    if os.environ.get("GPEMU_RUN_PID") != str(os.getpid()):
        print(f"[gpemu] warning: {what}: it runs without emulated GPUs", file=sys.stderr, flush=True)
        return
    print(
        f"[gpemu] error: {what}, so it would run without emulated GPUs; run the command with the "
        f"Python gpemu is installed in ({os.environ.get('GPEMU_RUN_PYTHON', 'see `which gpemu`')}), "
        "or give the script itself (`gpemu run -- train.py`), which uses it",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)


_chain_to_shadowed_sitecustomize()
_emulate()
