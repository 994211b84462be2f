"""The vLLM preprocessing cases in tests/fixtures/tokenizer/vllm_cases.json are what vLLM
0.33.0's own code produces: re-runs scripts/gen_vllm_preproc_cases.py (vLLM's functions taken
from the wheel, see scripts/vllm_extract.py) and compares. The Rust side checks itself against
the file in tests/vllm_preprocess.rs.

Without the wheel (scripts/setup-venv.sh caches it) or transformers, a run under CI=true fails;
elsewhere the test skips loudly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from pyhelpers import require_modules  # noqa: E402

require_modules(transformers="transformers", pydantic="pydantic", jinja2="jinja2")

import vllm_extract  # noqa: E402


def test_cases_are_what_vllm_computes():
    if vllm_extract.find_wheel() is None:
        msg = "the vllm-0.33.0 wheel is not cached; run `make tools` (scripts/setup-venv.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_vllm_preproc_cases.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
