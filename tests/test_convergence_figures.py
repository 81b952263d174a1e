"""Chapters 5, 5a and 5b: each figure carries one message with a numbered caption and alt text (issue 23), the
span condition of Proposition 5.2 reaches where the diagonal one fails, and the chapters' modules stay small
(issue 22). Seeds from 90_000 on: the book does not show them."""
import json
import re
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import numpy as np
import pytest
import torch
import ictd.convergence as theory
import ictd.experiments.convergence as experiments
import ictd.experiments.worst_cases as worst_cases
from ictd.convergence import rate_bound, span_rate, spectral_radius
from ictd.experiments.convergence import depth_experiment, phase_diagram, plot_floor, plot_phase

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_phase_figure_is_one_panel_with_visible_condition_lines():
    "Experiment 4's figure: one panel, not a grid; the condition lines carry markers and the frame leaves room above 1 and below 0."
    ph = phase_diagram(8, seed=90_000, betas=[0.3, 3., 30.], gammas=(0.9,))
    fig = plot_phase(ph, "unit", 0.9)
    (ax,) = fig.axes
    lo, hi = ax.get_ylim()
    assert lo < 0 and hi > 1
    assert len(ax.get_lines()) == 3 and all(l.get_marker() not in (None, "None", "") for l in ax.get_lines())
    with pytest.raises(ValueError, match="`feature` and `gamma` must be among"):
        plot_phase(ph, "unit", 0.5)


@pytest.mark.unit
def test_floor_figures_one_message_each():
    "Experiment 2's two messages are two figures of one panel each."
    sweep = depth_experiment(6, ns=(30, 100), n_layers=5, seed=90_000)
    assert [len(plot_floor(sweep, kind).axes) for kind in ("length", "bound")] == [1, 1]
    with pytest.raises(ValueError, match="`kind` must be 'length' or 'bound'"):
        plot_floor(sweep, "both")


@pytest.mark.unit
def test_span_condition_reaches_where_the_diagonal_one_fails():
    "Proposition 5.2: sc(B) < 1 implies convergence (spectral radius below one), and it holds on pairs where the diagonal condition fails."
    gen = np.random.default_rng(90_000)
    M = torch.from_numpy(gen.dirichlet(np.ones(5), (400, 5)) * 0.5 + 0.5 * np.eye(5))        # diagonal at least 1/2
    P = torch.from_numpy(gen.dirichlet(np.ones(5), (400, 5)))
    alpha, gamma = torch.from_numpy(gen.uniform(0.2, 1, 400)), 0.9
    span, diag, radius = span_rate(M, P, gamma=gamma, alpha=alpha), rate_bound(M, gamma=gamma, alpha=alpha), spectral_radius(M, P, gamma=gamma, alpha=alpha)
    assert (radius[span < 1] < 1).all()
    assert ((span < 1) & (diag >= 1)).sum() >= 40, int(((span < 1) & (diag >= 1)).sum())
    M_ex, P_ex = torch.tensor([[0.8, 0.2], [0.2, 0.8]], dtype=torch.float64), torch.full((2, 2), 0.5, dtype=torch.float64)
    torch.testing.assert_close(span_rate(M_ex, P_ex, gamma=0.9, alpha=1.), torch.tensor(0.4, dtype=torch.float64), rtol=0, atol=1e-15)
    assert rate_bound(M_ex, gamma=0.9, alpha=1.) > 1                                                        # the chapter's worked example


@pytest.mark.unit
def test_chapter_five_modules_stay_small_and_layered():
    "Modules of about 400 lines (issue 22); the theory imports no experiment; no experiment imports a private name of another module."
    import ast
    for mod in (theory, experiments, worst_cases):
        assert len(Path(mod.__file__).read_text().splitlines()) <= 420, mod.__name__
    def imported(mod):
        tree = ast.parse(Path(mod.__file__).read_text())
        return [(n.module or '', a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert not [m for m, _ in imported(theory) if 'experiments' in m]
    assert not [a for mod in (experiments, worst_cases) for m, a in imported(mod) if a.startswith('_') and m != '__future__']


@pytest.mark.book
@pytest.mark.parametrize("name, chapter", [("05_convergence.ipynb", "5"), ("05a_convergence_experiments.ipynb", "5a"),
                                           ("05b_worst_cases.ipynb", "5b")])
def test_every_figure_is_numbered_captioned_and_described(name, chapter):
    "Each cell that draws a figure starts with a fig-cap 'Figure <chapter>.<k>: ...' (k = 1, 2, ... in order) and a fig-alt; one image per cell."
    nb = json.loads((ROOT / "nbs" / name).read_text())
    numbers = []
    for c in nb["cells"]:
        images = [o for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        if not images: continue
        src = "".join(c["source"])
        assert len(images) == 1, src[:120]
        cap = re.search(r'^#\| fig-cap: "Figure (\w+)\.(\d+): [^"]+"$', src, re.M)
        assert cap and cap.group(1) == chapter and re.search(r'^#\| fig-alt: "[^"]{20,}"$', src, re.M), src[:200]
        numbers.append(int(cap.group(2)))
    assert numbers == list(range(1, len(numbers) + 1)), numbers
