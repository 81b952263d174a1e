"""Rewrite call sites of functions whose parameters moved behind `*` (CONTRIBUTING.md, "Arguments") to pass them by keyword.

For each call of a name in `MOVES` with more positional arguments than the new signature takes, the extra ones get their
parameter's name (`theta_star(d, W, 1., .9)` -> `theta_star(d, W, alpha=1., gamma=.9)`); where the new signature also
reorders the positional data (`REORDERED`), the argument list is rebuilt. Works on notebooks' code cells and on .py files,
changing only the calls it names, and checks that each rewritten cell still parses and calls the same names.
Usage: python tools/keyword_calls.py FILE... [--check]   (--check: list what would change, change nothing, exit 1 if any)
"""
import argparse, ast, json, sys
from pathlib import Path

MOVES = {   # name -> (parameters in their old positional order, how many stay positional)
    "theta_star": (("d", "W", "alpha", "gamma"), 2),
    "prefix_softmax_td": (("phi_states", "rewards", "W", "alpha", "gamma", "n_iters", "phi_queries", "current", "order",
                           "recency", "return_all"), 3),
    "weighted_softmax_td": (("phi_states", "rewards", "W", "alpha", "gamma", "n_iters", "phi_queries", "rho", "score",
                             "return_all", "centred", "method"), 3),
    "batch_linear_td": (("phi_states", "rewards", "alpha", "gamma", "n_iters", "phi_queries", "return_all"), 2),
    "certainty_equivalence": (("states", "rewards", "n_states", "gamma"), 3),
    "SoftmaxICTD": (("d", "n_layers", "shared", "init_gain", "seed", "dtype", "device"), 1),
    "ShiftAfterAttentionICTD": (("d", "n_layers", "shared", "init_gain", "seed", "dtype", "device"), 1),
    "CausalSoftmaxICTD": (("d", "n_layers", "shared", "init_gain", "seed", "dtype", "device"), 1),
    "LinearICTD": (("d", "n_layers", "shared", "init_gain", "seed", "dtype", "softmax"), 1),
    "from_td": (("d", "n_layers", "alpha", "C", "dtype"), 1),
    "ControlICTD": (("d", "n_layers", "init_gain", "seed", "hard"), 1),
    "random_boyan_chain": (("n_states", "d", "gamma", "features", "rewards", "seed"), 2),
    "sample_trajectory": (("mrp", "n", "seed", "start"), 1),
    "fitted_td_step": (("n", "n_layers", "gamma", "n_states", "d", "n_tasks"), 0),
    "sliding_td_coefficients": (("phi", "r", "states", "n", "gamma", "n_layers"), 3),
    "sliding_td_loss": (("v", "rewards", "gamma"), 2),
    "td_semigradient_poly": (("coef", "rewards", "gamma"), 2),
}
REORDERED = {   # name -> (old positional order, the new positional parameters in their order)
    "sample_trajectories": (("P", "n", "d0", "seed"), ("P", "d0")),
    "from_theta_star": (("d", "n_layers", "W", "alpha", "gamma", "shared"), ("d", "W")),
    "from_theta_td_memory": (("d", "n_layers", "W", "alpha", "gamma", "shared"), ("d", "W")),
}


AMBIGUOUS = {"sample_trajectory": ("boyan", "ictd")}   # also a method of other classes: only a call through these modules
OLD_ORDER_OF = {("from_theta_star", "CausalSoftmaxICTD"): ("d", "n_layers", "W", "alpha", "gamma", "current", "order", "recency",
                                                         "shared")}   # a class whose old order differs from REORDERED's


def _called(node):
    f = node.func
    if isinstance(f, ast.Name): return f.id
    if not isinstance(f, ast.Attribute): return None
    if f.attr in AMBIGUOUS and not (isinstance(f.value, ast.Name) and f.value.id in AMBIGUOUS[f.attr]): return None
    return f.attr


def _offset(lines, lineno, col):
    "Character offset in the joined text of (1-based line, UTF-8 byte column)."
    line = lines[lineno - 1]
    return sum(len(l) for l in lines[:lineno - 1]) + len(line.encode()[:col].decode())


def _is_old_reordered(node, new):
    "Old form of a reordered call: more positionals than the new signature, or an int where the new one has data."
    args = node.args
    if len(args) > len(new): return True
    return len(args) == 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, int)


def edits_of(src:str)->list:
    "(start, end, replacement) for every call in `src` to rewrite."
    tree, lines, out = ast.parse(src), src.splitlines(keepends=True), []
    seg = lambda n: ast.get_source_segment(src, n)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args): continue
        name = _called(node)
        if name in MOVES:
            old, keep = MOVES[name]
            if len(node.args) <= keep: continue
            if len(node.args) > len(old): raise ValueError(f"{name}: {len(node.args)} positional arguments, more than {old}")
            for a, p in zip(node.args[keep:], old[keep:]):
                at = _offset(lines, a.lineno, a.col_offset)
                out.append((at, at, f"{p}="))
        elif name in REORDERED:
            old, new = REORDERED[name]
            if not _is_old_reordered(node, new): continue
            owner = node.func.value.id if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) else None
            old = OLD_ORDER_OF.get((name, owner), old)
            if len(node.args) > len(old): raise ValueError(f"{name}: {len(node.args)} positional arguments, more than {old}")
            named = dict(zip(old, map(seg, node.args)))
            parts = [named.pop(p) for p in new if p in named] + [f"{k}={v}" for k, v in named.items()]
            parts += [seg(k) if k.arg is None else f"{k.arg}={seg(k.value)}" for k in node.keywords]
            first = min([node.args[0]] + node.keywords, key=lambda x: (x.lineno, x.col_offset))
            last = max(node.args + node.keywords, key=lambda x: (x.end_lineno, x.end_col_offset))
            out.append((_offset(lines, first.lineno, first.col_offset), _offset(lines, last.end_lineno, last.end_col_offset),
                        ", ".join(parts)))
    return sorted(out, reverse=True)


def _masked(src:str)->str:
    "Cell magics and shell lines as comments of the same length, so that the cell parses and offsets stay."
    return "".join("#" + l[1:] if l.lstrip().startswith(("%", "!")) and l.strip() else l for l in src.splitlines(keepends=True))


def rewrite(src:str)->str:
    masked = _masked(src)
    try: edits = edits_of(masked)
    except SyntaxError: return src
    new = src
    for a, b, text in edits: new = new[:a] + text + new[b:]
    if edits:
        calls = lambda s: sorted(_called(n) or "" for n in ast.walk(ast.parse(_masked(s))) if isinstance(n, ast.Call))
        assert calls(new) == calls(src), "a rewrite changed which functions are called"
    return new


def process(path:Path, check:bool)->int:
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        n = 0
        for cell in nb["cells"]:
            if cell["cell_type"] != "code": continue
            src = "".join(cell["source"])
            new = rewrite(src)
            if new != src:
                n += 1
                cell["source"] = new.splitlines(keepends=True)
        if n and not check: path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    else:
        src = path.read_text()
        new = rewrite(src)
        n = int(new != src)
        if n and not check: path.write_text(new)
    if n: print(f"{path}: {n} {'cell' if path.suffix == '.ipynb' else 'file'}{'s' * (n > 1)} {'to rewrite' if check else 'rewritten'}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    total = sum(process(p, a.check) for p in a.files)
    sys.exit(1 if a.check and total else 0)


if __name__ == "__main__":
    main()
