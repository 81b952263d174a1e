#!/usr/bin/env bash
# The fresh-clone check (issue 29): clone the committed HEAD into a temporary folder and run the README's two commands
# there exactly as README.md gives them, `make docs` and then `make test`, printing each one's wall time. Run it before
# a submission, on an idle machine, and put the times in the note. The times, with the commit, date and CPU, go to
# nbs/data/fresh_clone.json in the repository checked (the front page reads them).
# Usage: bash tools/fresh_clone_check.sh [KEEP_DIR]
set -euo pipefail
src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
dir=${1:-$(mktemp -d)}
git clone -q "$src" "$dir/ictd"
cd "$dir/ictd"
echo "fresh clone of $(git rev-parse --short HEAD) in $dir/ictd on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
declare -A took
for cmd in "make docs" "make test"; do
  start=$(date +%s)
  if $cmd > "$dir/$(echo $cmd | tr ' ' '-').log" 2>&1; then status=passed; else status=FAILED; fi
  took[$cmd]=$(( $(date +%s) - start ))
  echo "$cmd: $status in ${took[$cmd]} s (log: $dir/$(echo $cmd | tr ' ' '-').log)"
  [ "$status" = passed ] || { tail -30 "$dir/$(echo $cmd | tr ' ' '-').log"; exit 1; }
done
.venv/bin/python - "$src/nbs/data/fresh_clone.json" "${took[make docs]}" "${took[make test]}" <<'PY'
import json, os, sys
from pathlib import Path
from ictd.core import provenance
out, docs, test = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
record = {"provenance": provenance("bash tools/fresh_clone_check.sh"), "cores": os.cpu_count(),
          "make docs": {"seconds": docs, "passed": True}, "make test": {"seconds": test, "passed": True}}
tmp = out.with_suffix(".json.tmp")
tmp.write_text(json.dumps(record, indent=1) + "\n")
os.replace(tmp, out)
PY
echo "wrote $src/nbs/data/fresh_clone.json"
