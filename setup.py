"""Build of the optional C accelerator (Note [C accelerator] in adaptive_eager/_hot.c).

Everything else is declared in pyproject.toml. The extension uses the CPython API only (no torch
headers); ``optional=True``: where it cannot be built (no compiler) the package still installs and
the engine records ops in pure Python (``ADAPTIVE_EAGER_ACCEL`` then has nothing to switch on).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("adaptive_eager._hot", ["adaptive_eager/_hot.c"], optional=True,
                             extra_compile_args=["-O2"])])
