"""Helpers shared by the Python black-box suites (`tests/sim`, `tests/helm`).

The suites run as `python -m pytest -q tests/sim` and `... tests/helm` with no pytest
configuration, so each test module puts this folder on `sys.path` itself before importing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_modules(**packages: str) -> tuple[ModuleType, ...]:
    """Imports the modules named by the keywords, in order, for a test module; each keyword's
    value is the pip package that provides it. When one is missing, a run under CI=true fails;
    elsewhere the whole test module is skipped loudly."""
    wanted = " and ".join(packages.values())
    try:
        return tuple(importlib.import_module(name) for name in packages)
    except ImportError as missing:  # pragma: no cover - depends on the environment
        if os.environ.get("CI") == "true":
            raise ImportError(
                f"{missing}: these tests need {wanted} from requirements-test.txt "
                "(run `make tools`)"
            ) from missing
        pytest.skip(f"{missing}; run `make tools` to install {wanted}", allow_module_level=True)
