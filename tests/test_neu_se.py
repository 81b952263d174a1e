"""The jackknife standard error of the unbiased NEU estimate (chapter 6's `neu(..., with_se=True)`), on fresh seeds.

If the standard error were mis-scaled (no (K-1)/K factor, the spread of leave-one-out values without sqrt(K - 1),
or the plug-in estimate in place of the pairwise one), its average over repetitions would not match the spread of
the estimates themselves."""
import math
import pytest
import torch
from ictd.model import SoftmaxICTD
from ictd.pretrain import neu, pairwise_neu
from ictd.tasks import random_tasks

@pytest.mark.claims
def test_neu_with_se_matches_the_spread_of_repeated_estimates():
    torch.set_num_threads(1)
    model, tasks = SoftmaxICTD(3, n_layers=1, init_gain=1., seed=11), random_tasks(32, seed=12, d=3)
    reps = torch.tensor([neu(model, tasks, 5, n_batches=8, batch_size=16, seed=1000 + k, with_se=True) for k in range(120)], dtype=torch.float64)
    est, se = reps.T
    assert est[0].item() == neu(model, tasks, 5, n_batches=8, batch_size=16, seed=1000)   # the estimate does not change with `with_se`
    ratio = se.mean() / est.std()
    assert 0.8 < ratio < 1.25, (ratio, est.std(), se.mean())   # 0.97 measured; the std of 120 estimates is known to about 7%

@pytest.mark.unit
def test_pairwise_neu_checks_its_input():
    with pytest.raises(ValueError, match="`g` must be"): pairwise_neu(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="`n_batches` must be"): neu(SoftmaxICTD(3, n_layers=1, seed=0), random_tasks(4, seed=0, d=3), 5, n_batches=2, with_se=True)
