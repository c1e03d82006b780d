#!/usr/bin/env bash
# CTest's entry to tests/bindings: pytest with the project's venv (nanobind,
# NumPy, pytest: scripts/python-env.sh --bindings), the module from the
# build tree ($1: <build>/python) and the CLI ($2) to compare against.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="$(bash "$root/scripts/python-env.sh" --bindings)"
cd "$root"
PYTHONPATH="$1" PAGEKV_CLI="$2" exec "$python" -m pytest -q -p no:cacheprovider "$root/tests/bindings"
