"""Add the machine fields that `ictd.core.provenance` records today (cpu, torch_cpu_capability, machine, nudge) to saved results
under nbs/data/ made before it recorded them, as 'not recorded': the files keep their numbers and say honestly what is unknown.
Run once from the repository root: python tools/backfill_provenance.py"""
import json
from pathlib import Path

UNKNOWN = dict(torch="not recorded", cpu="not recorded (made before provenance named the CPU)", torch_cpu_capability="not recorded", machine="not recorded", nudge=0.0)

def provenance_of(d:dict)->dict:
    "The provenance record of a saved file: its `provenance` entry, or the file itself where the record sits at the top."
    return d["provenance"] if "provenance" in d else d

for path in sorted(Path("nbs/data").glob("*.json")):
    text = path.read_text()
    d = json.loads(text)
    prov = provenance_of(d)
    missing = {k: v for k, v in UNKNOWN.items() if k not in prov}
    if not missing: continue
    prov.update(missing)
    indent = 1 if text.startswith("{\n") else None
    path.write_text(json.dumps(d, indent=indent))
    print(f"{path}: added {sorted(missing)}")
