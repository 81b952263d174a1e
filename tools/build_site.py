"""Build the book's website into `_docs/` (or `--out DIR`), with or without Quarto.

Where Quarto is installed this is `nbdev_docs`. Elsewhere it runs nbdev's own notebook processing
(as `nbdev.serve.proc_nbs` does, into `_proc/`) and renders the result with smalldocs, then makes the site
work offline: KaTeX from the npm package in `node_modules/` instead of a CDN, the front page's interactive figure
with its data and charting library in `js/` (written by `tools/explorable_data.py`), links to the published
site made relative, the search index readable from `file://`. Pages are named as nbdev links them
(`00_boyan.ipynb` -> `boyan.html`). It also regenerates `README.md` from `nbs/index.ipynb` and
`nbs/sidebar.yml` from the notebooks present (index first, then the chapters in order).
Usage: python tools/build_site.py [--out DIR] [--quiet]
"""
import argparse, json, os, re, shutil, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
KATEX_CDN = 'https://cdn.jsdelivr.net/npm/katex@0.16.11/dist'
KATEX_DIST = ROOT / 'node_modules' / 'katex' / 'dist'
ASSET_DIRS = ('js',)  # folders of nbs/ that pages load scripts from (`project.resources` in _quarto.yml)
# What smalldocs says about Quarto options it does not need here: nothing to act on.
EXPECTED = ('format commonmark is not built', 'keep-md is ignored', 'output-file is not read', 'html-math-method is ignored')


def say(msg, quiet=False):
    if not quiet: print(msg, flush=True)


def notebooks(nbs=ROOT / 'nbs'):
    "The book's notebooks in order: `index.ipynb`, then the chapters `NN_name.ipynb` sorted by number."
    chapters = sorted(p.name for p in nbs.glob('[0-9]*.ipynb'))
    return (['index.ipynb'] if (nbs / 'index.ipynb').exists() else []) + chapters


def chapter_number(name):
    """The chapter number a notebook's file name gives: `00_boyan.ipynb` -> '0', `05a_x.ipynb` -> '5a', an appendix
    `9N_x.ipynb` -> the N-th letter ('90_core.ipynb' -> 'A'); '' for the front page and for front matter (`000_notation.ipynb`)."""
    m = re.match(r'(\d{1,2})([a-z]?)_', name)
    if not m: return ''
    n = int(m.group(1))
    return (chr(ord('A') + n - 90) if n >= 90 else str(n)) + m.group(2)


# The book's parts: a sidebar section each, holding the pages whose chapter number (its digits) falls in the range.
PARTS = (("Part I. The testbed", 0, 0), ("Part II. The algorithm and its Transformer", 1, 4),
         ("Part III. Convergence", 5, 5), ("Part IV. Pretraining", 6, 6), ("Part V. Linear attention", 7, 7),
         ("Part VI. Continuous states", 8, 8), ("Part VII. In-context control", 9, 9), ("Context", 10, 89),
         ("Appendices", 90, 99))


def part_of(name):
    "The title of the part a notebook belongs to, or None for the front page and the front matter."
    m = re.match(r'(\d{1,2})[a-z]?_', name)
    return next((t for t, lo, hi in PARTS if lo <= int(m.group(1)) <= hi), None) if m else None


def nb_title(path):
    "A notebook's title: its first Markdown `# ` heading (nbdev's title), else its file name."
    for c in json.loads(Path(path).read_text())['cells']:
        if c['cell_type'] != 'markdown': continue
        m = re.search(r'^#\s+(.+?)\s*$', ''.join(c['source']), re.M)
        if m: return m.group(1)
    return Path(path).stem


def sidebar_label(name, nbs=ROOT / 'nbs'):
    "The sidebar's text for a notebook: its chapter number, then its title ('5a Convergence experiments')."
    num, title = chapter_number(name), nb_title(nbs / name)
    return f'{num} {title}' if num else title


def sidebar_yml(names, labels=None, parts=None):
    """Quarto's `website.sidebar.contents` listing `names` in order, each with its label (chapter number and title) when given,
    grouped into one `section` per part (`parts[i]` the part of `names[i]`, None outside any part)."""
    parts = parts or [None] * len(names)
    def item(i, n, pad):
        return f'{pad}- href: {n}\n{pad}  text: {json.dumps(labels[i])}\n' if labels else f'{pad}- {n}\n'
    out, current = [], None
    for i, n in enumerate(names):
        if parts[i] != current and parts[i] is not None: out.append(f'      - section: {json.dumps(parts[i])}\n        contents:\n')
        current = parts[i]
        out.append(item(i, n, '          ' if current else '      '))
    return 'website:\n  sidebar:\n    contents:\n' + ''.join(out)


