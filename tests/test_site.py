"""The book's website, built as `make site` builds it and checked page by page in headless Chromium.

For every page, at 1280 px (a laptop) and at 390 px (a phone): the page is no wider than the window; a formula,
code block or table wider than its column scrolls inside its own box with a visible scrollbar (never clipped).
Once per page: the maths is typeset by the vendored KaTeX (no raw `$$`, `\\(`, `\\[` or KaTeX errors left), no
Markdown is left as text outside code (`](`, `**`, a backtick) nor in `show_doc` signatures, every image has loaded,
the console holds no error, no request left `file://`, every internal link (and its `#anchor`) resolves, the
sidebar lists the chapters in order with their numbers, and a click on a figure enlarges it. Every image has alt
text (`test_images_have_alt_text`: a figure cell's `fig-alt`, or its `fig-cap`; `ALT_TEXT_REQUIRED = False` would
make a missing one an xfail). With `ICTD_SCREENSHOTS=1` (`make screenshots`), screenshots (JPEG, the first 8000 px
of each page at each width) go to `_docs/_screenshots/<page>-<width>.jpg` for a person to look at; `make test` leaves
them out (they check nothing and took about a third of this test's time). The front page's interactive
figure: its JavaScript port of weighted softmax TD agrees with `ictd.wstd.weighted_softmax_td` on random contexts,
and each control redraws the figure with the error the library computes for the new setting. Needs Debian's
`chromium` (installed by `make setup` when run as root); skipped with a message where no browser can be had."""
import json, os, re, shutil, subprocess, sys
from pathlib import Path
from urllib.parse import unquote, urlparse
import numpy as np
import pytest
from execnb.nbio import read_nb
import torch
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / 'tools'))
import build_site, explorable_data, make_readme

CHROMIUM = Path('/usr/bin/chromium')
ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
        '--disable-sync', '--no-first-run']
SHOTS = ROOT / '_docs' / '_screenshots'
SCREENSHOTS = os.environ.get('ICTD_SCREENSHOTS') == '1'   # write them (`make screenshots`)


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
    labels = [build_site.sidebar_label(n) for n in nbs]
    contents = yaml.safe_load(build_site.sidebar_yml(nbs, labels, [build_site.part_of(n) for n in nbs]))['website']['sidebar']['contents']
    flat = [e for c in contents for e in (c['contents'] if 'section' in c else [c])]
    assert [c['href'] for c in flat] == nbs and [c['text'] for c in flat] == labels
    sections = [c['section'] for c in contents if 'section' in c]
    assert sections == [t for t, lo, hi in build_site.PARTS if any(build_site.part_of(n) == t for n in nbs)], sections
    assert len(sections) >= 8 and sections[-1] == 'Appendices', 'one sidebar section per part, the appendices last'
    numbers = {'00_boyan.ipynb': '0 ', '00a_tasks.ipynb': '0a ', '05_convergence.ipynb': '5 ', '06b_mechanism.ipynb': '6b ', '10_related.ipynb': '10 ', '90_core.ipynb': 'A ', '95_cli.ipynb': 'F '}
    assert all(labels[nbs.index(n)].startswith(k) for n, k in numbers.items() if n in nbs), labels
    assert labels[nbs.index('00_boyan.ipynb')] == '0 The Boyan chain', 'number, then the title of the notebook'
    assert [build_site.chapter_number(n) for n in ('000_notation.ipynb', '05a_x.ipynb', '10_y.ipynb', 'index.ipynb', '92_z.ipynb')] == ['', '5a', '10', '', 'C']


