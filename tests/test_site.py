"""The book's website, built as `make site` builds it and checked page by page in headless Chromium.

For every page: the maths is typeset by the vendored KaTeX (no raw `$$`, `\\(`, `\\[` or KaTeX
errors left), every image has loaded, the console holds no error, no request left `file://`, and
every internal link (and its `#anchor`) resolves. A full-page screenshot (JPEG) of each page goes to
`_docs/_screenshots/` for a person to look at. Needs Debian's `chromium` (installed by `make setup`
when run as root); skipped with a message where no browser can be had."""
import json, os, re, shutil, subprocess, sys
from pathlib import Path
from urllib.parse import unquote, urlparse
import pytest
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / 'tools'))
import build_site

CHROMIUM = Path('/usr/bin/chromium')
ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
        '--disable-sync', '--no-first-run']
SHOTS = ROOT / '_docs' / '_screenshots'


def page_name(nb):
    "The page nbdev links a notebook as (its `_nbpath2html`): `00_boyan.ipynb` -> `boyan.html`, `00a_tasks.ipynb` -> `tasks.html`."
    return re.sub(r'^\d+[a-zA-Z0-9]*_', '', Path(nb).stem.lower()) + '.html'


def test_config():
    "One `_quarto.yml` at the top, read by nbdev through the `nbs/_quarto.yml` symlink; the sidebar lists the notebooks in order."
    link = ROOT / 'nbs' / '_quarto.yml'
    assert link.is_symlink() and link.resolve() == (ROOT / '_quarto.yml').resolve()
    cfg = yaml.safe_load((ROOT / '_quarto.yml').read_text())
    assert cfg['project']['type'] == 'website' and cfg['metadata-files'] == ['nbdev.yml', 'sidebar.yml']
    nbs = build_site.notebooks()
    assert nbs[0] == 'index.ipynb' and nbs[1:] == sorted(p.name for p in (ROOT / 'nbs').glob('[0-9]*.ipynb'))
    assert yaml.safe_load(build_site.sidebar_yml(nbs))['website']['sidebar']['contents'] == nbs


def chromium():
    "The browser's path, installing Debian's chromium when it is missing and we are root; None where that is impossible."
    if not CHROMIUM.exists() and hasattr(os, 'geteuid') and os.geteuid() == 0 and shutil.which('apt-get'):
        for cmd in (['apt-get', 'update', '-q'], ['apt-get', 'install', '-y', '-q', 'chromium']):
            subprocess.run(cmd, capture_output=True, timeout=900)
    return CHROMIUM if CHROMIUM.exists() else None


@pytest.fixture(scope='module')
def browser():
    sync_api = pytest.importorskip('playwright.sync_api', reason='the playwright package is not installed (pip install -e ".[dev]")')
    exe = chromium()
    if exe is None: pytest.skip(f'no browser: {CHROMIUM} is missing and cannot be installed here (apt-get install -y chromium, as root)')
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(exe), headless=True, args=ARGS)
        yield b
        b.close()


# Text left in a page (outside code) that means maths was not typeset.
RAW_MATH = re.compile(r'\$\$|\\\(|\\\)|\\\[|\\\]|\$[^$\n]*[\\^_{}][^$\n]*\$')
PAGE_JS = """() => {
  const clone = document.body.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, .katex').forEach(e => e.remove());
  return {
    katex: document.querySelectorAll('.katex').length,
    katexErrors: Array.from(document.querySelectorAll('.katex-error')).map(e => e.textContent.slice(0, 80)),
    mathSpans: document.querySelectorAll('span.math').length,
    text: clone.innerText,
    images: Array.from(document.images).map(i => ({src: i.src.slice(0, 80), ok: i.complete && i.naturalWidth > 0})),
    links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
    ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id),
    sidebar: Array.from(document.querySelectorAll('#quarto-sidebar a.sidebar-link')).map(a => a.getAttribute('href')),
  };
}"""


