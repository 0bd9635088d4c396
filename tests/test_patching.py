"""Patcher: every replacement is recorded and restored, including absent originals."""

import types

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
    p.replace(mod, "new_attr", 42)                  # did not exist before
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
