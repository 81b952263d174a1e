"""The book's structure (issue 31): one number per page, letters in reading order, and no chapter that imports a module
defined by a later page. Appendices (`9N_*`, reference pages) may be imported from anywhere, and the front page is exempt."""
import re
import pytest
from conftest import ROOT

pytestmark = pytest.mark.unit
TEXT = ROOT / 'text'

def pages():
    "The chapter and appendix pages in reading order (file order), with their py:percent twins' text."
    return [(p.stem, p.read_text()) for p in sorted(TEXT.glob('[0-9]*.py'))]

def number(stem):
    m = re.match(r'(\d+)([a-z]?)_', stem)
    return (int(m.group(1)), m.group(2)) if m and len(m.group(1)) <= 2 else None

def test_page_numbers_are_unique_and_lettered_in_order():
    nums = [number(s) for s, _ in pages() if number(s)]
    assert len(nums) == len(set(nums)), sorted(n for n in nums if nums.count(n) > 1)
    for (a, x), (b, y) in zip(nums, nums[1:]):
        if a == b: assert y == chr(ord(x or 'a') + (1 if x else 0)) or (not x and y == 'a'), f'{a}{x} then {b}{y}: letters skip'

def test_no_chapter_imports_a_later_page():
    order = {stem: i for i, (stem, _) in enumerate(pages())}
    module_page = {'ictd.' + m.group(1): stem for stem, s in pages() if (m := re.search(r'#\| default_exp (\S+)', s))}
    late = []
    for stem, s in pages():
        if number(stem) is None or number(stem)[0] >= 90: continue    # front matter and appendices
        for mod in set(re.findall(r'(?:from|import) (ictd\.[\w.]+)', s)):
            page = module_page.get(mod)
            if page and number(page)[0] < 90 and order[page] > order[stem]: late.append(f'{stem} imports {mod} ({page})')
    assert not late, late
