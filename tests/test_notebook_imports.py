"""nbdev re-executes every cell that holds an import when it builds the docs: such a cell must hold imports alone,
or the site build fails on names defined by earlier cells (as chapter 6b's once did)."""
import re
import pytest
from execnb.nbio import read_nb
from conftest import chapters

IMPORT = re.compile(r'^(from \S+ import|import )')

@pytest.mark.book
@pytest.mark.parametrize('nb', chapters(), ids=lambda p: p.name)
def test_import_cells_hold_only_imports(nb):
    bad = []
    for i, c in enumerate(read_nb(nb).cells):
        if c.cell_type != 'code' or re.search(r'^#\| *export', c.source, re.M): continue
        code = [l for l in c.source.splitlines() if l.strip() and not l.lstrip().startswith('#')]
        if any(IMPORT.match(l) for l in code) and not all(IMPORT.match(l) or l.startswith((' ', ')')) for l in code): bad.append(i)
    assert not bad, f'{nb.name}: cells {bad} mix imports with other code'
