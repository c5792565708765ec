"""__version__: the CMake project's VERSION (CMakeLists.txt is the one source of truth).

An installed package carries kvcc/_version.py, written by the build from CMakeLists.txt; a
checkout used through PYTHONPATH reads the repository's CMakeLists.txt directly.
"""

from __future__ import annotations

import re
from pathlib import Path

_PROJECT_RE = re.compile(r"project\(\s*kvcc\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)")


def _from_checkout() -> str:
    cmake = Path(__file__).resolve().parents[2] / "CMakeLists.txt"
    try:
        m = _PROJECT_RE.search(cmake.read_text())
    except OSError:
        m = None
    return m.group(1) if m else "0+unknown"


try:
    from ._version import version as __version__  # type: ignore[import-not-found]
except ImportError:
    __version__ = _from_checkout()