def test_build_rewrites():
    "What the build fixes in nbdev's output: docstring asterisks, signature links, figure captions and alt text."
    doc = "### f\n\n```python\ndef f(\n    x, # passed to [`g`](boyan.html#g)\n)\n```\n\n*VD against theta*, the best fit.*"
    assert build_site.is_show_doc(doc) and build_site.docstring_emphasis(doc).endswith(r'*VD against theta\*, the best fit.*')
    assert build_site.docstring_emphasis('*A plain docstring.*') == '*A plain docstring.*'
    sig = ('<pre class="sourceCode python"><code><span class="co"># passed to [`g`](boyan.html#g), see `h`</span></code></pre>'
           '<pre class="sourceCode python cell-code"><code><span class="co"># [`g`](x.html) stays</span></code></pre>')
    out = build_site.signature_links(sig)
    assert '# passed to <a href="boyan.html#g"><code>g</code></a>, see <code>h</code>' in out and '# [`g`](x.html) stays' in out
    assert build_site.caption_html('Figure 5.1: $\\rho^L$ and **bold**') == 'Figure 5.1: <span class="math inline">\\(\\rho^L\\)</span> and <strong>bold</strong>'
    two_stars = build_site.caption_html('$\\theta^*$ against $\\theta^*$, *italic*')   # asterisks inside maths are not emphasis
    assert two_stars.count('\\theta^*') == 2 and '<em>' in two_stars and two_stars.count('<em>') == 1
    fig = lambda src: dict(cell_type='code', source=src, outputs=[dict(data={'image/png': 'x'})])
    c = fig("#| fig-cap: 'Figure 1.2: the error of `v` falls as $\\gamma^L$'\nplt.plot()")  # YAML: single quotes keep backslashes
    assert not build_site.figure_alt(c) and build_site.cell_options(c['source'])['fig-alt'] == 'Figure 1.2: the error of v falls as gamma^L'
    c = fig('#| fig-alt: "a plot"\nplt.plot()')
    assert not build_site.figure_alt(c) and c['source'].count('fig-alt') == 1
    assert build_site.figure_alt(fig('plt.plot()')), 'a figure with neither caption nor alt text is reported'


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
        # with its scrollbars shown (Playwright hides them by default), so that the test sees whether wide boxes show one
        b = p.chromium.launch(executable_path=str(exe), headless=True, args=ARGS, ignore_default_args=['--hide-scrollbars'])
        yield b
        b.close()


# Text left in a page (outside code) that means maths was not typeset.
RAW_MATH = re.compile(r'\$\$|\\\(|\\\)|\\\[|\\\]|\$[^$\n]*[\\^_{}][^$\n]*\$')
# Markdown left as text outside code: a link `](`, bold `**`, or a backtick.
RAW_MARKDOWN = re.compile(r'\]\(|\*\*|`')
WIDTHS = (1280, 390)  # a laptop and a phone
SHOT_HEIGHT = 8000    # screenshots show each page's first 8000 px (JPEG's limit is 65535; long pages take seconds)
# Whether a figure without alt text fails the browser test (every chapter's figure cells carry `fig-cap` and `fig-alt`);
# False makes `test_images_have_alt_text` an xfail that lists the pages lacking it.
ALT_TEXT_REQUIRED = True
PAGE_JS = """() => {
  const clone = document.body.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, .katex, .figure-zoom').forEach(e => e.remove());
  return {
    katex: document.querySelectorAll('.katex').length,
    katexErrors: Array.from(document.querySelectorAll('.katex-error')).map(e => e.textContent.slice(0, 80)),
    mathSpans: document.querySelectorAll('span.math').length,
    text: clone.innerText,
    signatures: Array.from(document.querySelectorAll('pre.sourceCode:not(.cell-code) span.co')).map(e => e.textContent).filter(t => /\\]\\(|`/.test(t)),
    images: Array.from(document.images).map(i => ({src: i.src.slice(0, 80), ok: i.complete && i.naturalWidth > 0, alt: (i.getAttribute('alt') || '').trim()})),
    links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
    ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id),
    sidebar: Array.from(document.querySelectorAll('#quarto-sidebar a.sidebar-link')).map(a => a.getAttribute('href')),
    sidebarText: Array.from(document.querySelectorAll('#quarto-sidebar a.sidebar-link')).map(a => a.textContent.trim()),
  };
}"""
# What does not fit: the page wider than the window; a formula, code block or table wider than its box that does not
# scroll (clipped), or whose scrollbar takes no room (invisible: the test runs Chromium with its scrollbars shown);
# a box that reaches past the window's right edge. Folded blocks (`<details>`: proofs, figure code) are opened first.
FIT_JS = """() => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });  // folded proofs and code are measured too
  const vw = document.documentElement.clientWidth, out = [];
  if (document.documentElement.scrollWidth > vw + 1) out.push(`page is ${document.documentElement.scrollWidth} px wide in a ${vw} px window`);
  const main = document.querySelector('main.content') || document.body;
  const what = e => `${e.className.split(' ')[0] || e.tagName.toLowerCase()} "${e.textContent.trim().slice(0, 40)}"`;
  for (const e of main.querySelectorAll('pre, .katex-display, .sd-table, table, .cell-output-display')) {
    if (e.closest('.sd-table, .cell-output-display') && e.closest('.sd-table, .cell-output-display') !== e && e.tagName === 'TABLE') continue;
    const r = e.getBoundingClientRect(), cs = getComputedStyle(e);
    if (r.width === 0) continue;
    if (r.right > vw + 1) out.push(`${what(e)} reaches ${Math.round(r.right)} px, past the window's ${vw} px`);
    if (e.scrollWidth <= e.clientWidth + 1) continue;
    if (!['auto', 'scroll'].includes(cs.overflowX)) out.push(`clipped (wider than its box, does not scroll): ${what(e)}`);
    else if (e.offsetHeight - e.clientHeight - parseFloat(cs.borderTopWidth) - parseFloat(cs.borderBottomWidth) < 1)
      out.push(`scrolls with no visible scrollbar: ${what(e)}`);
  }
  return out;
}"""


