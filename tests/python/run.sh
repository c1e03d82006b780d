#!/usr/bin/env bash
# CTest's entry to tests/python: the project's Python with the SDK and
# pytest (scripts/python-env.sh --sdk), then pytest from the repository root
# with the pagekv binary given as $1.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="$(bash "$root/scripts/python-env.sh" --sdk)"
cd "$root"
PAGEKV_CLI="$1" exec "$python" -m pytest -q -p no:cacheprovider "$root/tests/python"
