# Sourced by the README's two commands (scripts/quickstart.sh, scripts/test.sh): picks the Python to
# install into and installs ds_maximus there, idempotently.
#
# - A virtual environment that is already active ($VIRTUAL_ENV) is used as it is.
# - Otherwise the project's own venv, ./.venv, is created (or reused). This is what makes the commands work
#   on a distribution's Python (Debian 12, Ubuntu 24.04), whose pip refuses to install into the system
#   ("externally-managed-environment").
# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build where a CPU build is wanted.
# The "test" extra (pytest, ruff) comes with it: the README's test command lints and tests in one go.
set -eu
MAXIMUS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${VIRTUAL_ENV:-}" ]; then
  MAXIMUS_PY="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x "$MAXIMUS_ROOT/.venv/bin/python" ]; then
    echo "[maximus] creating the project venv $MAXIMUS_ROOT/.venv" >&2
    if ! python3 -m venv "$MAXIMUS_ROOT/.venv"; then
      echo "[maximus] python3 -m venv failed: install your distribution's venv package" \
           "(Debian/Ubuntu: apt install python3-venv) or activate a virtual environment first" >&2
      exit 1
    fi
  fi
  MAXIMUS_PY="$MAXIMUS_ROOT/.venv/bin/python"
  export VIRTUAL_ENV="$MAXIMUS_ROOT/.venv"
  export PATH="$MAXIMUS_ROOT/.venv/bin:$PATH"
fi
# one marker per installed requirement set: a second run skips pip entirely (seconds, not a minute)
_stamp="$("$MAXIMUS_PY" -c 'import sys; print(sys.prefix)')/.maximus_installed"
_want="$(cat "$MAXIMUS_ROOT/pyproject.toml" | sha1sum | cut -c1-12)"
if [ "$(cat "$_stamp" 2>/dev/null || true)" != "$_want" ]; then
  echo "[maximus] installing torch==2.13.0, DeepSpeed 0.19.8 and ds_maximus into $("$MAXIMUS_PY" -c 'import sys; print(sys.prefix)') (about a minute)" >&2
  "$MAXIMUS_PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$MAXIMUS_PY" -m pip install -q --disable-pip-version-check -e "$MAXIMUS_ROOT[test]"
  echo "$_want" > "$_stamp"
fi
