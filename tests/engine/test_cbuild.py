"""The C kernels' builder (cbuild.py): built for the instruction set torch runs, cached apart."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
from pathlib import Path

import pytest

from trine.engine.model.kernels import cbuild

SOURCE = """
float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels only")
def test_each_kernel_path_builds_its_own_library(tmp_path, monkeypatch):
    """The second kernel path (`make test-portable`) holds torch to a lower instruction set; the C
    kernels follow it, and the two builds never share a cached library."""
    monkeypatch.setenv("TRINE_KERNEL_DIR", str(tmp_path / "kernels"))
    src = tmp_path / "dot.c"
    src.write_text(SOURCE)
    paths = {}
    for capability, level in (("", "native"), ("avx2", "x86-64-v3"), ("default", "x86-64-v2")):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        assert cbuild.march_flag() == f"-march={level}"
        lib = cbuild.build(src)
        lib.dot.restype = ctypes.c_float
        lib.dot.argtypes = [ctypes.POINTER(ctypes.c_float)] * 2 + [ctypes.c_int]
        a = (ctypes.c_float * 3)(1.0, 2.0, 3.0)
        assert lib.dot(a, a, 3) == 14.0  # exact: small integers
        paths[level] = lib._name
    assert len(set(paths.values())) == 3
    assert {Path(p).parent for p in paths.values()} == {tmp_path / "kernels"}


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler here")
def test_every_kernel_builds_where_a_compiler_is(tmp_path, monkeypatch):
    """The kernels' own tests skip where a kernel is not built (no compiler): a source that does
    not compile must fail here instead of skipping them."""
    monkeypatch.setenv("TRINE_KERNEL_DIR", str(tmp_path / "kernels"))
    for source in sorted(Path(cbuild.__file__).parent.glob("*.c")):
        cbuild.build(source)  # raises with the compiler's message


def test_an_edited_header_builds_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("TRINE_KERNEL_DIR", str(tmp_path / "kernels"))
    (tmp_path / "one.h").write_text("static inline int one(void) { return 1; }\n")
    src = tmp_path / "uses.c"
    src.write_text('#include "one.h"\nint f(void) { return one(); }\n')
    first = cbuild.build(src)._name
    (tmp_path / "one.h").write_text("static inline int one(void) { return 2; }\n")
    second = cbuild.build(src)
    assert second._name != first and second.f() == 2
