"""README.md as a newcomer reads it (issue 31): every Python snippet runs as pasted into a fresh interpreter (its
imports shown), the front page's figure is embedded from a file that exists, and both set-up commands are named."""
import re, subprocess, sys
import pytest
from conftest import ROOT

pytestmark = pytest.mark.book
README = (ROOT / 'README.md').read_text()

def snippets(md):
    "The fenced Python blocks of a Markdown text."
    return re.findall(r'```python\n(.*?)\n```', md, re.S)

def test_there_are_snippets_to_paste():
    assert len(snippets(README)) >= 2, 'the README shows the library at work'

@pytest.mark.parametrize('k', range(len(snippets(README))))
def test_each_snippet_runs_as_pasted(k):
    "Catches a snippet that leans on an import the README does not show (a NameError when pasted)."
    code = snippets(README)[k]
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, env={'OMP_NUM_THREADS': '1', 'PATH': ''})
    assert res.returncode == 0, f'snippet {k} fails when pasted:\n{code}\n{res.stderr[-2000:]}'

def test_the_figure_is_embedded_and_present():
    figs = re.findall(r'!\[[^\]]+\]\((images/[^)]+\.png)\)', README)
    assert figs and all((ROOT / f).stat().st_size > 10_000 for f in figs), figs

def test_both_commands_and_the_site_rebuild_are_named():
    assert all(cmd in README for cmd in ('make docs', 'make test', 'make site', 'make fresh-clone'))
