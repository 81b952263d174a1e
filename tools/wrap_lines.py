"""Rewrap the code lines over 100 characters that a lesson page shows, without changing what the code does.

A line is broken after a comma, an opening bracket's first argument, or before a binary `and`/`or`/`+`/`-`, at depth
one or more (inside brackets, where Python continues a line implicitly), as late as the limit allows; the rest is
indented under the innermost open bracket. A comment that makes a line too long moves to its own line above it. A cell
changes only if its syntax tree is the same afterwards (`ast.dump`), so behaviour and outputs cannot change: the
notebook needs no re-execution. Cells the page does not show (`#| export`, `#| hide`, `#| echo: false`) are left
alone. Lines it cannot break (a long string) are listed.

    .venv/bin/python tools/wrap_lines.py nbs/07_linear.ipynb [...] [--check]"""
import argparse, ast, io, json, re, sys, tokenize
from pathlib import Path

LIMIT = 100
HIDDEN = re.compile(r'^#\|\s*(hide|echo:\s*false|include:\s*false|export(\s+[\w.]+)?\s*$|exporti|export_to)', re.M)
OPEN, CLOSE = '([{', ')]}'


def shown(src):
    "Whether the page shows a code cell's source."
    return not HIDDEN.search(src)


def line_tokens(src):
    "Per line number, the (column, type, string) of its tokens, and the bracket depth and stack at each line's start."
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    by_line, stack, starts, prev = {}, [], {}, None
    for t in toks:
        row, col = t.start
        starts.setdefault(row, list(stack))
        if t.type == tokenize.OP and t.string in OPEN: stack.append((row, col, subscript(t.string, prev)))
        elif t.type == tokenize.OP and t.string in CLOSE and stack: stack.pop()
        if t.start[0] == t.end[0]: by_line.setdefault(row, []).append((col, t.type, t.string, t.end[1]))
        else: by_line.setdefault(row, []).append((col, -1, t.string, None))   # a token over several lines
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT): prev = t
    return by_line, starts


def subscript(bracket, prev):
    "Whether an opening bracket starts a subscript (`x[...]`, `f()[...]`), where a break reads badly."
    return bracket == '[' and prev is not None and (prev.type in (tokenize.NAME, tokenize.STRING)
                                                    or prev.string in (')', ']'))


def break_point(line, tokens, start_stack, row):
    """The best (column, indentation of the rest) to break `line` at, or None: at the outermost bracket depth that
    offers a break before the limit, as late as possible there; never with the rest indented past 64 columns."""
    stack, found, target, prev = list(start_stack), [], set(), None   # target: depths in a `for ... in` target
    for col, typ, s, end in tokens:
        if typ == -1: break
        if typ == tokenize.OP and s in CLOSE and stack: target.discard(len(stack)); stack.pop()
        if typ == tokenize.NAME and s == 'for': target.add(len(stack))
        if typ == tokenize.NAME and s == 'in': target.discard(len(stack))
        if stack and col > 0 and not stack[-1][2]:
            indent = stack[-1][1] + 1
            if (typ == tokenize.OP and s == ',' and end <= LIMIT and end < len(line.rstrip())
                    and not any(d <= len(stack) for d in target)):
                found.append((len(stack), end, indent))
            elif typ == tokenize.NAME and s in ('and', 'or', 'for', 'if', 'else') and col <= LIMIT:
                found.append((len(stack), col, indent))
        if typ == tokenize.OP and s in OPEN: stack.append((row, col, subscript(s, prev)))
        prev = tokenize.TokenInfo(typ, s, (row, col), (row, end or col), line)
    found = [f for f in found if f[2] <= 64 and f[1] > f[2]]
    if not found: return None
    depth = min(f[0] for f in found)
    _, col, indent = max((f for f in found if f[0] == depth), key=lambda f: f[1])
    return col, indent


def split_string(line, tokens, start_stack, row):
    """A string literal that runs past the limit, inside brackets: split it at a space into two literals that Python
    joins (the second under the first), or None."""
    stack = list(start_stack)
    for col, typ, s, end in tokens:
        if typ == -1: return None
        if typ == tokenize.OP and s in CLOSE and stack: stack.pop()
        if typ == tokenize.OP and s in OPEN: stack.append((row, col, False))
        if typ != tokenize.STRING or end <= LIMIT or not stack: continue
        m = re.match(r'([fFrRbBuU]{0,2})(["\'])', s)
        if not m or s.startswith(m.group(0) * 3): return None
        prefix, q = m.groups()
        cut = s.rfind(' ', 0, LIMIT - col - 1)
        if cut <= len(prefix) + 1 or cut > len(s) - 3: return None
        if 'f' in prefix.lower() and (s[:cut + 1].count('{') != s[:cut + 1].count('}')): return None
        first, rest = s[:cut + 1] + q, prefix + q + s[cut + 1:]
        return [line[:col] + first, ' ' * col + rest + line[end:]]
    return None