def offline_context(browser, width, problems):
    "A browser context `width` px wide in which every request off the machine is refused (and noted in `problems`)."
    ctx = browser.new_context(viewport={'width': width, 'height': 900})
    def route(r):
        if r.request.url.startswith(('file:', 'data:', 'blob:')): return r.continue_()
        problems.append(f'request left the machine: {r.request.url}')
        r.abort()
    ctx.route('**/*', route)
    return ctx


def check_page(page, html, shot, width, query=None):
    "Load one page in `page` (a tab `width` px wide); return what it found (links, ids, sidebar, images) and its problems."
    problems = []
    on_console = lambda m: m.type == 'error' and problems.append(f'console error: {m.text}')
    on_error = lambda e: problems.append(f'page error: {e}')
    # a request the page abandons when the test moves on (a font still loading under load) is not a missing file
    on_failed = lambda r: (r.url.startswith('file:') and not Path(unquote(urlparse(r.url).path)).exists()
                           and problems.append(f'missing file: {r.url}'))
    page.on('console', on_console); page.on('pageerror', on_error); page.on('requestfailed', on_failed)
    page.goto(html.as_uri(), wait_until='load')
    page.wait_for_timeout(50)
    info = page.evaluate(PAGE_JS)
    problems += [f'{width} px: {p}' for p in page.evaluate(FIT_JS)]
    if width == WIDTHS[0]:  # what does not depend on the width: once
        if info['mathSpans'] and not info['katex']: problems.append(f"{info['mathSpans']} maths spans, none typeset by KaTeX")
        problems += [f'KaTeX error: {e}' for e in info['katexErrors']]
        problems += [f'raw maths left: ...{info["text"][max(0, m.start() - 30):m.end() + 30]!r}...' for m in RAW_MATH.finditer(info['text'])][:5]
        problems += [f'raw Markdown left: ...{info["text"][max(0, m.start() - 30):m.end() + 30]!r}...' for m in RAW_MARKDOWN.finditer(info['text'])][:5]
        problems += [f'raw Markdown in a signature: {t.strip()!r}' for t in info['signatures']][:5]
        problems += [f"image not loaded: {i['src']}" for i in info['images'] if not i['ok']]
    if SCREENSHOTS:
        height = min(page.evaluate('document.documentElement.scrollHeight'), SHOT_HEIGHT)
        page.screenshot(path=str(shot), full_page=True, clip=dict(x=0, y=0, width=width, height=height), quality=80)
    if info['images'] and width == WIDTHS[0]:  # a click on a figure shows it full-window; Escape closes it
        page.locator('.cell-output-display img').first.click()
        zoomed = page.locator('.figure-zoom img').count()
        page.keyboard.press('Escape')
        if not zoomed or page.locator('.figure-zoom').count(): problems.append('figure zoom did not open and close')
        page.locator('.cell-output-display img').first.focus()  # from the keyboard: Enter opens, Escape closes
        page.keyboard.press('Enter')
        zoomed = page.locator('.figure-zoom img').count()
        page.keyboard.press('Escape')
        if not zoomed or page.locator('.figure-zoom').count(): problems.append('figure zoom did not open with Enter and close with Escape')
    if query:
        page.fill('.smalldocs-search input', query)
        page.wait_for_timeout(300)
        if not page.locator('.search-result').count(): problems.append(f'search for {query!r} found nothing')
    page.remove_listener('console', on_console); page.remove_listener('pageerror', on_error); page.remove_listener('requestfailed', on_failed)
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


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    "The site, built as `make site` builds it, into a scratch folder."
    return build_site.main(tmp_path_factory.mktemp('site') / '_docs', quiet=True, repo_files=False)


NO_ALT = {}  # page -> images without alt text, filled by test_site_in_browser


