"""Patcher: every replacement is recorded and restored, including absent originals."""

import types

import pytest

from gpemu.patching import Patcher


def test_restores_module_attributes_class_attributes_and_absent_ones():
    mod = types.ModuleType("fake")
    mod.f = lambda: "original"

    class Base:
        def method(self):
            return "base"

    class Child(Base):
        pass

    p = Patcher()
    p.replace(mod, "f", lambda: "patched")
    p.replace(mod, "new_attr", 42)  # did not exist before
    p.replace(Child, "method", lambda self: "patched")  # inherited, not in Child.__dict__
    assert mod.f() == "patched" and mod.new_attr == 42 and Child().method() == "patched"
    p.restore_all()
    assert mod.f() == "original"
    assert not hasattr(mod, "new_attr")
    assert "method" not in Child.__dict__ and Child().method() == "base"
    assert not p.active


def test_replace_everywhere_catches_copies_imported_by_name():
    def original():
        return 1

    a, b = types.ModuleType("pkg"), types.ModuleType("pkg.sub")
    a.f = original
    b.copy_of_f = original  # as in `from pkg import f as copy_of_f`
    p = Patcher()
    assert p.replace_everywhere(original, lambda: 2, modules=[a, b]) == 2
    assert a.f() == 2 and b.copy_of_f() == 2
    p.restore_all()
    assert a.f is original and b.copy_of_f is original


def test_undo_callbacks_run_newest_first():
    order = []
    p = Patcher()
    p.on_restore(lambda: order.append(1))
    p.on_restore(lambda: order.append(2))
    p.restore_all()
    assert order == [2, 1]


def test_patching_again_with_other_settings_names_them():
    import pytest

    import gpemu
    from gpemu.clock import VirtualClock

    rt = gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
    assert gpemu.patch(gpu="V100", summary=False) is rt  # the same settings: the same run
    with pytest.raises(RuntimeError, match=r"gpu='A100' asked, 'V100' in use.*unpatch\(\) first"):
        gpemu.patch(gpu="A100", summary=False)
    gpemu.unpatch()


@pytest.mark.subprocess
def test_a_script_patching_itself_under_gpemu_run_keeps_the_command_lines_run(tmp_path, capsys):
    """`gpemu run --gpu V100 -- python script.py` where the script calls gpemu.patch(...) itself
    (as examples/gpu_preprocessing.py does): the script runs on the command line's run."""
    import os
    import subprocess
    import sys

    script = tmp_path / "own_patch.py"
    script.write_text(
        "import gpemu, torch\n"
        "rt = gpemu.patch(gpu='V100', summary=False, num_gpus=2)\n"
        "print('gpus', torch.cuda.device_count(), rt.config.summary)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPEMU_")}
    env["GPEMU_DATA_DIR"] = os.environ["GPEMU_DATA_DIR"]
    proc = subprocess.run(
        [sys.executable, "-m", "gpemu.cli", "run", "--gpu", "V100", "--no-summary", "--", sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpus 1 False" in proc.stdout  # the command line's single GPU
    assert "the run keeps the command line's settings (num_gpus=2 asked, 1 in use)" in proc.stderr


def test_after_import_patches_a_module_when_the_program_imports_it(tmp_path, monkeypatch):
    """A module not imported yet: the callback runs right after the program's import executes it
    (the module keeps its own loader); restore_all undoes the patch and removes the hook, so a
    later import is left alone."""
    import sys

    (tmp_path / "gpemu_late_module.py").write_text("VALUE = 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    p = Patcher()

    def patch_it(module: types.ModuleType) -> None:
        seen.append(module.VALUE)  # executed before the callback
        p.replace(module, "VALUE", "patched")

    hooks_before = list(sys.meta_path)
    try:
        p.after_import("gpemu_late_module", patch_it)
        assert seen == []  # nothing imported it yet
        import gpemu_late_module

        assert seen == ["original"] and gpemu_late_module.VALUE == "patched"
        assert type(gpemu_late_module.__loader__).__name__ == "SourceFileLoader"
        p.restore_all()
        assert gpemu_late_module.VALUE == "original" and sys.meta_path == hooks_before
        del sys.modules["gpemu_late_module"]
        import gpemu_late_module  # noqa: F811  (imported again, after the restore)

        assert seen == ["original"] and gpemu_late_module.VALUE == "original"
    finally:
        sys.modules.pop("gpemu_late_module", None)
        p.restore_all()


def test_after_import_of_an_imported_module_runs_at_once():
    seen = []
    p = Patcher()
    p.after_import("json", lambda module: seen.append(module.__name__))
    assert seen == ["json"] and not p.active  # no hook left to remove
