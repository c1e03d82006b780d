#!/usr/bin/env bash
# Checks that every #include "..." follows the module dependency rule written
# in docs/ARCHITECTURE.md (the block between "module-deps" markers):
#   - src/M/* may include M/*, D/* for each D that M depends on, and the
#     public headers pagekv/* that M or one of those D owns (the
#     "public-headers" block);
#   - include/pagekv/H may include only public headers whose owner is H's
#     owner or one of its dependencies;
#   - apps/* and python/* may include only pagekv/* and headers beside them; tests/* also
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

# Owner module of each public header (the "public-headers" block).
declare -A owner
while IFS= read -r line; do
  mod="${line%%:*}"
  for h in ${line#*:}; do owner["$h"]="$mod"; done
done < <(sed -n '/<!-- public-headers/,/-->/p' docs/ARCHITECTURE.md | grep -E '^[a-z_]+:')
for f in include/pagekv/*.h; do
  if [ -z "${owner[$(basename "$f")]+x}" ]; then
    echo "check-includes: $f has no owner module in docs/ARCHITECTURE.md public-headers" >&2
    exit 1
  fi
done

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
      *" $top "*)
        # A public header: its owner must be allowed too.
        if [ "$top" = pagekv ]; then
          local h="${inc#pagekv/}" o
          o="${owner[$h]:-}"
          case " $allowed $public_ok " in
            *" $o "*) continue ;;
          esac
          echo "$file: includes \"$inc\" (owned by module $o), but its module may include only: $allowed" >&2
          bad=1
        fi
        continue ;;
    esac
    echo "$file: includes \"$inc\", but its module may include only: $allowed" >&2
    bad=1
  done < <(grep -hoE '^#include "[^"]+"' "$file" | sed -E 's/#include "([^"]+)"/\1/')
}

# Every module M depends on, directly or through others (public types such
# as Status reach every layer above theirs).
closure() {
  local todo="$1" seen="" m d
  while [ -n "$todo" ]; do
    m="${todo%% *}"; todo="${todo#"$m"}"; todo="${todo# }"
    case " $seen " in *" $m "*) continue ;; esac
    seen="$seen $m"
    for d in ${deps[$m]:-}; do todo="$todo $d"; todo="${todo# }"; done
  done
  echo "$seen"
}
public_ok=""  # owners whose public headers the file may include
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
    public_ok="$(closure "$mod")"
    check_file "$f" "$mod pagekv ${deps[$mod]} $extra"
  done \
    < <(find "$dir" -name '*.h' -o -name '*.cc' -o -name '*.cu' | sort)
done
while IFS= read -r f; do
  o="${owner[$(basename "$f")]}"
  if [ "$o" = apps ]; then public_ok="${!deps[*]}"; else public_ok="$(closure "$o")"; fi
  check_file "$f" "pagekv"
done < <(find include/pagekv -name '*.h' | sort)
# Apps and tests use the whole public API.
public_ok="${!deps[*]}"
while IFS= read -r f; do check_file "$f" "pagekv ${deps[apps]:-}"; done \
  < <(find apps -name '*.h' -o -name '*.cc' | sort)
while IFS= read -r f; do check_file "$f" "pagekv testing ${deps[apps]:-}"; done \
  < <(find tests -name '*.h' -o -name '*.cc' | sort)
# The Python module binds the public API only, as an application would.
while IFS= read -r f; do check_file "$f" "pagekv ${deps[apps]:-}"; done \
  < <(find python -name '*.h' -o -name '*.cc' | sort)

if [ "$bad" -ne 0 ]; then exit 1; fi
echo "check-includes: every include follows docs/ARCHITECTURE.md"
