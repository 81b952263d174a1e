"""Every `[source](...ictd/X.py#LN)` link in a committed notebook's output points at the line that defines the entry
below it. A notebook's `show_doc` output records the line its object had when the notebook was last executed; an edit
to the module above it (another chapter exporting into the same file) shifts the lines, and the committed page then
links to the wrong place and no longer equals its rebuild. `make docs` re-executes the notebook and hides this on the
machine that runs it; CI runs `make test` on the committed files, so this check catches it in the unit tier first."""
import json, re
import pytest
from conftest import ROOT

pytestmark = pytest.mark.unit
LINK = re.compile(r'\[source\]\(https://github\.com/ictd/ictd/blob/main/(ictd/[\w/]+\.py)#L(\d+)\)[^\n]*\n\n#+ ([\w.]+)')

def source_links():
    "(notebook, module path, line number, documented name) for every source link in the committed outputs."
    for nb in sorted((ROOT / 'nbs').glob('[!_]*.ipynb')):
        for cell in json.loads(nb.read_text())['cells']:
            for out in cell.get('outputs', []):
                for v in out.get('data', {}).values():
                    text = ''.join(v) if isinstance(v, list) else str(v)
                    for path, line, name in LINK.findall(text): yield nb.name, path, int(line), name

def test_there_are_source_links_to_check():
    assert len(list(source_links())) > 100

def test_every_source_link_points_at_its_definition():
    wrong = []
    for nb, path, line, name in source_links():
        lines = (ROOT / path).read_text().splitlines()
        text = lines[line - 1] if line <= len(lines) else ''
        if name.split('.')[-1] not in text and not text.lstrip().startswith('@'):
            wrong.append(f'{nb}: {name} -> {path}#L{line} is {text.strip()[:60]!r}')
    assert not wrong, 're-execute these notebooks (tools/execute_nbs.py), their source links are stale:\n' + '\n'.join(wrong)
