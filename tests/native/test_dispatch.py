"""ISA detection, the CPUD_ISA override, the no-library fallback, one libgomp, pinning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cpud import native
from cpud.native import _loader


def run_py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def test_api_shape():
    assert native.available()
    assert native.isa() in native.ISAS
    assert native.supported_isas() == list(
        native.ISAS[: native.ISAS.index(native.detected_isa()) + 1]
    )
    assert native.supported_isas()[0] == "scalar"
    info = native.info()
    assert info["available"] and info["isa"] == native.isa() and info["error"] is None
    assert native.kernels() is native.kernels()


def test_kernels_rejects_unknown_or_unsupported_tier():
    with pytest.raises(ValueError, match="cannot run here"):
        native.Kernels("avx1024")
    assert native.Kernels("scalar").isa == "scalar"


@pytest.mark.parametrize(
    "requested, detected, tier, warns",
    [
        (None, "avx512bf16", "avx512bf16", False),
        ("avx2", "avx512bf16", "avx2", False),
        (" AVX512 ", "avx512bf16", "avx512", False),
        ("scalar", "avx2", "scalar", False),
        ("avx512bf16", "avx2", "avx2", True),  # above the CPU: fall back, warn
        ("sse9", "avx512", "avx512", True),  # unknown: fall back, warn
    ],
)
def test_resolve_isa(requested, detected, tier, warns):
    got, warning = _loader.resolve_isa(requested, detected)
    assert got == tier
    assert (warning is not None) == warns


def test_env_override_read_by_default_isa():
    # One child for every case: default_isa() caches, so clear it between values.
    r = run_py(
        """
        import os
        from cpud import native
        from cpud.native import _loader
        for value in [*native.supported_isas(), "AVX9000"]:
            os.environ["CPUD_ISA"] = value
            _loader.default_isa.cache_clear()
            print(value, native.isa(), native.Kernels().isa)
        """
    )
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    for value, isa, kern_isa in rows[:-1]:
        assert value == isa == kern_isa
    assert rows[-1][1:] == [native.detected_isa()] * 2
    assert "CPUD_ISA='AVX9000'" in r.stderr


def test_fallback_without_compiled_module():
    r = run_py(
        """
        import sys
        class Missing:  # as if the extension had not been built
            def find_spec(self, name, path=None, target=None):
                if name == "cpud.native._cpud_native":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Missing())
        from cpud import native
        assert not native.available()
        assert native.isa() == "none" and native.supported_isas() == []
        assert "_cpud_native" in native.load_error()
        assert native.info()["available"] is False
        try:
            native.Kernels()
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "refused" in r.stdout


def gomp_maps() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line.split()[-1]}


def test_one_libgomp_in_this_process():
    native.kernels().rms_norm(torch.randn(64, 1024), torch.ones(1024), 1e-6)
    torch.randn(256, 256) @ torch.randn(256, 256)
    libs = gomp_maps()
    assert len(libs) == 1, libs
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if any(name.startswith("libgomp") for name in os.listdir(torch_lib)):  # torch ships its own
        (path,) = libs
        assert os.path.realpath(os.path.dirname(path)) == os.path.realpath(torch_lib), path


@pytest.mark.parametrize("order", ["torch first", "cpud.native first"])
def test_one_libgomp_any_import_order(order):
    imports = (
        "import torch; import cpud.native"
        if order == "torch first"
        else "import cpud.native; import torch"
    )
    r = run_py(
        f"""
        {imports}
        from cpud import native
        native.kernels().silu_and_mul(torch.randn(64, 2048))
        torch.set_num_threads(2); torch.randn(512, 512) @ torch.randn(512, 512)
        libs = {{l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l}}
        print(len(libs), *sorted(libs))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "1", r.stdout


def test_pin_threads_reports_each_cpu():
    # In a child: pinning moves the calling (main) thread, which pytest keeps using.
    r = run_py(
        """
        import os, torch
        from cpud import native
        cpus = sorted(os.sched_getaffinity(0))
        torch.set_num_threads(len(cpus))
        got = native.pin_threads(cpus)
        print(got == cpus, got, cpus)
        # later regions of the same size reuse the pinned threads
        for _ in range(3):
            torch.randn(256, 256) @ torch.randn(256, 256)
        again = native.thread_cpus(len(cpus))
        print(again == cpus, again)
        print(os.sched_getaffinity(0) == {cpus[0]})
        print(native.pin_threads([100000]))  # no such cpu: reported, not raised
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("True"), r.stdout
    assert lines[1].startswith("True"), r.stdout
    assert lines[2] == "True", r.stdout
    assert lines[3] == "[-2]", r.stdout
