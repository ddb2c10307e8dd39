#!/usr/bin/env bash
# Create ./.venv (if missing) and install ROSE with its test tools, pinned by constraints.txt.
# Re-installs only when pyproject.toml or constraints.txt changed. Needs only Python >= 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.rose-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "installing ROSE into .venv (first run takes a minute or two) ..." >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test]"
  echo "$want" > "$stamp"
fi
