"""Measure the built site's pages as a reader sees them at 1280 px (issue 31's targets), in headless Chromium.

Per page: its height in desktop screens (900 px each, folded blocks left folded), the share of its height taken by API
entries (`show_doc` outputs), the smallest scale at which a figure is shown (its width on the page over its natural
width), the number of code lines over 100 characters in its code cells (folded ones included), and the display
equations wider than their box. Run `make site` first; then

    .venv/bin/python tools/measure_pages.py [PAGE ...] [--json OUT]

where PAGE is a notebook's stem (`05_convergence`) or nothing for every page. Prints a Markdown table."""
import argparse, json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
import build_site

SCREEN = 900      # px of page height per desktop screen (a 1280 x 900 window)
WIDTH = 1280
LONG_LINE = 100   # characters
CHROMIUM = Path('/usr/bin/chromium')

MEASURE_JS = """() => {
  const main = document.querySelector('main.content') || document.body;
  const height = document.documentElement.scrollHeight;
  const api = Array.from(main.querySelectorAll('.cell-output-markdown'))
    .filter(e => e.firstElementChild && e.firstElementChild.tagName === 'HR' && e.querySelector('h2, h3, h4'));
  const apiHeight = api.reduce((s, e) => s + e.getBoundingClientRect().height, 0);
  const scales = Array.from(main.querySelectorAll('.cell-output-display img'))
    .filter(i => i.naturalWidth > 0 && i.getBoundingClientRect().width > 0)
    .map(i => i.getBoundingClientRect().width / i.naturalWidth);
  const code = Array.from(main.querySelectorAll('.cell pre.sourceCode'))
    .filter(p => !p.closest('.cell-output'));
  const lines = code.flatMap(p => p.textContent.split('\\n'));
  const displays = Array.from(main.querySelectorAll('.katex-display'))
    .filter(e => e.getBoundingClientRect().width > 0 || e.closest('details'));
  return {height, apiHeight, nApi: api.length, scales, codeLines: lines.length,
          longLines: lines.filter(l => l.length > %d).length,
          displays: displays.length, overflowing: displays.filter(e => e.scrollWidth > e.clientWidth + 1).length};
}""" % LONG_LINE


def page_html(nb):
    "The page nbdev writes for notebook `nb` (`00a_tasks.ipynb` -> `tasks.html`)."
    return 'index.html' if nb == 'index.ipynb' else re.sub(r'^\d+[a-zA-Z0-9]*_', '', Path(nb).stem.lower()) + '.html'


def is_lesson(nb):
    "Whether a notebook is a lesson page (a numbered chapter), not the front page, front matter or an appendix."
    return bool(re.match(r'^(0[0-9]|10)[a-z]?_', nb))


def measure(page, html):
    "The measures of one built page, opened in `page` (a browser tab 1280 px wide)."
    page.goto(html.as_uri(), wait_until='load')
    page.wait_for_timeout(100)
    page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = false; })")
    m = page.evaluate(MEASURE_JS)
    page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = true; })")
    folded = page.evaluate(MEASURE_JS)   # folded code and displays count too once opened
    return dict(screens=m['height'] / SCREEN, api_share=m['apiHeight'] / m['height'], n_api=m['nApi'],
                min_figure_scale=min(m['scales'], default=None), n_figures=len(m['scales']),
                code_lines=folded['codeLines'], long_code_lines=folded['longLines'],
                displays=folded['displays'], overflowing_displays=folded['overflowing'])


def table(rows):
    "A Markdown table of the measures, one row per page, with the targets in the header."
    head = ('| page | screens (<= 15) | API share (<= 10%) | smallest figure scale (>= 0.6) | '
            'code lines > 100 chars (0) | overflowing displays (0) |\n|---|---|---|---|---|---|')
    fmt = lambda r: (f"| {r['notebook']} | {r['screens']:.1f} | {100 * r['api_share']:.0f}% | "
                     f"{'-' if r['min_figure_scale'] is None else format(r['min_figure_scale'], '.2f')} | "
                     f"{r['long_code_lines']} | {r['overflowing_displays']} |")
    return '\n'.join([head] + [fmt(r) for r in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('pages', nargs='*', help="notebook stems, e.g. 05_convergence (default: every page)")
    ap.add_argument('--json', type=Path, help='also write the measures to this JSON file')
    ap.add_argument('--site', type=Path, default=ROOT / '_docs', help='the built site (make site)')
    a = ap.parse_args(argv)
    nbs = build_site.notebooks()
    if a.pages: nbs = [n for n in nbs if Path(n).stem in a.pages]
    missing = [n for n in nbs if not (a.site / page_html(n)).exists()]
    if missing: sys.exit(f'not built: {missing}; run `make site` first')
    from playwright.sync_api import sync_playwright
    rows = []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=['--no-sandbox', '--disable-gpu'])
        page = b.new_context(viewport={'width': WIDTH, 'height': SCREEN}).new_page()
        for n in nbs: rows.append(dict(notebook=Path(n).stem, lesson=is_lesson(n), **measure(page, a.site / page_html(n))))
        b.close()
    print(table(rows))
    lessons = [r for r in rows if r['lesson']]
    if lessons:
        print(f"\nlesson pages: {len(lessons)}; over 15 screens: {sum(r['screens'] > 15 for r in lessons)}; "
              f"API share over 10%: {sum(r['api_share'] > 0.1 for r in lessons)}; "
              f"a figure below 0.6: {sum((r['min_figure_scale'] or 1) < 0.6 for r in lessons)}; "
              f"long code lines: {sum(r['long_code_lines'] for r in lessons)}; "
              f"overflowing displays: {sum(r['overflowing_displays'] for r in lessons)}; "
              f"screens in all: {sum(r['screens'] for r in lessons):.0f}")
    if a.json:
        tmp = a.json.with_suffix('.tmp')
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(a.json)


if __name__ == '__main__':
    main()
