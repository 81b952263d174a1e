"""Each chapter's embedded tests, run as nbdev_test runs them, one pytest case per notebook.

Cells flagged `#| slow` run only when the environment variable ICTD_SLOW=1 is set. The chapters in `FAST` are left to
tests/test_rebuild.py, which executes them in full with the same flags (so their tests run there) and checks their outputs,
unless ICTD_SLOW=1 asks for their slow cells too."""
import os
import pytest
from nbdev.config import get_config
from nbdev.test import test_nb as run_notebook
from conftest import FAST, ROOT, chapters

@pytest.mark.parametrize('nb', [p for p in chapters() if os.environ.get('ICTD_SLOW') == '1' or p.name not in FAST], ids=lambda p: p.name)
def test_notebook(nb):
    flags = get_config(path=ROOT).tst_flags.split()
    ok, secs = run_notebook(nb, skip_flags=[] if os.environ.get('ICTD_SLOW') == '1' else flags, basepath=ROOT)
    assert ok, f'{nb.name} failed (see the traceback above)'
