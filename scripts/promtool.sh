#!/usr/bin/env bash
# Prints the path of Prometheus's promtool, for the metrics test. It is taken
# from Debian 12's `prometheus` package, downloaded (not installed: that
# package would also install and start a Prometheus service) and unpacked
# under build/tools once; a promtool already on PATH is used as it is.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
  command -v promtool
  exit 0
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${PAGEKV_TOOLS:-$root/build/tools}/prometheus"
tool="$dir/root/usr/bin/promtool"
if [ ! -x "$tool" ]; then
  mkdir -p "$dir"
  exec 9>"$dir/.lock"
  flock 9  # two test runs at once fetch once
  if [ ! -x "$tool" ]; then
    fetch() { (cd "$dir" && rm -f prometheus_*.deb && apt-get download -qq prometheus >&2); }
    if ! fetch; then
      # A fresh machine may have no package lists yet.
      if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq >&2 && fetch
      elif command -v sudo >/dev/null 2>&1; then
        sudo apt-get update -qq >&2 && fetch
      else
        echo "promtool.sh: 'apt-get download prometheus' failed; run 'apt-get update' as root and retry" >&2
        exit 1
      fi
    fi
    dpkg-deb -x "$dir"/prometheus_*.deb "$dir/root"
    rm -f "$dir"/prometheus_*.deb
  fi
fi
echo "$tool"
