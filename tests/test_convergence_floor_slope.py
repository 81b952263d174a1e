"""Chapter 5a's floor-slope claim (Experiment 2) on tasks the book does not show: the floor on key states falls close to
n^{-1/2}, with -1/2 inside the bootstrap interval from n = 100 on, and the mean floor falls faster than n^{-1/2}."""
import pytest
import torch
from ictd.experiments.convergence import depth_experiment, slope_interval

NS = [30, 100, 300, 1000, 3000]

@pytest.fixture(scope="module")
def sweep():
    torch.set_num_threads(1)
    return depth_experiment(200, beta=15., alpha=1., ns=NS, n_layers=20, seed=70_000)

@pytest.mark.claims
def test_key_floor_slope_is_close_to_minus_one_half(sweep):
    _, lo, hi = slope_interval(NS, sweep["key_floors"], seed=3)
    assert -0.6 < lo and hi < -0.4, (lo, hi)                        # a slope of -1/4 or -1 would fail
    _, lo, hi = slope_interval(NS[1:], sweep["key_floors"][:, 1:], seed=3)
    assert lo < -0.5 < hi, (lo, hi)

@pytest.mark.claims
def test_mean_floor_falls_faster_than_minus_one_half(sweep):
    _, lo, hi = slope_interval(NS, sweep["floors"], seed=3)
    assert hi < -0.5, (lo, hi)