def write_sidebar(nbs=ROOT / 'nbs'):
    "Write `nbs/sidebar.yml` for the notebooks present (numbered as their file names say), if it changed."
    names = notebooks(nbs)
    text = sidebar_yml(names, [sidebar_label(n, nbs) for n in names], [part_of(n) for n in names])
    f = nbs / 'sidebar.yml'
    if not f.exists() or f.read_text() != text: f.write_text(text)


def site_url():
    "The published site's address, from settings.ini, ending with `/`."
    from nbdev.config import get_config
    cfg = get_config(path=ROOT)
    return cfg.doc_host.rstrip('/') + '/' + cfg.doc_baseurl.strip('/') + '/'


def front_matter(nb):
    "The YAML front matter nbdev's processing puts in a notebook's first raw cell."
    import yaml
    c = nb['cells'][0] if nb['cells'] else {}
    if c.get('cell_type') != 'raw': return {}
    m = re.match(r'\s*---\n(.*?)\n---', ''.join(c['source']), re.S)
    return (yaml.safe_load(m.group(1)) or {}) if m else {}


def rewrite(text, renames, base):
    "Point links at the names pages get: `00_boyan.ipynb` -> `boyan.ipynb`, `<site-url>/boyan.html` -> `boyan.html`."
    text = re.sub(re.escape(base) + r'(?=[\w.-]+\.html)', '', text)
    return re.sub(r'(?<![\w/.-])(' + '|'.join(map(re.escape, renames)) + r')(?=[#)"\'\s]|$)',
                  lambda m: renames[m.group(1)], text, flags=re.M) if renames else text


def strip_source_links(text, git_url):
    "Drop `show_doc`'s `[source](<git_url>/blob/...)` links (used while the repository is not public)."
    return re.sub(r'\[source\]\(' + re.escape(git_url.rstrip('/')) + r'/[^)]*\)(\{[^}]*\})?\n?', '', text)


def hidden_repo():
    "settings.ini's `git_url` while it does not call the repository public (`repo_public`), else None."
    from nbdev.config import get_config
    cfg = get_config(path=ROOT)
    return None if str(cfg.get('repo_public', 'False')).lower() in ('true', '1', 'yes') else cfg.git_url


def rewrite_cell(cell, renames, base, git_url=None):
    "Rewrite the links in a cell's source and in its text and Markdown outputs; drop source links to `git_url` if given."
    fix = lambda s: rewrite(''.join(s) if isinstance(s, list) else s, renames, base)
    if git_url: fix = lambda s, f=fix: strip_source_links(f(s), git_url)
    cell['source'] = fix(cell['source'])
    for o in cell.get('outputs', []):
        if 'text' in o: o['text'] = fix(o['text'])
        for k in ('text/markdown', 'text/html'):
            if k in o.get('data', {}): o['data'][k] = fix(o['data'][k])
        md = o.get('data', {}).get('text/markdown')
        if md and is_show_doc(md): o['data']['text/markdown'] = docstring_emphasis(md)


def docstring_emphasis(md):
    "Escape the asterisks inside a `show_doc` docstring (`*... theta* ...*`) so that they do not end its italics early."
    return re.sub(r'^\*(.*\*.*)\*$', lambda m: '*' + m.group(1).replace('*', r'\*') + '*', md, flags=re.M)


def is_show_doc(md):
    "Whether a Markdown output is a `show_doc` entry (a heading, a signature block, then the docstring)."
    return bool(re.search(r'^#{2,4} \S+\n\n```python\n', md, re.M))


def cell_options(src):
    "A code cell's Quarto options (`#| key: value` lines at its top), as a dict."
    import yaml
    lines = [l[3:] for l in src.splitlines() if l.startswith('#| ')]
    try: return yaml.safe_load('\n'.join(lines)) or {} if lines else {}
    except yaml.YAMLError as e:  # Quarto would stop here; e.g. a backslash in a double-quoted caption (use single quotes)
        print(f'warning: cell options are not valid YAML ({e.problem}): {lines[0]!r}', file=sys.stderr)
        return {}


