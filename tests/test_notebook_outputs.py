"""A chapter cell that prints must keep its printout: execnb (which executes the book) drops everything a cell wrote to
stdout when its source ends in `;`, so a cell like `print(x)` followed by `record_claim(...);` loses its print."""
import pytest
from execnb.nbio import read_nb
from execnb.shell import CaptureShell
from conftest import chapters

pytestmark = pytest.mark.book

def test_execnb_drops_prints_of_a_cell_ending_in_semicolon():
    "The behaviour the check below guards against (if execnb changes, this test says so)."
    sh = CaptureShell()
    assert sh.run("print(1)\nx = 2;") == [] and sh.run("print(1)\nx = 2")[0]["output_type"] == "stream"

@pytest.mark.parametrize("nb", chapters(), ids=lambda p: p.name)
def test_no_printing_cell_ends_in_semicolon(nb):
    bad = [i for i, c in enumerate(read_nb(nb).cells) if c.cell_type == "code" and c.source.rstrip().endswith(";")
           and any(k in c.source for k in ("print(", "Markdown(", "display("))]
    assert not bad, f"{nb.name}: cells {bad} print but end in ';', so their output is lost (end them with `_ = ...` instead)"