@pytest.mark.book
def test_site_in_browser(browser, site):
    """Every page, at 1280 px and at 390 px: fits the window (nothing clipped, wide boxes scroll visibly), renders
    offline and complete (maths typeset, no Markdown left, images loaded), with working links, anchors and search."""
    expected = ['index.html'] + [page_name(n) for n in build_site.notebooks()[1:]]
    pages = sorted(site.glob('*.html'))
    assert sorted(p.name for p in pages) == sorted(expected), 'a page per notebook, named as nbdev links it'
    text = ''.join(p.read_text() for p in pages)
    assert 'cdn.jsdelivr' not in text, 'KaTeX must come from site_libs'
    if build_site.hidden_repo(): assert build_site.hidden_repo() not in text, 'links to a repository that is not public'
    assert 'https://arxiv.org/abs/2605.07333' in text and 'https://arxiv.org/abs/2405.13861' in text, 'links to the two papers'
    if SCREENSHOTS:
        shutil.rmtree(SHOTS, ignore_errors=True)
        SHOTS.mkdir(parents=True)
    problems, links, ids, sidebars = {p.name: [] for p in pages}, {}, {}, {}
    query = json.loads((site / 'search.json').read_text())[-1]['title'].split()[-1]  # a word of a page's title
    for width in WIDTHS:
        ctx = offline_context(browser, width, problems['index.html'])
        page = ctx.new_page()
        for html in pages:
            q = query if html.name == 'index.html' and width == WIDTHS[0] else None
            info, found = check_page(page, html, SHOTS / f'{html.stem}-{width}.jpg', width, q)
            problems[html.name] += found
            if width == WIDTHS[0]:
                links[html], ids[html.resolve()], sidebars[html.name] = info['links'], set(info['ids']), (info['sidebar'], info['sidebarText'])
                NO_ALT[html.name] = [i['src'][:40] for i in info['images'] if not i['alt']]
        ctx.close()
    labels = [build_site.sidebar_label(n) for n in build_site.notebooks()]
    pages_of = lambda sb: ([h for h in sb[0] if h is not None], [t for h, t in zip(*sb) if h is not None])   # section headings have no link
    sections_of = lambda sb: [t for h, t in zip(*sb) if h is None]
    parts = [t for t, lo, hi in build_site.PARTS if any(build_site.part_of(n) == t for n in build_site.notebooks())]
    assert all(pages_of(sb) == (expected, labels) for sb in sidebars.values()), f'sidebar not in chapter order, or not numbered: {sidebars}'
    assert all(sections_of(sb) == parts for sb in sidebars.values()), f'sidebar without one section per part: {sidebars}'
    base = build_site.site_url()
    for html in pages: problems[html.name] += link_problems(site, links[html], ids, base)
    bad = {k: v for k, v in problems.items() if v}
    assert not bad, '\n'.join(f'{k}:\n  ' + '\n  '.join(v) for k, v in bad.items())


@pytest.mark.book
def test_images_have_alt_text(browser, site):
    "Every image on every page has alt text (a figure cell's `fig-alt`, or its `fig-cap`). Lists the pages that lack it."
    if not NO_ALT: pytest.skip('runs after test_site_in_browser')
    missing = {k: len(v) for k, v in NO_ALT.items() if v}
    msg = 'images without alt text (add `#| fig-alt:` or `#| fig-cap:` to the figure cells): ' + ', '.join(f'{k} ({v})' for k, v in missing.items())
    if missing and not ALT_TEXT_REQUIRED: pytest.xfail(msg)
    assert not missing, msg


@pytest.mark.book
def test_search_ranks_prose_above_api(front, site):
    "Searching the book for an idea lists the glossary and the prose that explain it before the functions named after it."
    rank = {e['href']: e['rank'] for e in json.loads((site / 'search.json').read_text())}
    front.fill('.smalldocs-search input', 'diagonality')
    front.wait_for_timeout(300)
    hrefs = [unquote(h.split('/')[-1]) for h in front.locator('.search-result').evaluate_all('es => es.map(e => e.getAttribute("href"))')]
    ranks = [rank[h] for h in hrefs]
    front.fill('.smalldocs-search input', '')
    assert 2 in rank.values() and len(hrefs) > 3, (hrefs, 'an API entry exists, and the search finds several entries')
    assert ranks == sorted(ranks) and ranks[0] < 2, f'prose before API entries: {list(zip(hrefs, ranks))}'


