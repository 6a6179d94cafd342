"""cffi (API mode) build of ``cpud.native._cpud_native``.

Run by the package install through ``setup.py`` (``cffi_modules``); for a
quick in-place build while developing: ``python native/build_native.py``.

All sources compile with baseline x86-64 flags; the SIMD tiers carry per
function ``target`` attributes and are chosen at run time (dispatch.c).

OpenMP: the module must share torch's libgomp.  A torch wheel ships
``torch/lib/libgomp.so.1`` (soname ``libgomp.so.1``), which is what ``-fopenmp``
links against by name, so once torch is imported the dynamic loader resolves
our reference to torch's copy.  Wheels that ship a renamed copy (auditwheel
style ``libgomp-<hash>.so.1``) would give a second runtime; when such a torch
is visible at build time we link against that file explicitly, with an rpath.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# c_api/: the C API cffi exposes (cpud_native.h) and its entry points; drivers/: the generic
# kernels, decoder and MoE drivers and shared headers; isa/: one file per ISA tier (kernels
# compiled with that tier's target attributes, micro-kernels, SIMD wrappers).
FOLDERS = ("c_api", "drivers", "isa")
HEADER = "c_api/cpud_native.h"
SOURCES = [
    "c_api/api.c",
    "c_api/quant_api.c",
    "c_api/quant_pack.c",
    "c_api/dequant_rows.c",
    "c_api/dispatch.c",
    "c_api/pin.c",
    "c_api/shm_allreduce.c",
    "drivers/decoder.c",
    "drivers/moe.c",
    "isa/tier_scalar.c",
    "isa/tier_avx2.c",
    "isa/tier_avx512.c",
    "isa/tier_avx512bf16.c",
    "isa/tier_amx.c",
    "isa/shm_tier_scalar.c",
    "isa/shm_tier_avx2.c",
    "isa/shm_tier_avx512.c",
    "isa/quant_scalar.c",
    "isa/quant_avx2.c",
    "isa/quant_avx2vnni.c",
    "isa/quant_avx512.c",
    "isa/quant_avx512vnni.c",
    "isa/quant_amx.c",
    "isa/quant_amx_bf16.c",
]
CFLAGS = ["-std=c11", "-O3", "-fopenmp", "-fno-math-errno", "-Wall", "-Wextra"]


def _cdef_text() -> str:
    """The public header without preprocessor lines other than integer #defines."""
    with open(os.path.join(HERE, HEADER)) as f:
        lines = f.read().splitlines()
    keep = [ln for ln in lines if not ln.startswith("#") or re.match(r"#define \w+ \d+$", ln)]
    return "\n".join(keep)


def _src_path(name: str) -> str:
    """Source path; relative to the project root under setuptools (which runs from there and
    names object files after it), absolute for a direct run (cffi compiles in a temp dir)."""
    path = os.path.join(HERE, name)
    rel = os.path.relpath(path)
    return path if __name__ == "__main__" or rel.startswith("..") else rel


def _renamed_torch_libgomp() -> str | None:
    """Path of torch's bundled libgomp when its name is not the plain soname, else None."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    libs = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "lib", "libgomp*.so*")))
    if not libs or os.path.basename(libs[0]) == "libgomp.so.1":
        return None
    return libs[0]


def _link_args() -> list[str]:
    gomp = _renamed_torch_libgomp()
    if gomp is None:
        return ["-fopenmp"]
    return [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "cpud.native._cpud_native",
    f'#include "{os.path.basename(HEADER)}"',
    sources=[_src_path(s) for s in SOURCES],
    include_dirs=[os.path.join(HERE, folder) for folder in FOLDERS],
    depends=[
        _src_path(os.path.join(folder, n))
        for folder in FOLDERS
        for n in sorted(os.listdir(os.path.join(HERE, folder)))
        if n.endswith((".h", ".c"))
    ],
    extra_compile_args=CFLAGS,
    extra_link_args=_link_args(),
)


if __name__ == "__main__":
    import shutil
    import tempfile

    # Same file name as a setuptools build (cffi modules use the limited API),
    # so an editable install and this quick build never leave two copies.
    dest = os.path.join(HERE, "_cpud_native.abi3.so")
    with tempfile.TemporaryDirectory() as tmp:
        built = ffibuilder.compile(tmpdir=tmp, verbose=False)
        # Processes that have the old module loaded keep their mapping: copy next to it, then
        # rename over it atomically (never write the loaded file in place).
        staged = os.path.join(HERE, f".{os.path.basename(dest)}.{os.getpid()}.tmp")
        shutil.copy(built, staged)
        os.replace(staged, dest)
        for old in glob.glob(os.path.join(HERE, "_cpud_native*.so")):
            if old != dest:
                os.remove(old)
    print(dest)