def plain_text(md):
    "Markdown as plain text for an alt attribute: no maths delimiters, backslashes, backticks or emphasis marks."
    return re.sub(r'\\(?=[a-zA-Z])|[$`*]', '', md).replace('\\', '')


def _emphasis(text):
    "Bold and italics of a stretch of Markdown with no maths or code in it."
    text = re.sub(r'\*\*([^*]+)\*\*', r'<strong>\1</strong>', text)
    return re.sub(r'(?<![\w*])\*([^*\s][^*]*)\*(?!\w)', r'<em>\1</em>', text)


def caption_html(text):
    "A figure caption's Markdown (smalldocs leaves it as text; Quarto renders it): maths, code, bold and italics (never inside maths or code)."
    out = []
    for part in re.split(r'((?<!\\)\$[^$]+\$|`[^`]+`)', text):
        if len(part) > 1 and part[0] == part[-1] == '$': out.append(f'<span class="math inline">\\({part[1:-1]}\\)</span>')
        elif len(part) > 1 and part[0] == part[-1] == '`': out.append(f'<code>{part[1:-1]}</code>')
        else: out.append(_emphasis(part))
    return ''.join(out)


FIGCAPTION = re.compile(r'<figcaption>(.*?)</figcaption>', re.S)


def has_figure(cell):
    return any(m in o.get('data', {}) for o in cell.get('outputs', []) for m in ('image/png', 'image/svg+xml', 'image/jpeg'))


def figure_alt(cell):
    """Give a figure cell that has a `fig-cap` but no `fig-alt` its caption as alt text, as Quarto does; return
    whether the figure still has no text for a screen reader (no caption and no alt)."""
    if cell['cell_type'] != 'code' or not has_figure(cell): return False
    opts = cell_options(cell['source'])
    if opts.get('fig-alt'): return False
    cap = opts.get('fig-cap')
    if isinstance(cap, list): cap = cap[0] if cap else None
    if not cap: return True
    cell['source'] = f'#| fig-alt: {json.dumps(plain_text(str(cap)))}\n' + cell['source']
    return False


FOLD = '#| code-fold: true\n#| code-summary: "Code for the figure"\n'


def fold_plotting(cell):
    "Fold the code of a cell that draws a figure (plumbing for a reader), unless the cell sets `code-fold` itself."
    if cell['cell_type'] != 'code' or 'code-fold' in cell['source']: return
    if any('image/png' in o.get('data', {}) or 'image/svg+xml' in o.get('data', {}) for o in cell.get('outputs', [])):
        cell['source'] = FOLD + cell['source']


def rename_pages(proc, base, hide_repo=None):
    """Rename processed notebooks to the page names nbdev links (`output-file`), and rewrite the links to them
    (dropping source links into `hide_repo`, a repository that is not public)."""
    renames, no_alt = {}, {}
    for f in sorted(proc.glob('*.ipynb')):
        out = front_matter(json.loads(f.read_text())).get('output-file')
        if out and Path(out).stem != f.stem: renames[f.name] = Path(out).stem + '.ipynb'
    for f in sorted(proc.glob('*.ipynb')):
        nb = json.loads(f.read_text())
        for c in nb['cells']:
            rewrite_cell(c, renames, base, hide_repo)
            if figure_alt(c): no_alt[f.name] = no_alt.get(f.name, 0) + 1
            fold_plotting(c)
        (proc / renames.get(f.name, f.name)).write_text(json.dumps(nb))
        if f.name in renames: f.unlink()
    if no_alt: print('warning: figures with neither fig-cap nor fig-alt (no text for a screen reader): '
                     + ', '.join(f'{k} ({v})' for k, v in no_alt.items()), file=sys.stderr)
    names = notebooks()
    (proc / 'sidebar.yml').write_text(sidebar_yml([renames.get(n, n) for n in names], [sidebar_label(n) for n in names],
                                                  [part_of(n) for n in names]))
    return renames


SEARCH_SHIM = """// The search index, inlined so that search works from file:// where fetch() cannot read files.
(() => {
  const index = %s;
  const fetch0 = window.fetch ? window.fetch.bind(window) : null;
  window.fetch = (url, opts) => String(url).endsWith('search.json')
    ? Promise.resolve(new Response(JSON.stringify(index), {headers: {'Content-Type': 'application/json'}}))
    : fetch0(url, opts);
})();
"""


