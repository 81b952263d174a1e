"""Tests of what the learner's path (issue 23) added to chapters 1-4a.

- the bridge box of chapter 2: torch's row-token attention equals the book's column form with
  A = W_K^T W_Q / sqrt(d_k) (and not with its transpose), on seeds the book does not show;
- the one implementation left of each former duplicate: `weighted_softmax_td(centred=True)` and
  `batch_linear_td(C=..., centred=...)` against direct loops over the definitions;
- the claim records of chapters 1-4a: known statuses, and every evidence anchor is a heading of its chapter."""
import json, math, re
from pathlib import Path
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from ictd.wstd import weighted_softmax_td, batch_linear_td, context_weights
from ictd.core import CLAIM_STATUSES

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = settings(max_examples=25, deadline=None)

def column_attention(Z, W_Q, W_K, W_V, n_keys):
    "The book's column form: W_V Z S with S[i, j] = softmax over keys i of z_i^T A z_j, A = W_K^T W_Q / sqrt(d_k)."
    A = W_K.T @ W_Q / math.sqrt(W_Q.shape[0])
    mask = torch.where(torch.arange(Z.shape[1]) < n_keys, 0., -math.inf).double()
    return W_V @ Z @ torch.softmax(Z.T @ A @ Z + mask[:, None], dim=0)

@pytest.mark.unit
@SETTINGS
@given(seed=st.integers(100, 2**31), D=st.integers(2, 8), m=st.integers(2, 12), d_k=st.integers(1, 5), data=st.data())
def test_bridge_row_attention_is_column_form(seed, D, m, d_k, data):
    "softmax(Q K^T / sqrt(d_k)) V with tokens as rows, transposed, is W_V Z S with A = W_K^T W_Q / sqrt(d_k)."
    n_keys = data.draw(st.integers(1, m))
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(D, m, generator=g, dtype=torch.float64)
    W_Q, W_K = (torch.randn(d_k, D, generator=g, dtype=torch.float64) for _ in range(2))
    W_V = torch.randn(D, D, generator=g, dtype=torch.float64)
    key_mask = torch.zeros(m, m, dtype=torch.float64)
    key_mask[:, n_keys:] = -math.inf
    H = Z.T
    rows = torch.nn.functional.scaled_dot_product_attention(H @ W_Q.T, H @ W_K.T, H @ W_V.T, attn_mask=key_mask)
    assert (rows.T - column_attention(Z, W_Q, W_K, W_V, n_keys)).abs().max() < 1e-12

@pytest.mark.unit
def test_bridge_transpose_is_a_different_attention():
    "The order matters: A = W_Q^T W_K (the transpose) gives another attention on a generic example."
    g = torch.Generator().manual_seed(7)
    Z = torch.randn(5, 9, generator=g, dtype=torch.float64)
    W_Q, W_K = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(2))
    W_V = torch.eye(5, dtype=torch.float64)
    right = column_attention(Z, W_Q, W_K, W_V, 6)
    swapped = column_attention(Z, W_K, W_Q, W_V, 6)                     # A = W_Q^T W_K / sqrt(d_k)
    assert (right - swapped).abs().max() > 1e-2

def loops_centred(phi, R, W, alpha, gamma, T):
    "Centred weighted softmax TD at the trajectory states as loops: v(x) += alpha sum_k (K_k(x) - 1/n) delta_k."
    n, v = len(R), np.zeros(len(phi))
    for _ in range(T):
        delta = [R[k] + gamma * v[k + 1] - v[k] for k in range(n)]
        new = v.copy()
        for j in range(len(phi)):
            e = [math.exp(phi[k] @ W @ phi[j]) for k in range(n)]
            new[j] += alpha * sum((e[k] / sum(e) - 1 / n) * delta[k] for k in range(n))
        v = new
    return v

@pytest.mark.unit
@SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), d=st.integers(1, 4), gamma=st.floats(0, 0.95))
def test_centred_wstd_matches_loops(seed, n, d, gamma):
    "`weighted_softmax_td(centred=True)` is the centred update written out, not the plain one."
    rng = np.random.default_rng(seed)
    phi, R, W = rng.uniform(-1, 1, (n + 1, d)), rng.uniform(-1, 1, n), rng.normal(size=(d, d))
    got = weighted_softmax_td(phi, R, W, alpha=0.4, gamma=gamma, n_iters=8, centred=True).numpy()
    assert np.abs(got - loops_centred(phi, R, W, 0.4, gamma, 8)).max() < 1e-12

def loops_linear(phi, R, alpha, gamma, T, C, centred):
    "Batch linear TD with preconditioner C and optionally centred key features, as loops over transitions."
    n, d = len(R), phi.shape[1]
    mean = phi[:-1].mean(0) if centred else np.zeros(d)
    w = np.zeros(d)
    for _ in range(T):
        step = sum((R[k] + gamma * phi[k + 1] @ w - phi[k] @ w) * (phi[k] - mean) for k in range(n))
        w = w + alpha / n * C @ step
    return phi @ w

@pytest.mark.unit
@SETTINGS
@given(seed=st.integers(0, 2**31), n=st.integers(1, 15), d=st.integers(1, 4), gamma=st.floats(0, 0.95), centred=st.booleans())
def test_preconditioned_linear_td_matches_loops(seed, n, d, gamma, centred):
    "`batch_linear_td(C=..., centred=...)` is the preconditioned (centred) update written out."
    rng = np.random.default_rng(seed)
    phi, R, C = rng.uniform(-1, 1, (n + 1, d)), rng.uniform(-1, 1, n), rng.normal(scale=0.5, size=(d, d))
    got = batch_linear_td(phi, R, alpha=0.3, gamma=gamma, n_iters=10, C=C, centred=centred).numpy()
    want = loops_linear(phi, R, 0.3, gamma, 10, C, centred)
    assert np.abs(got - want).max() < 1e-10 * max(1., np.abs(want).max())

def slug(heading):
    "Pandoc's identifier of a heading: its attributes (`{.deep-dive}`), maths and punctuation dropped, lowercase, spaces to hyphens."
    text = re.sub(r"[\\$^*{}]", "", re.sub(r"\s*\{[.#][^}]*\}\s*$", "", heading)).lower()
    return re.sub(r"\s+", "-", re.sub(r"[^a-z0-9 _.-]", "", text).strip())

@pytest.mark.book
@pytest.mark.parametrize("nb", ["01_weighted_softmax_td", "02_prompt", "03_dual_head", "04_tsm", "04a_causal"])
def test_claim_records_point_at_headings(nb):
    "Each claim of the chapter has a known status, names the chapter, and its evidence anchor is one of the chapter's headings."
    page = nb.split("_", 1)[1]
    records = json.loads((ROOT / "nbs" / "data" / "claims" / f"{page}.json").read_text())
    assert records, f"{page}: no claims recorded"
    cells = json.loads((ROOT / "nbs" / f"{nb}.ipynb").read_text())["cells"]
    anchors = {"#" + slug(line.lstrip("#").strip()) for c in cells if c["cell_type"] == "markdown"
               for line in "".join(c["source"]).splitlines() if re.match(r"#{2,4} ", line)}
    for key, r in records.items():
        assert r["status"] in CLAIM_STATUSES and r["chapter"] == page, (key, r)
        assert r["evidence"] in anchors, f"{page}/{key}: {r['evidence']} is not a heading of the chapter"
