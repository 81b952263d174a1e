"""Chapter 7a's side-by-sides on chains the book does not show: the one-hot and random-feature chains of one seed are
one Markov reward process with one context, and with each method tuned, softmax in-context TD is ahead of linear on
one-hot features (on most chains, by a median factor above 1) and the query-normalised ablation's optimum is inside its grid."""
import pytest
import torch
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.experiments.linear import TUNING_GRIDS, tuned_side_by_side
from ictd.tasks import random_tasks, sample_trajectories

@pytest.mark.unit
def test_one_hot_and_random_chains_of_one_seed_share_p_r_and_context():
    for seed in (123, 4567):
        one, rnd = random_boyan_chain(features="onehot", seed=seed), random_boyan_chain(features="random", seed=seed)
        for k in ("P", "r", "d_pi", "v_pi"): assert torch.equal(getattr(one, k), getattr(rnd, k)), k
        for a, b in zip(sample_trajectory(one, n=50, seed=seed), sample_trajectory(rnd, n=50, seed=seed)): assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    one, rnd = random_tasks(8, seed=999, features="onehot"), random_tasks(8, seed=999, features="random")
    assert torch.equal(one.P, rnd.P) and torch.equal(one.r, rnd.r) and not torch.equal(one.phi[..., :4], rnd.phi)
    assert torch.equal(sample_trajectories(one.P, one.d_pi, n=40, seed=5), sample_trajectories(rnd.P, rnd.d_pi, n=40, seed=5))

@pytest.mark.claims
def test_tuned_softmax_ahead_of_linear_on_one_hot():
    torch.set_num_threads(1)
    res = tuned_side_by_side("onehot", n_tasks=60, seed=3000)
    for m, grid in TUNING_GRIDS.items():
        assert all(min(grid[k]) < v < max(grid[k]) for k, v in res[m]["params"].items()), (m, res[m]["params"])
    lin, soft, abl = (res[m]["curves"][:, -1] for m in TUNING_GRIDS)
    assert (soft < lin).sum() >= 36 and (lin / soft).median() > 1, ((soft < lin).sum(), (lin / soft).median())
    assert (lin / soft).median() < 10, (lin / soft).median()   # a modest factor on one-hot features, not random features' order of magnitude
    assert (soft < abl).sum() >= 51 and (lin < abl).sum() >= 51, ((soft < abl).sum(), (lin < abl).sum())

@pytest.mark.unit
def test_side_by_side_bands_are_distinguishable():
    "Each method of the side-by-side figures has its own colour and its own line style, and its band is light (alpha <= 0.25), so overlapping bands do not blend into one."
    import matplotlib
    matplotlib.use("Agg")
    from ictd.experiments.linear import plot_side_by_side, plot_tuned_side_by_side
    curves = {f"method {i}": torch.rand(5, 4, generator=torch.Generator().manual_seed(i), dtype=torch.float64) + 0.1 for i in range(3)}
    tuned = {"one-hot": {k: dict(curves=v) for k, v in curves.items()}}
    for fig in (plot_side_by_side(curves, n=10), plot_tuned_side_by_side(tuned, n=10)):
        ax = fig.axes[0]
        mids = [l for l in ax.get_lines() if l.get_label() in curves]
        assert len(mids) == 3 and len({l.get_color() for l in mids}) == 3 and len({l.get_linestyle() for l in mids}) == 3
        assert ax.collections and all(p.get_alpha() <= 0.25 for p in ax.collections)
