#!/usr/bin/env bash
# Prints the path of the stories260K GGUF model used by `make run`:
#   1. $PAGEKV_MODEL, if set and the file exists;
#   2. models/stories260K.gguf (git-ignored; where a download lands);
#   3. ../shared/models/stories260K/stories260K.gguf (the team's shared data);
#   4. else it tries to download the public file into models/ and prints that.
# Prints nothing and exits 1 when none of these works, saying why on stderr.
set -u
URL="https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf"
for p in "${PAGEKV_MODEL:-}" models/stories260K.gguf ../shared/models/stories260K/stories260K.gguf; do
  if [ -n "$p" ] && [ -f "$p" ]; then
    echo "$p"
    exit 0
  fi
done
mkdir -p models
if command -v curl >/dev/null 2>&1 &&
   curl -fsSL --max-time 60 -o models/stories260K.gguf.part "$URL" &&
   head -c 4 models/stories260K.gguf.part | grep -q GGUF; then
  mv models/stories260K.gguf.part models/stories260K.gguf
  echo models/stories260K.gguf
  exit 0
fi
rm -f models/stories260K.gguf.part
echo "find-model: no stories260K model: set PAGEKV_MODEL, or put it at models/stories260K.gguf ($URL could not be downloaded)" >&2
exit 1