def parenthesise(line, tokens, start_stack):
    """A long `assert test, message` or `name = value` at depth 0: the same statement with its expression in
    parentheses, so that the next round can break inside them; or None."""
    if start_stack or not tokens: return None
    code = [t for t in tokens if t[1] not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    if len(code) == 1 and code[0][1] == tokenize.STRING and not line.rstrip().endswith('\\'):   # a docstring alone
        col, end = code[0][0], code[0][3]
        return [line[:col] + '(' + line[col:end] + ')' + line[end:]]
    if len(code) < 3 or line.rstrip().endswith('\\'): return None
    depth, first, last = 0, None, None
    if code[0][2] == 'assert': first = code[1][0]
    elif len(code) > 2 and code[0][1] == tokenize.NAME and code[1][2] == '=': first = code[2][0]
    if first is None or line[first] == '(': return None
    for col, typ, s, end in code:
        if typ == -1: return None
        if typ == tokenize.OP and s in OPEN: depth += 1
        elif typ == tokenize.OP and s in CLOSE: depth -= 1
        elif typ == tokenize.OP and s == ',' and depth == 0 and code[0][2] == 'assert' and col > first:
            last = col; break
    if last is None: last = code[-1][3] if code[0][2] != 'assert' else len(line.rstrip())
    if code[0][2] != 'assert' and any(t[1] == tokenize.COMMENT for t in tokens): return None
    return [line[:first] + '(' + line[first:last].rstrip() + ')' + line[last:]]


def split_comment(line, tokens):
    "A line whose trailing comment makes it too long: the comment on its own line above, then the code."
    comment = [t for t in tokens if t[1] == tokenize.COMMENT]
    if not comment or comment[0][0] == len(line) - len(line.lstrip()): return None
    col = comment[0][0]
    indent = ' ' * (len(line) - len(line.lstrip()))
    return [indent + line[col:].strip(), line[:col].rstrip()]


def wrap_source(src, rounds=8):
    "Rewrap `src` (one cell) line by line until no line can be broken further; the syntax tree is kept."
    tree = ast.dump(ast.parse(src))
    for _ in range(rounds):
        lines, changed = src.split('\n'), False
        try: by_line, starts = line_tokens(src)
        except (tokenize.TokenError, IndentationError, SyntaxError): return src
        out = []
        for i, line in enumerate(lines, 1):
            if len(line) <= LIMIT or line.lstrip().startswith('#'):
                out.append(line); continue
            toks = by_line.get(i, [])
            moved = split_comment(line, toks)
            bp = None if moved else break_point(line, toks, starts.get(i, []), i)
            parts = None if moved or bp else split_string(line, toks, starts.get(i, []), i)
            parts = parts or (None if moved or bp else parenthesise(line, toks, starts.get(i, [])))
            if moved: out += moved; changed = True
            elif parts: out += parts; changed = True
            elif bp:
                col, indent = bp
                out += [line[:col].rstrip(), ' ' * indent + line[col:].lstrip()]; changed = True
            else: out.append(line)
        new = '\n'.join(out)
        try: same = ast.dump(ast.parse(new)) == tree
        except SyntaxError: same = False
        if not changed or not same: return src
        src = new
    return src


def wrap_notebook(path, check=False):
    "Rewrap the shown code cells of one notebook; returns the lines left too long, as (cell, line)."
    nb = json.loads(Path(path).read_text())
    left = []
    for k, c in enumerate(nb['cells']):
        src = ''.join(c['source'])
        if c['cell_type'] != 'code' or not shown(src) or all(len(l) <= LIMIT for l in src.split('\n')): continue
        magic = [l for l in src.split('\n') if l.startswith(('%', '!'))]
        new = src if magic else wrap_source(src)
        if new != src and not check: c['source'] = new.splitlines(keepends=True)
        left += [(k, l) for l in new.split('\n') if len(l) > LIMIT and not l.startswith('#|')]
    if not check:
        Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    return left


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('notebooks', nargs='+')
    ap.add_argument('--check', action='store_true', help='change nothing; list what would be left too long')
    a = ap.parse_args()
    for p in a.notebooks:
        left = wrap_notebook(p, a.check)
        print(f'{p}: {len(left)} lines left over {LIMIT} characters')
        for k, l in left: print(f'  cell {k}: {l[:110]}')
