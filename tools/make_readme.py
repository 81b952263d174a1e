"""Write README.md from nbs/index.ipynb without Quarto: markdown cells as they are, code cells and
their text outputs as fenced blocks (Markdown outputs as Markdown; a cell with `#| echo: false` shows only its
outputs; figures are left to the site), `#| hide` cells left out (what `nbdev_readme` does with Quarto), and
Markdown cells that start with `<!-- site only` left out too (the interactive figure, which needs the site's scripts).
Links to the book's pages (`boyan.html`) point at their notebooks (`nbs/00_boyan.ipynb`), which
GitHub renders, so that the README's links work in the repository as well as on the site."""
import re
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

def cell_md(cell):
    src = cell.source.strip()
    if cell.cell_type == 'markdown': return '' if src.startswith(SITE_ONLY) else FENCED_DIV.sub('', src)
    lines = src.splitlines()
    if any(l.strip() in ('#| hide', '#|hide') for l in lines): return ''
    code = '\n'.join(l for l in lines if not l.startswith('#|'))
    echo = not any(re.match(r'#\|\s*echo:\s*false', l) for l in lines)
    return '\n\n'.join(([f'```python\n{code}\n```'] if echo else []) + [o for o in map(output_md, cell.get('outputs', [])) if o])

def output_md(o):
    "One output as README Markdown: Markdown as it is, text fenced, figures left out (they are on the site)."
    d = o.get('data', {})
    if 'text/markdown' in d: return ''.join(d['text/markdown']).strip()
    if any(k.startswith('image/') for k in d): return ''
    text = ''.join(d.get('text/plain', '') or o.get('text', ''))
    return f'```\n{text.rstrip()}\n```' if text.strip() else ''

def readme(nb_path=ROOT / 'nbs' / 'index.ipynb'):
    md = '\n\n'.join(filter(None, map(cell_md, read_nb(nb_path).cells))) + '\n'
    return relink(md, page_links(nb_path.parent))

if __name__ == '__main__':
    (ROOT / 'README.md').write_text(readme())
    print('wrote README.md')
