"""Build densedev's Cython core; ``DENSEDEV_NO_EXTENSIONS=1`` builds a pure-Python package."""

import os

from setuptools import Extension, setup

NO_EXTENSIONS = os.environ.get("DENSEDEV_NO_EXTENSIONS", "") not in ("", "0")
# DENSEDEV_CYTHON_TRACE=1 builds with line tracing for coverage and profilers (slower).
TRACE = os.environ.get("DENSEDEV_CYTHON_TRACE", "") not in ("", "0")

ext_modules = []
if not NO_EXTENSIONS:
    from Cython.Build import cythonize

    macros = [("CYTHON_TRACE_NOGIL", "1")] if TRACE else []
    ext_modules = cythonize(
        [
            Extension(
                "densedev._fast",
                ["src/densedev/_fast.pyx"],
                define_macros=macros,
                extra_compile_args=["-O2"],
            )
        ],
        # binding + embedsignature: the functions carry their signatures, so inspect.signature can hold
        # them to the twin's (tests/test_accel_fallback.py).
        compiler_directives={
            "language_level": "3",
            "linetrace": TRACE,
            "binding": True,
            "embedsignature": True,
        },
    )

setup(ext_modules=ext_modules)