@pytest.mark.book
def test_implementation_folded_until_linked(browser, site):
    """A lesson's "Implementation and tests" section is folded under its heading, and a link to an entry inside it
    (here the first API entry of chapter 1's section) opens the fold and shows the entry."""
    html = site / page_name('01_weighted_softmax_td.ipynb')
    state = """() => { const d = document.querySelector('section#implementation-and-tests > details.implementation-fold');
      const api = d && d.querySelector('.cell-output-markdown h3[id]');
      return {folded: !!d && !d.open, id: api && api.id, shown: api ? api.getBoundingClientRect().top : null}; }"""
    page, ctx, problems = offline_page(browser, html)
    first = page.evaluate(state)
    assert first['folded'] and first['id'], first
    ctx.close()
    ctx = offline_context(browser, 1280, problems)
    page = ctx.new_page()
    page.goto(html.as_uri() + '#' + first['id'], wait_until='load')
    opened_state = state.replace("!d.open", "d.open")
    try: page.wait_for_function(f"() => {{ const s = ({opened_state})(); return s.folded && s.shown >= 0 && s.shown < 900; }}", timeout=10_000)
    except Exception: pass   # the assertion below says what was seen
    opened = page.evaluate(opened_state)
    ctx.close()
    assert opened['folded'] and 0 <= opened['shown'] < 900 and not problems, (opened, problems)


def test_search_rank():
    "The glossary ranks 0, a heading that is a documented name (`show_doc`) 2, any other prose heading 1."
    names = build_site.api_names()
    assert {'MRP', 'weighted_softmax_td', 'MRP.to'} <= names
    entry = lambda href, section: dict(href=href, section=section)
    assert build_site.search_rank(entry('notation.html#glossary', 'Glossary'), names) == 0
    assert build_site.search_rank(entry('wstd.html#weighted_softmax_td', 'weighted_softmax_td'), names) == 2
    assert build_site.search_rank(entry('convergence.html#x', 'The kernel-diagonality condition'), names) == 1


# The front page's interactive figure

def offline_page(browser, html):
    "A page opened from `file://` with every request off the machine refused; returns (page, context, problems)."
    problems = []
    ctx = offline_context(browser, 1280, problems)
    page = ctx.new_page()
    page.on('pageerror', lambda e: problems.append(f'page error: {e}'))
    page.goto(html.as_uri(), wait_until='load')
    return page, ctx, problems


@pytest.fixture(scope='module')
def front(browser, site):
    page, ctx, problems = offline_page(browser, site / 'index.html')
    yield page
    ctx.close()
    assert not problems, problems


def random_context(rng):
    "A random context for `weighted_softmax_td`: features, rewards, a score matrix, alpha, gamma, depth and queries."
    n, d, q = int(rng.integers(1, 60)), int(rng.integers(1, 7)), int(rng.integers(0, 6))
    scale = rng.choice([0.1, 1., 5.])
    return (rng.normal(size=(n + 1, d)), rng.normal(size=n), scale * rng.normal(size=(d, d)), float(rng.uniform(0.05, 1.5)),
            float(rng.uniform(0, 0.99)), int(rng.integers(0, 40)), rng.normal(size=(q, d)))


@pytest.mark.book
def test_wstd_js_matches_library(front):
    "`window.ictd.weightedSoftmaxTD` returns what `weighted_softmax_td` does (values at S_0..S_n, then the queries), to 1e-9."
    from ictd.wstd import weighted_softmax_td
    rng, worst = np.random.default_rng(20261130), 0.
    for _ in range(40):
        phi, R, W, alpha, gamma, L, Q = random_context(rng)
        py = weighted_softmax_td(torch.tensor(phi), torch.tensor(R), torch.tensor(W), alpha=alpha, gamma=gamma, n_iters=L, phi_queries=torch.tensor(Q) if len(Q) else None).numpy()
        js = np.array(front.evaluate('a => window.ictd.weightedSoftmaxTD(...a)', [phi.tolist(), R.tolist(), W.tolist(), alpha, gamma, L, Q.tolist()]))
        assert js.shape == py.shape == (len(phi) + len(Q),)
        worst = max(worst, np.abs(js - py).max() / max(1., np.abs(py).max()))
    assert worst < 1e-9, f'largest relative difference {worst:.2e}'
    with pytest.raises(Exception, match='`rewards` must hold 2 finite numbers'):
        front.evaluate('() => window.ictd.weightedSoftmaxTD([[1], [0], [1]], [1], [[1]], 0.5, 0.9, 3)')