HEADING = re.compile(r'<h([1-6])[^>]*data-anchor-id="([^"]+)"[^>]*>(.*?)</h\1>', re.S)
TOC_LINK = re.compile(r'(<a href="#([^"]+)" id="toc-[^"]*"[^>]*>).*?</a>', re.S)


def toc_maths(html):
    "Give the table of contents the headings' maths (smalldocs writes their TeX as plain text there)."
    heads = {h: inner for _, h, inner in HEADING.findall(html) if 'class="math' in inner}
    return TOC_LINK.sub(lambda m: m.group(1) + heads[m.group(2)] + '</a>' if m.group(2) in heads else m.group(0), html) if heads else html


SIG_PRE = re.compile(r'<pre class="sourceCode(?![^"]*cell-code)[^"]*">.*?</pre>', re.S)
COMMENT = re.compile(r'<span class="co">(.*?)</span>', re.S)


def comment_markdown(text):
    "A signature comment's Markdown as HTML: ``[`f`](page.html#f)`` -> a link, `` `x` `` -> code."
    text = re.sub(r'\[`([^`]+)`\]\(([^)\s]+)\)', r'<a href="\2"><code>\1</code></a>', text)
    return re.sub(r'(?<![\w>])`([^`]+)`', r'<code>\1</code>', text)


def signature_links(html):
    "Render the Markdown that nbdev's doc links leave in the comments of `show_doc` signatures (code blocks, not cells)."
    return SIG_PRE.sub(lambda m: COMMENT.sub(lambda c: '<span class="co">' + comment_markdown(c.group(1)) + '</span>', m.group(0)), html)


# Search: the reader's words first. smalldocs' search (Fuse.js) scores an API entry whose heading is a function name
# (`diagonality_curve`) above the prose that explains the idea, so each entry of the index gets a rank (0 the glossary,
# 1 prose, 2 an API entry) and the results are ordered by rank, Fuse's order kept within a rank.
FUSE_CALL = 'fuse.search(q, { limit }).map((h) => h.item)'
RANKED_CALL = ('fuse.search(q, { limit: 5 * limit }).map((h) => h.item)'
               '.sort((a, b) => (a.rank || 0) - (b.rank || 0)).slice(0, limit)')


def api_names():
    "The names `show_doc` headings carry: every symbol of `ictd/_modidx.py`, without its module (`MRP`, `MRP.to`)."
    from ictd._modidx import d
    return {k[len(m) + 1:] for m, syms in d['syms'].items() for k in syms}


def search_rank(entry, names):
    "0 for the glossary, 2 for an API entry (its heading is a documented name), 1 for the rest of the prose."
    if entry['href'].split('#')[0] == 'notation.html' and entry['section'] == 'Glossary': return 0
    return 2 if entry['section'].strip() in names else 1


def rank_search(site):
    "Give every entry of the site's `search.json` its rank, and make `smalldocs.js` order the results by it."
    index, names = json.loads((site / 'search.json').read_text()), api_names()
    for e in index: e['rank'] = search_rank(e, names)
    (site / 'search.json').write_text(json.dumps(index))
    js = site / 'site_libs' / 'smalldocs.js'
    text = js.read_text()
    if FUSE_CALL not in text: raise SystemExit(f'{js}: smalldocs changed its search call; update FUSE_CALL in {__file__}')
    js.write_text(text.replace(FUSE_CALL, RANKED_CALL))


def npm_packages():
    "Install the npm packages of package-lock.json (KaTeX, Observable Plot, d3) unless they are in `node_modules/`."
    if all((ROOT / 'node_modules' / p / 'package.json').exists() for p in json.loads((ROOT / 'package.json').read_text())['dependencies']): return
    if not shutil.which('npm'): raise SystemExit('node_modules/ is incomplete and npm is not installed: install Node.js, then run `npm ci` (package.json)')
    subprocess.run(['npm', 'ci', '--no-audit', '--no-fund'], cwd=ROOT, check=True, capture_output=True)


