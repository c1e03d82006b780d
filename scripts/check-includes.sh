#!/usr/bin/env bash
# Checks that every #include "..." follows the module dependency rule written
# in docs/ARCHITECTURE.md (the block between "module-deps" markers):
#   - src/M/* may include M/*, D/* for each D that M depends on, and pagekv/*;
#   - include/pagekv/* may include only pagekv/*;
#   - apps/* may include only pagekv/* and headers beside them; tests/* also
#     testing/* (test-only fixtures such as the redis-server launcher).
# Exits 1 listing every offending line.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

declare -A deps
while IFS= read -r line; do
  mod="${line%%:*}"
  deps["$mod"]="${line#*:}"
done < <(sed -n '/<!-- module-deps/,/-->/p' docs/ARCHITECTURE.md | grep -E '^[a-z_]+:')

if [ ${#deps[@]} -eq 0 ]; then
  echo "check-includes: no module-deps block found in docs/ARCHITECTURE.md" >&2
  exit 1
fi

bad=0
check_file() {
  local file="$1" allowed="$2"
  while IFS= read -r inc; do
    local top="${inc%%/*}"
    if [ "$top" = "$inc" ]; then
      # No slash: a header beside the file.
      [ -f "$(dirname "$file")/$inc" ] && continue
    fi
    case " $allowed " in
      *" $top "*) continue ;;
    esac
    echo "$file: includes \"$inc\", but its module may include only: $allowed" >&2
    bad=1
  done < <(grep -hoE '^#include "[^"]+"' "$file" | sed -E 's/#include "([^"]+)"/\1/')
}

for dir in src/*/; do
  mod="$(basename "$dir")"
  if [ -z "${deps[$mod]+x}" ]; then
    echo "check-includes: module src/$mod is not listed in docs/ARCHITECTURE.md module-deps" >&2
    bad=1
    continue
  fi
  while IFS= read -r f; do
    extra=""
    case "$f" in *_test.cc|*_bench.cc) extra="testing" ;; esac
    check_file "$f" "$mod pagekv ${deps[$mod]} $extra"
  done \
    < <(find "$dir" -name '*.h' -o -name '*.cc' | sort)
done
while IFS= read -r f; do check_file "$f" "pagekv"; done < <(find include/pagekv -name '*.h' | sort)
while IFS= read -r f; do check_file "$f" "pagekv ${deps[apps]:-}"; done \
  < <(find apps -name '*.h' -o -name '*.cc' | sort)
while IFS= read -r f; do check_file "$f" "pagekv testing ${deps[apps]:-}"; done \
  < <(find tests -name '*.h' -o -name '*.cc' | sort)

if [ "$bad" -ne 0 ]; then exit 1; fi
echo "check-includes: every include follows docs/ARCHITECTURE.md"