def figure_state(page):
    "What the figure shows now: its parameters, the error it prints (full precision), and each panel's SVG."
    root = page.locator('#wstd-explorable')
    return (json.loads(root.get_attribute('data-params')), float(root.get_attribute('data-msve')),
            {p.get_attribute('data-panel'): p.inner_html() for p in page.locator('.wstd-panel').all()})


def library_msve(p):
    "The figure's error for the setting `p`, computed by the library on the chain and trajectory the page was given."
    from ictd.boyan import random_boyan_chain, sample_trajectory, msve
    from ictd.wstd import weighted_softmax_td
    mrp = random_boyan_chain(n_states=explorable_data.N_STATES, d=explorable_data.D, gamma=explorable_data.GAMMA, features=p['kind'], seed=p['seed'])
    states, rewards = sample_trajectory(mrp, n=explorable_data.N_MAX, seed=p['seed'])
    n, W = p['n'], p['beta'] * torch.eye(mrp.d, dtype=torch.float64)
    return msve(weighted_softmax_td(mrp.phi[states[:n + 1]], rewards[:n], W, alpha=p['alpha'], gamma=mrp.gamma, n_iters=p['depth'], phi_queries=mrp.phi)[n + 1:], mrp)


# Each control, a new value for it, and the panels that must change with it.
MOVES = [('select[name=kind]', 'unit', {'values', 'error', 'attention'}), ('select[name=seed]', '3', {'values', 'error', 'attention'}),
         ('input[name=beta]', '12', {'values', 'error', 'attention'}), ('input[name=alpha]', '0.2', {'values', 'error'}),
         ('input[name=depth]', '75', {'values', 'error'}), ('input[name=n]', '60', {'values', 'error', 'attention'}),
         ('select[name=kind]', 'random', {'values', 'error', 'attention'})]


@pytest.mark.book
def test_explorable_controls(front):
    "Each control redraws the panels it affects, and the error the figure prints is the library's for the new setting (1e-9)."
    from ictd.convergence import empirical_attention
    p, err, panels = figure_state(front)
    assert set(panels) == {'values', 'error', 'attention'} and all('<svg' in h for h in panels.values())
    assert p == dict(seed=0, kind='onehot', beta=5, alpha=0.5, depth=30, n=200), 'the starting point index.ipynb states'
    assert abs(err - library_msve(p)) <= 1e-9 * max(1, err)
    printed = [o for c in read_nb(ROOT / 'nbs' / 'index.ipynb').cells for o in c.get('outputs', []) if 'MSVE after L = 30' in ''.join(o.get('text', ''))]
    assert printed and f'MSVE after L = 30 layers: {err:.4g}' in ''.join(printed[0]['text']), 'index.ipynb prints the figure\'s starting error'
    for selector, value, changed in MOVES:
        (front.select_option if selector.startswith('select') else front.fill)(selector, value)
        q, err, new = figure_state(front)
        name = selector.split('=')[1].rstrip(']')
        assert str(q[name]) == value or q[name] == float(value), f'{name} is {q[name]} after setting it to {value}'
        assert {k for k in new if new[k] != panels[k]} == changed, f'after {name} = {value}'
        assert abs(err - library_msve(q)) <= 1e-9 * max(1, err), f'after {name} = {value}'
        p, panels = q, new
    c = explorable_data.chain_record(p['kind'], p['seed'])
    W = (p['beta'] * np.eye(len(c['phi'][0]))).tolist()
    js = np.array(front.evaluate('a => window.ictd.empiricalAttention(...a)', [c['phi'], W, c['states'][:p['n'] + 1]]))
    py = empirical_attention(torch.tensor(c['phi'], dtype=torch.float64), torch.tensor(W, dtype=torch.float64), torch.tensor(c['states'][:p['n'] + 1])).numpy()
    assert np.abs(js - py).max() < 1e-12, 'window.ictd.empiricalAttention differs from empirical_attention'


@pytest.mark.book
def test_explorable_weight(site):
    "The scripts the figure adds to the front page (library, data, port) stay under 600 kB; README.md leaves the figure out."
    sizes = {f.name: f.stat().st_size for f in (site / 'js').glob('*.js')}
    assert set(sizes) == {'d3.min.js', 'plot.umd.min.js', 'wstd.js', 'wstd-data.js', 'explorable.js'}
    assert sum(sizes.values()) < 600_000, sizes
    readme = make_readme.readme()
    assert '<script' not in readme and 'wstd-explorable' not in readme and 'weighted_softmax_td(' in readme
