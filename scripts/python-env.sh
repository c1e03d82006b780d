#!/usr/bin/env bash
# Prints the path of the project's Python (a virtual environment under
# build/pyenv), creating it when missing. With --reference it also installs
# the independent reference's pinned packages (tools/requirements.txt).
# Debian's python3 and python3-venv (scripts/install-deps.sh) are all it needs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${PAGEKV_PYENV:-$root/build/pyenv}"
if [ ! -x "$env_dir/bin/python" ]; then
  mkdir -p "$(dirname "$env_dir")"
  python3 -m venv "$env_dir" >&2
fi
if [ "${1:-}" = "--reference" ]; then
  stamp="$env_dir/.reference-$(sha256sum "$root/tools/requirements.txt" | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    "$env_dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/tools/requirements.txt" >&2
    touch "$stamp"
  fi
fi
echo "$env_dir/bin/python"
