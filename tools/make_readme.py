"""Write README.md from nbs/index.ipynb without Quarto: markdown cells as they are, code cells and
their text outputs as fenced blocks (Markdown outputs as Markdown; a cell with `#| echo: false` shows only its
outputs; figures are left to the site), `#| hide` cells left out (what `nbdev_readme` does with Quarto), and
Markdown cells that start with `<!-- site only` left out too (the interactive figure, which needs the site's scripts).
A figure with a caption (`#| fig-cap:`) is written to `images/figure-K.png` and embedded with its caption; other
figures are left to the site.
A code cell with no output and the code cell after it make one snippet, so that a
snippet carries the imports its notebook keeps in a cell of their own. Links to the book's pages (`boyan.html`) point at their notebooks (`nbs/00_boyan.ipynb`), which
GitHub renders, so that the README's links work in the repository as well as on the site."""
import base64, re
from pathlib import Path
from execnb.nbio import read_nb

ROOT = Path(__file__).resolve().parents[1]
SITE_ONLY = '<!-- site only'
FENCED_DIV = re.compile(r'^:::+ *(\{[^}]*\})? *\n', re.M)  # a Quarto div's fences (`::: {.one-equation}`): the site's layout only

def page_links(nbs=ROOT / 'nbs'):
    "The page nbdev makes of each chapter, mapped to its notebook: `boyan.html` -> `nbs/00_boyan.ipynb`."
    return {re.sub(r'^\d+[a-zA-Z0-9]*_', '', p.stem.lower()) + '.html': f'nbs/{p.name}' for p in sorted(nbs.glob('[0-9]*.ipynb'))}

def relink(md, links):
    "Point Markdown links `](page.html...)` at the notebooks."
    return re.sub(r'\]\(([\w-]+\.html)(#[^)]*)?\)', lambda m: f'](' + links.get(m.group(1), m.group(1)) + (m.group(2) or '') + ')', md)

def cell_md(cell, figures=None):
    "One cell as README Markdown; `figures` collects the captioned figures as (caption, PNG bytes)."
    src = cell.source.strip()
    if cell.cell_type == 'markdown': return '' if src.startswith(SITE_ONLY) else FENCED_DIV.sub('', src)
    lines = src.splitlines()
    if any(l.strip() in ('#| hide', '#|hide') for l in lines): return ''
    code = '\n'.join(l for l in lines if not l.startswith('#|'))
    echo = not any(re.match(r'#\|\s*echo:\s*false', l) for l in lines)
    cap = next((m.group(1).strip().strip('"') for l in lines if (m := re.match(r'#\|\s*fig-cap:\s*(.+)', l))), None)
    outs = [output_md(o, cap, figures) for o in cell.get('outputs', [])]
    return '\n\n'.join(([f'```python\n{code}\n```'] if echo else []) + [o for o in outs if o])

def output_md(o, cap=None, figures=None):
    "One output as README Markdown: Markdown as it is, text fenced, a captioned PNG embedded from `images/`, other figures left out."
    d = o.get('data', {})
    if 'text/markdown' in d: return ''.join(d['text/markdown']).strip()
    if 'image/png' in d and cap and figures is not None:
        figures.append((cap, base64.b64decode(''.join(d['image/png']))))
        return f'![{cap}](images/figure-{len(figures)}.png)\n\n*{cap}*'
    if any(k.startswith('image/') for k in d): return ''
    text = ''.join(d.get('text/plain', '') or o.get('text', ''))
    return f'```\n{text.rstrip()}\n```' if text.strip() else ''

def readme(nb_path=ROOT / 'nbs' / 'index.ipynb', images=ROOT / 'images'):
    "README.md's text from the front page; its captioned figures are written to `images/` (None: not written)."
    figures = []
    md = '\n\n'.join(filter(None, (cell_md(c, figures) for c in read_nb(nb_path).cells))) + '\n'
    md = md.replace('\n```\n\n```python\n', '\n\n')   # an import cell and the code after it: one snippet to paste
    if images is not None:
        images.mkdir(exist_ok=True)
        for k, (_, png) in enumerate(figures, 1):
            f = images / f'figure-{k}.png'
            if not f.exists() or f.read_bytes() != png: f.write_bytes(png)
    return relink(md, page_links(nb_path.parent))

if __name__ == '__main__':
    (ROOT / 'README.md').write_text(readme())
    print('wrote README.md')
