"""Write README.md from nbs/index.ipynb without Quarto: markdown cells as they are, code cells and
their text outputs as fenced blocks, `#| hide` cells left out (what `nbdev_readme` does with Quarto)."""
from pathlib import Path
from execnb.nbio import read_nb

ROOT = Path(__file__).resolve().parents[1]

def cell_md(cell):
    src = cell.source.strip()
    if cell.cell_type == 'markdown': return src
    lines = src.splitlines()
    if any(l.strip() in ('#| hide', '#|hide') for l in lines): return ''
    code = '\n'.join(l for l in lines if not l.startswith('#|'))
    outs = [''.join(o.get('data', {}).get('text/plain', '') or o.get('text', '')) for o in cell.get('outputs', [])]
    return '\n\n'.join([f'```python\n{code}\n```'] + [f'```\n{o.rstrip()}\n```' for o in outs if o.strip()])

def readme(nb_path=ROOT / 'nbs' / 'index.ipynb'):
    return '\n\n'.join(filter(None, map(cell_md, read_nb(nb_path).cells))) + '\n'

if __name__ == '__main__':
    (ROOT / 'README.md').write_text(readme())
    print('wrote README.md')
