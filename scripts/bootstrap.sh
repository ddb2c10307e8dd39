#!/usr/bin/env bash
# Create ./.venv (if missing) and install ROSE with its test tools, pinned by constraints.txt.
# Re-installs only when pyproject.toml, constraints.txt or the interpreter changed. Needs only Python >= 3.11.
#
# Why a cache: installing the pinned dependencies takes 3-4 minutes on two cores (torch alone is 750 MB of
# files and 15,000 compiled modules), which a fresh clone (CI's) paid on every run. A finished install is
# kept under ~/.cache/rose/venvs/<hash of those three> and a clone restores it as hard links, re-pointing
# the scripts' interpreter and the editable install at itself: seconds. ROSE_VENV_CACHE=DIR moves the
# cache, ROSE_VENV_CACHE=off turns it off. A restore that cannot import the project falls back to installing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=.venv/.rose-installed
want="$( (cat pyproject.toml constraints.txt; "$PY" -c 'import sys; print(sys.version)') | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  exit 0
fi
cache_root="${ROSE_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rose/venvs}"
cached="$cache_root/$want"

restore() {  # restore "$1" (a cached install) as ./.venv
  rm -rf .venv
  cp -al "$1" .venv 2>/dev/null || cp -a "$1" .venv  # hard links where the cache is on this disk
  local here
  here="$(pwd)/.venv"
  # console scripts name their interpreter by absolute path: this clone's (sed -i writes a new file,
  # so the cached one, hard-linked, is left as it was)
  for f in .venv/bin/*; do
    if [ -f "$f" ] && [ ! -L "$f" ] && [ "$(head -c 2 "$f")" = "#!" ]; then
      sed -i "1s|^#!.*/bin/python[0-9.]*$|#!$here/bin/python|" "$f"
    fi
  done
  sed -i "s|^VIRTUAL_ENV=.*|VIRTUAL_ENV=\"$here\"|" .venv/bin/activate
  # the editable install maps the package `rose` to the clone that made the cache: map it to this one
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e . > .venv/restore.log 2>&1 \
    && .venv/bin/python -c "import rose.cli.main, torch" \
    && rm -f "$stamp"  # the cached stamp is the same file (a hard link): a new one is written below
}

if [ "$cache_root" != off ] && [ -x "$cached/bin/python" ]; then
  echo "restoring ROSE's .venv from $cached ..." >&2
  if restore "$cached"; then
    echo "$want" > "$stamp"
    exit 0
  fi
  cat .venv/restore.log >&2 || true
  echo "the cached .venv did not import; installing afresh" >&2
  rm -rf .venv
fi
# No install for these pins yet, but one for others (pyproject.toml or constraints.txt changed since): start from the
# newest and let pip add or change only what differs (seconds to a minute, where a fresh install takes minutes)
newest="$(ls -1dt "$cache_root"/*/ 2>/dev/null | head -n 1 || true)"
if [ "$cache_root" != off ] && [ -n "$newest" ] && [ -x "${newest%/}/bin/python" ] && [ ! -x .venv/bin/python ]; then
  echo "starting ROSE's .venv from the cached install $newest (pins changed since) ..." >&2
  restore "${newest%/}" || rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
echo "installing ROSE into .venv (a first run without a cached install takes a few minutes) ..." >&2
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test]"
echo "$want" > "$stamp"
if [ "$cache_root" != off ]; then
  # keep this install for the next clone (an atomic rename: a half-copied cache is never used), and
  # only the three newest installs
  mkdir -p "$cache_root"
  tmp="$cache_root/.tmp-$$"
  rm -rf "$tmp"
  if (cp -al .venv "$tmp" 2>/dev/null || cp -a .venv "$tmp") && mv -T "$tmp" "$cached" 2>/dev/null; then
    ls -1dt "$cache_root"/*/ 2>/dev/null | tail -n +4 | xargs -r rm -rf
  fi
  rm -rf "$tmp"
fi
