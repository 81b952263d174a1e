"""Each chapter's embedded tests, run as nbdev_test runs them, one pytest case per notebook.

Cells flagged `#| slow` run only when the environment variable ICTD_SLOW=1 is set."""
import os
import pytest
from nbdev.config import get_config
from nbdev.test import test_nb as run_notebook
from conftest import ROOT, chapters

@pytest.mark.parametrize('nb', chapters(), ids=lambda p: p.name)
def test_notebook(nb):
    flags = get_config(path=ROOT).tst_flags.split()
    ok, secs = run_notebook(nb, skip_flags=[] if os.environ.get('ICTD_SLOW') == '1' else flags, basepath=ROOT)
    assert ok, f'{nb.name} failed (see the traceback above)'
