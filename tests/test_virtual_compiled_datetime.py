"""Virtual time and compiled extension modules built on ``datetime.datetime`` (pandas' Cython
NaT and Timestamp): they bind the class the ``datetime`` module holds while they initialise, which
must be the C type they were compiled against, not virtual time's stand-in."""

from __future__ import annotations

import datetime
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import gpemu

# A module that does what Cython's ``cimport datetime`` does at import: read ``datetime.datetime``
# from the module and lay a static subclass out on it (here: report whether that class is the real
# C type, and make a subclass instance through its base's constructor).
_SOURCE = r"""
#include <Python.h>
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "boundto", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_boundto(void) {
    PyObject *m = PyModule_Create(&def), *mod = PyImport_ImportModule("datetime");
    if (!m || !mod) return NULL;
    PyObject *cls = PyObject_GetAttrString(mod, "datetime");
    if (!cls) return NULL;
    PyModule_AddObject(m, "heap_type", PyBool_FromLong(PyType_HasFeature((PyTypeObject *)cls, Py_TPFLAGS_HEAPTYPE)));
    PyModule_AddObject(m, "bound", cls);
    return m;
}
"""


@pytest.mark.subprocess  # (a C compiler)
def test_an_extension_imported_on_virtual_time_binds_the_real_datetime_and_programs_read_virtual_now(tmp_path: Path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the extension module")
    library = tmp_path / f"boundto{sysconfig.get_config_var('EXT_SUFFIX')}"
    (tmp_path / "boundto.c").write_text(_SOURCE)
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [compiler, "-shared", "-fPIC", f"-I{include}", str(tmp_path / "boundto.c"), "-o", str(library)], check=True
    )

    real = datetime.datetime
    gpemu.patch(gpu="H100", summary=False, clock="virtual")
    try:
        spec = importlib.util.spec_from_file_location("boundto", library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.heap_type is False and module.bound is real  # the C type, not the stand-in
        assert datetime.datetime is not real  # Python code still reads virtual time's class
    finally:
        gpemu.unpatch()
        sys.modules.pop("boundto", None)
    assert datetime.datetime is real