def check_page(browser, html, shot, query=None):
    "Load one page (and search it for `query`); return what it found (links, ids, sidebar) and the list of problems."
    problems, ctx = [], browser.new_context(viewport={'width': 1280, 'height': 900})
    def route(r):
        if r.request.url.startswith(('file:', 'data:', 'blob:')): return r.continue_()
        problems.append(f'request left the machine: {r.request.url}')
        r.abort()
    ctx.route('**/*', route)
    page = ctx.new_page()
    page.on('console', lambda m: m.type == 'error' and problems.append(f'console error: {m.text}'))
    page.on('pageerror', lambda e: problems.append(f'page error: {e}'))
    page.on('requestfailed', lambda r: r.url.startswith('file:') and problems.append(f'missing file: {r.url}'))
    page.goto(html.as_uri(), wait_until='load')
    page.wait_for_timeout(100)
    info = page.evaluate(PAGE_JS)
    if info['mathSpans'] and not info['katex']: problems.append(f"{info['mathSpans']} maths spans, none typeset by KaTeX")
    problems += [f'KaTeX error: {e}' for e in info['katexErrors']]
    problems += [f'raw maths left: ...{info["text"][max(0, m.start() - 30):m.end() + 30]!r}...' for m in RAW_MATH.finditer(info['text'])][:5]
    problems += [f"image not loaded: {i['src']}" for i in info['images'] if not i['ok']]
    page.screenshot(path=str(shot), full_page=True, quality=85)  # JPEG: half the time of a PNG
    if info['images']:  # a click on a figure shows it full-window; Escape closes it
        page.locator('.cell-output-display img').first.click()
        zoomed = page.locator('.figure-zoom img').count()
        page.keyboard.press('Escape')
        if not zoomed or page.locator('.figure-zoom').count(): problems.append('figure zoom did not open and close')
    if query:
        page.fill('.smalldocs-search input', query)
        page.wait_for_timeout(300)
        if not page.locator('.search-result').count(): problems.append(f'search for {query!r} found nothing')
    ctx.close()
    return info, problems


def link_problems(site, links, ids, base):
    "Internal links whose file or anchor is missing, and links to the published site that should be relative."
    out = []
    for href in links:
        if href.startswith(base): out.append(f'absolute link to the published site: {href}'); continue
        u = urlparse(href)
        if u.scheme != 'file': continue
        target = Path(unquote(u.path)).resolve()
        if target.is_dir(): target = target / 'index.html'
        if not target.exists(): out.append(f'broken link: {href}')
        elif u.fragment and target.suffix == '.html' and target in ids and unquote(u.fragment) not in ids[target]:
            out.append(f'missing anchor: {href}')
    return out


def test_site_in_browser(browser, tmp_path_factory):
    "Build the site into a scratch folder; every page renders offline, complete, with working links and search."
    site = build_site.main(tmp_path_factory.mktemp('site') / '_docs', quiet=True, repo_files=False)
    expected = ['index.html'] + [page_name(n) for n in build_site.notebooks()[1:]]
    pages = sorted(site.glob('*.html'))
    assert sorted(p.name for p in pages) == sorted(expected), 'a page per notebook, named as nbdev links it'
    assert 'cdn.jsdelivr' not in ''.join(p.read_text() for p in pages), 'KaTeX must come from site_libs'
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    problems, links, ids, sidebars = {}, {}, {}, {}
    query = json.loads((site / 'search.json').read_text())[-1]['title'].split()[-1]  # a word of a page's title
    for html in pages:
        info, problems[html.name] = check_page(browser, html, SHOTS / (html.stem + '.jpg'), query if html.name == 'index.html' else None)
        links[html], ids[html.resolve()], sidebars[html.name] = info['links'], set(info['ids']), info['sidebar']
    assert all(sb == expected for sb in sidebars.values()), f'sidebar not in chapter order: {sidebars}'
    base = build_site.site_url()
    for html in pages: problems[html.name] += link_problems(site, links[html], ids, base)
    bad = {k: v for k, v in problems.items() if v}
    assert not bad, '\n'.join(f'{k}:\n  ' + '\n  '.join(v) for k, v in bad.items())
