# %%
#| default_exp claims

# %%
#| export
from __future__ import annotations
import json, re
from pathlib import Path
from ictd.core import load_claims

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
from IPython.display import Markdown
from ictd.claims import chapter_labels, ledger, status_table   # defined in "Implementation and tests" below

# %% [markdown]
# # The claims ledger
# > Every claim the book checks, chapter by chapter, with its status and a link to the check that would fail if it
# > were false.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - Every claim the chapters record as they execute, in reading order, with its status.
# - How many claims each chapter proves, measures, holds only in part, or refutes.
# - The front page shows only the headline claims; this page is the whole ledger.
# :::

# %% [markdown]
# Each chapter records the claims it checks as it executes, with `record_claim` ([appendix A](core.html)), in a file
# under `nbs/data/claims/`. A claim has one of four statuses:
#
# - **proved**: a proof on the page and a check to machine precision;
# - **measured**: a statistic over tasks or seeds, with its uncertainty;
# - **partial**: it holds only in a regime the chapter names;
# - **refuted**: the check fails, and the chapter says what holds instead.
#
# Nothing on this page is typed: it is read from those records when the book is built, and a chapter that is edited
# rewrites its records when it executes again.

# %% [markdown]
# ## Status by chapter

# %%
#| echo: false
labels, claims = chapter_labels(), load_claims("data/claims")
Markdown(status_table(claims, labels))

# %% [markdown]
# ## The ledger

# %%
#| echo: false
Markdown(ledger(claims, labels))

# %% [markdown]
# ## Implementation and tests

# %%
#| export
STATUSES = ("proved", "measured", "partial", "refuted")   # the statuses a claim record may carry, strongest first

def chapter_labels(nbs=Path("."),  # the folder of the notebooks
                  )->dict:         # page name ('convergence') -> label ('5 Convergence in depth and context length')
    "Each chapter's page name mapped to its number and title, in the order of the file names (the reading order)."
    out = {}
    for f in sorted(Path(nbs).glob("[0-9]*.ipynb")):
        m = re.match(r"(\d{1,3})([a-z]?)_", f.name)
        cells = json.loads(f.read_text())["cells"]
        src = next("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        title = re.search(r"^#\s+(.+)$", src, re.M).group(1)
        num = int(m.group(1)) if m and len(m.group(1)) <= 2 else None
        number = "" if num is None else (chr(ord("A") + num - 90) if num >= 90 else str(num)) + m.group(2)
        out[re.sub(r"^\d+[a-z]?_", "", f.stem)] = f"{number} {title}".strip()
    return out


# %%
#| export
def _cell(text:str)->str: return text.replace("|", "\\|")   # a pipe in a claim (|v| in maths) must not end the cell

def _check_claims(claims, labels)->None:
    "A `ValueError` naming `claims` or `labels` unless they are claim records and a page -> label mapping."
    keys = {"claim", "status", "chapter"}
    if not isinstance(claims, (list, tuple)) or not all(isinstance(c, dict) and keys <= set(c) for c in claims):
        raise ValueError(f"`claims` must be a list of claim records (dicts with {sorted(keys)}), as `load_claims` returns, "
                         f"got {type(claims).__name__}")
    if not isinstance(labels, dict): raise ValueError(f"`labels` must be a dict page name -> label, got {type(labels).__name__}")

def _by_chapter(claims:list, labels:dict)->dict:
    "Claims grouped by chapter, chapters in reading order (unknown chapters last)."
    _check_claims(claims, labels)
    order = {page: i for i, page in enumerate(labels)}
    groups = {}
    for c in sorted(claims, key=lambda c: order.get(c["chapter"], len(order))): groups.setdefault(c["chapter"], []).append(c)
    return groups

def claims_table(claims:list,  # claim records (`load_claims`)
                 labels:dict,  # page name -> label (`chapter_labels`)
                )->str:        # a Markdown table: claim, status, chapter, evidence
    "The claim records as a Markdown table, one row per claim, in the order given."
    _check_claims(claims, labels)
    link = lambda c: f"[see]({c['chapter']}.html{c['evidence']})" if c.get("evidence") else ""
    rows = [f"| {_cell(c['claim'])} | {c['status']} | [{labels.get(c['chapter'], c['chapter'])}]({c['chapter']}.html) | {link(c)} |"
            for c in claims]
    return "\n".join(["| claim | status | chapter | evidence |", "|---|---|---|---|", *rows])

def status_table(claims:list, labels:dict)->str:
    "One row per chapter with a claim: how many claims of each status, and the total row."
    groups = _by_chapter(claims, labels)
    count = lambda cs, s: sum(c["status"] == s for c in cs)
    rows = [f"| [{labels.get(p, p)}]({p}.html) | " + " | ".join(str(count(cs, s)) for s in STATUSES) + f" | {len(cs)} |"
            for p, cs in groups.items()]
    total = "| **all chapters** | " + " | ".join(f"**{count(claims, s)}**" for s in STATUSES) + f" | **{len(claims)}** |"
    return "\n".join(["| chapter | " + " | ".join(STATUSES) + " | all |", "|---" * (len(STATUSES) + 2) + "|", *rows, total])

def ledger(claims:list, labels:dict)->str:
    "Every claim, one section per chapter in reading order: the claim, its status, and a link to its check."
    link = lambda c: f" ([check]({c['chapter']}.html{c['evidence']}))" if c.get("evidence") else ""
    parts = [f"### [{labels.get(p, p)}]({p}.html)\n\n" + "\n".join(f"- **{c['status']}**: {c['claim']}{link(c)}" for c in cs)
             for p, cs in _by_chapter(claims, labels).items()]
    return "\n\n".join(parts)


# %% [markdown]
# The functions on small records: the ledger keeps reading order, the counts add up, and a pipe inside a claim is
# escaped so that it does not split a table cell.

# %%
toy = [dict(key="a", claim="late |v|", status="measured", chapter="late", evidence="#x"),
       dict(key="b", claim="early", status="proved", chapter="early", evidence=""),
       dict(key="c", claim="early too", status="refuted", chapter="early", evidence="#y")]
toy_labels = {"early": "1 Early", "late": "2 Late"}
test_eq(list(_by_chapter(toy, toy_labels)), ["early", "late"])
test_eq(status_table(toy, toy_labels).splitlines()[-1], "| **all chapters** | **1** | **1** | **0** | **1** | **3** |")
test_eq(status_table(toy, toy_labels).splitlines()[2], "| [1 Early](early.html) | 1 | 0 | 0 | 1 | 2 |")
assert "late \\|v\\|" in claims_table(toy, toy_labels) and ledger(toy, toy_labels).index("1 Early") < ledger(toy, toy_labels).index("2 Late")
assert "([check](early.html#y))" in ledger(toy, toy_labels) and "early.html)" in ledger(toy, toy_labels)
test_fail(lambda: ledger("abc", toy_labels), contains="`claims` must be a list of claim records")
test_fail(lambda: status_table([dict(claim="x")], toy_labels), contains="`claims` must be a list of claim records")
test_fail(lambda: claims_table(toy, ["early"]), contains="`labels` must be a dict")

# %% [markdown]
# On the book's records: every claim has a known status and a chapter of the book, and every chapter that records
# claims appears in the ledger.

# %%
assert claims and all(c["status"] in STATUSES for c in claims), {c["status"] for c in claims}
assert {c["chapter"] for c in claims} <= set(labels), {c["chapter"] for c in claims} - set(labels)
test_eq(ledger(claims, labels).count("\n- **"), len(claims))

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
