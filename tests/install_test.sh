#!/usr/bin/env bash
# CTest's install test: `cmake --install` of this build into a fresh prefix;
# only include/pagekv is installed as headers; examples/embed, built against
# that prefix both through find_package(PageKV) and through pkg-config, runs
# on stories260K and finds the second request's prefix in the cache; the
# installed `pagekv` reports the version.
#   install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build="$1"
root="$2"
model="$root/../shared/models/stories260K/stories260K.gguf"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; exit 1; }
headers="$(cd "$prefix/include" && find . -type f | sort)"
if [ "$(ls "$prefix/include")" != "pagekv" ] || grep -qv '^\./pagekv/[a-z_0-9]*\.h$' <<<"$headers"; then
  echo "install_test: headers other than include/pagekv/*.h installed:"; echo "$headers"; exit 1
fi
grep -q '^\./pagekv/version\.h$' <<<"$headers" || { echo "install_test: version.h not installed"; exit 1; }
version="$(sed -n 's/^project(pagekv VERSION \([0-9.]*\) .*/\1/p' "$root/CMakeLists.txt")"
[ "$("$prefix/bin/pagekv" --version)" = "$version" ] || { echo "install_test: pagekv --version is not $version"; exit 1; }

check() {  # the example's output: two answers, the second with cached prompt tokens
  local out
  out="$("$1" "$model")"
  echo "$out"
  [ "$(grep -c '^prompt ' <<<"$out")" = 2 ] || { echo "install_test: $1 did not answer twice"; exit 1; }
  tail -n 2 <<<"$out" | head -n 1 | grep -q ', [1-9][0-9]* from the prefix cache' ||
    { echo "install_test: $1: the second request found nothing in the prefix cache"; exit 1; }
  grep -qx "pagekv $version" <<<"$out" || { echo "install_test: $1 does not report $version"; exit 1; }
}

# The CMake package, from a clean build folder.
run() {  # a step's output only when it fails
  "$@" >"$tmp/log" 2>&1 || { cat "$tmp/log"; echo "install_test: failed: $*"; exit 1; }
}
run cmake -S "$root/examples/embed" -B "$tmp/cmake-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix"
run cmake --build "$tmp/cmake-build"
check "$tmp/cmake-build/embed"

# pkg-config (the static archive's .pc requires the shared libraries it needs).
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
# shellcheck disable=SC2046  # pkg-config's output is a list of words
c++ -O1 "$root/examples/embed/main.cc" -o "$tmp/embed-pc" $(pkg-config --cflags --libs pagekv)
check "$tmp/embed-pc"
echo "install_test: ok ($version)"