def offline(site):
    "Vendor KaTeX into `site_libs/katex`, inline the search index, and point every page at them."
    libs = site / 'site_libs'
    kx = libs / 'katex'
    kx.mkdir(parents=True, exist_ok=True)
    for f in ('katex.min.css', 'katex.min.js'): shutil.copy(KATEX_DIST / f, kx / f)
    (kx / 'contrib').mkdir(exist_ok=True)
    shutil.copy(KATEX_DIST / 'contrib' / 'auto-render.min.js', kx / 'contrib')
    shutil.copytree(KATEX_DIST / 'fonts', kx / 'fonts', dirs_exist_ok=True)
    shutil.copy(ROOT / 'node_modules' / 'katex' / 'LICENSE', kx / 'LICENSE')
    for css in libs.rglob('*.css'):  # the theme's web fonts: the page falls back on the system's fonts
        css.write_text(re.sub(r'@import url\(["\']?https?://[^)]*\);?', '', css.read_text()))
    rank_search(site)
    (libs / 'search-index.js').write_text(SEARCH_SHIM % (site / 'search.json').read_text())
    for page in site.rglob('*.html'):
        up = '../' * (len(page.relative_to(site).parts) - 1)
        html = FIGCAPTION.sub(lambda m: '<figcaption>' + caption_html(m.group(1)) + '</figcaption>', page.read_text())
        html = signature_links(toc_maths(html)).replace(KATEX_CDN, f'{up}site_libs/katex')
        html = html.replace(f'<script src="{up}site_libs/smalldocs.js"',
                            f'<script src="{up}site_libs/search-index.js"></script>\n<script src="{up}site_libs/smalldocs.js"', 1)
        page.write_text(html)


def process(nbs, proc):
    """nbdev's processing for the docs (what `nbdev.serve.proc_nbs` does, one file at a time): notebooks through
    `FilterDefaults` (show_doc run, directives applied, front matter from the title), other files copied."""
    import nbdev.serve_drv
    from nbdev.processors import FilterDefaults
    shutil.rmtree(proc, ignore_errors=True)
    proc.mkdir(parents=True)
    in_test = os.environ.get('IN_TEST')  # serve_drv sets and then deletes it
    try:
        for f in sorted(nbs.iterdir()):
            if f.is_dir() and f.name in ASSET_DIRS: shutil.copytree(f, proc / f.name)
            if f.name.startswith(('.', '_')) and f.name != '_quarto.yml' or not f.is_file(): continue  # scratch notebooks too
            if f.suffix == '.ipynb': nbdev.serve_drv.main((f, proc / f.name, FilterDefaults))
            else: shutil.copy(f, proc / f.name)  # _quarto.yml: the file the symlink points at
    finally:
        if in_test is not None: os.environ['IN_TEST'] = in_test


def build_smalldocs(out, quiet=False):
    "Process the notebooks as nbdev does, render them with smalldocs, and move the site to `out`."
    from fastcore.xtras import working_directory
    from nbdev.quarto import refresh_quarto_yml
    from smalldocs.site import build
    out = Path(out).resolve()
    # `_proc/` as nbdev_docs uses it for the book; a scratch folder for any other build (the test's)
    proc = ROOT / '_proc' if out == (ROOT / '_docs').resolve() else Path(tempfile.mkdtemp(prefix='ictd-proc-'))
    with working_directory(ROOT):
        refresh_quarto_yml()  # nbdev.yml from settings.ini, as nbdev_docs does
        process(ROOT / 'nbs', proc)
        rename_pages(proc, site_url(), hidden_repo())
    site = build(proc, quiet=True)
    for w in site.warnings:
        if not any(e in w for e in EXPECTED): print(f'warning: {w}', file=sys.stderr)
    offline(proc / '_docs')
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(proc / '_docs', out)
    if proc != ROOT / '_proc': shutil.rmtree(proc, ignore_errors=True)
    return out


def main(out=ROOT / '_docs', quiet=False, repo_files=True):
    "Build the site into `out`; with `repo_files`, also write README.md and nbs/sidebar.yml (the test builds without)."
    import explorable_data
    npm_packages()
    explorable_data.write(ROOT / 'nbs' / 'js')  # the interactive figure's data and charting library (ignored by git)
    if repo_files:
        import make_readme
        (ROOT / 'README.md').write_text(make_readme.readme())
        write_sidebar()
    if shutil.which('quarto') and Path(out).resolve() == (ROOT / '_docs').resolve():
        subprocess.run([str(Path(sys.executable).parent / 'nbdev_docs')], cwd=ROOT, check=True)
    else:
        out = build_smalldocs(out, quiet)
    say(f'site: {Path(out) / "index.html"}', quiet)
    return Path(out)


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=str(ROOT / '_docs'), help='where to write the site (default _docs)')
    ap.add_argument('--quiet', action='store_true', help='print only warnings')
    a = ap.parse_args()
    main(Path(a.out), a.quiet)
