#!/usr/bin/env bash
# Prints the path of the project's Python (a virtual environment under
# build/pyenv), creating it when missing. With --reference it also installs
# the independent reference's pinned packages (tools/requirements.txt); with
# --sdk the packages of tests/python (the OpenAI SDK, pytest, msgpack, pyzmq:
# tests/python/requirements.txt); with --bindings what the Python module
# needs to build and be tested (nanobind, NumPy, pytest: python/requirements.txt).
# Debian's python3 and python3-venv (scripts/install-deps.sh) are all it needs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${PAGEKV_PYENV:-$root/build/pyenv}"
if [ ! -x "$env_dir/bin/python" ]; then
  mkdir -p "$(dirname "$env_dir")"
  python3 -m venv "$env_dir" >&2
fi
install() {  # name, requirements file: once per version of the file
  local stamp="$env_dir/.$1-$(sha256sum "$2" | cut -c1-16)"
  exec 9>"$env_dir/.install-lock"
  flock 9  # two test runs at once install once
  if [ ! -f "$stamp" ]; then
    "$env_dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$2" >&2
    touch "$stamp"
  fi
}
case "${1:-}" in
  --reference) install reference "$root/tools/requirements.txt" ;;
  --sdk) install sdk "$root/tests/python/requirements.txt" ;;
  --bindings) install bindings "$root/python/requirements.txt" ;;
esac
echo "$env_dir/bin/python"
