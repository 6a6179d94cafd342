"""Build hook for the native kernels; all package metadata lives in pyproject.toml.

The cffi extension ``cpud.native._cpud_native`` is optional: without a working
C compiler the install still succeeds (with a warning) and cpud runs its torch
path.  Set ``CPUD_REQUIRE_NATIVE=1`` to make a failed native build an error.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext whose extensions are optional unless CPUD_REQUIRE_NATIVE=1."""

    def finalize_options(self) -> None:
        super().finalize_options()
        required = os.environ.get("CPUD_REQUIRE_NATIVE", "") not in ("", "0")
        for ext in self.extensions:
            ext.optional = not required

    def run(self) -> None:
        super().run()
        for ext in self.extensions:
            if not os.path.exists(self.get_ext_fullpath(ext.name)):
                print(
                    f"WARNING: {ext.name} was not built; cpud will use its torch path "
                    "(set CPUD_REQUIRE_NATIVE=1 to make this an error)",
                    file=sys.stderr,
                )


setup(
    cmdclass={"build_ext": OptionalBuildExt},
    cffi_modules=["native/build_native.py:ffibuilder"],
)
