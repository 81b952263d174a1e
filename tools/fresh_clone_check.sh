#!/usr/bin/env bash
# The fresh-clone check (issue 29): clone the committed HEAD into a temporary folder and run the README's two commands
# there exactly as README.md gives them, `make docs` and then `make test`, printing each one's wall time. Run it before
# a submission, on an idle machine, and put the times in the note. Usage: bash tools/fresh_clone_check.sh [KEEP_DIR]
set -euo pipefail
src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
dir=${1:-$(mktemp -d)}
git clone -q "$src" "$dir/ictd"
cd "$dir/ictd"
echo "fresh clone of $(git rev-parse --short HEAD) in $dir/ictd on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
for cmd in "make docs" "make test"; do
  start=$(date +%s)
  if $cmd > "$dir/$(echo $cmd | tr ' ' '-').log" 2>&1; then status=passed; else status=FAILED; fi
  echo "$cmd: $status in $(( $(date +%s) - start )) s (log: $dir/$(echo $cmd | tr ' ' '-').log)"
  [ "$status" = passed ] || { tail -30 "$dir/$(echo $cmd | tr ' ' '-').log"; exit 1; }
done
