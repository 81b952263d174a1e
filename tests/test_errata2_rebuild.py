"""Rebuilding chapters 1, 3, 4 and 5 (tens of seconds each) writes them byte for byte (issue 20): they show
round-off as bounds and plot no digit of it. Same procedure as tests/test_rebuild.py."""
import pytest
from test_rebuild import test_rebuild_leaves_notebook_unchanged as rebuild_unchanged


@pytest.mark.book
@pytest.mark.parametrize('name', ['01_weighted_softmax_td.ipynb', '03_dual_head.ipynb', '04_tsm.ipynb', '05_convergence.ipynb'])
def test_errata2_chapter_rebuilds_unchanged(name):
    rebuild_unchanged(name)
