"""Chapter 6b's convergence rule, finite-context Jacobian and iterated shared layer: unit checks, and the dynamics claim
rerun on contexts the book does not show (seed 7 of the context draws; the book uses seed 0)."""
import copy, dataclasses
import pytest, torch
from ictd.engine import EMERGENCE, get_family
from ictd.tasks import random_tasks, sample_trajectories
from ictd.model import SoftmaxICTD
from ictd.state_tokens import model_params, population_predict
from ictd.convergence import td_recursion
from ictd.emergence import context_update, held_out_prompts
from ictd.mechanism import jacobian_spectrum, learned_kernel, sampled_jacobians, shared_recursion, update_jacobian
from ictd.experiments.mechanism import moved_by, settled_step, star_points

STEPS = list(range(0, 6001, 250))

def _decay(tau, drift=0.):
    t = torch.tensor(STEPS, dtype=torch.float64)
    x = torch.linspace(0, 1, 10, dtype=torch.float64)[:, None, None] + torch.exp(-t / tau)[None, :, None] + drift * t[None, :, None]
    return dict(msve=x, diagonality=x.expand(-1, -1, 3), value_weights=torch.zeros(10, len(STEPS), 3, dtype=torch.float64))

@pytest.mark.unit
def test_settled_step_fires_after_the_decay_and_never_on_a_drift():
    "Catches a stopping rule that stops on a metric still moving, or never stops on one that has settled."
    assert settled_step(_decay(400.), STEPS, 1000) == 3000            # |change| = (e^2.5 - 1) e^(-t/400) < 0.01 from t = 400 ln(1118) = 2808
    assert settled_step(_decay(400., drift=3e-5), STEPS, 1000) is None
    noisy = _decay(1.)
    noisy["msve"] = noisy["msve"] + 0.05 * torch.randn(10, len(STEPS), 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert settled_step(noisy, STEPS, 1000) is None                    # seed noise of 0.05 > tolerance 0.01: never "still"
    with pytest.raises(ValueError, match="at least 2 seeds"): moved_by(torch.zeros(1, 5, 1), 1)

@pytest.mark.unit
def test_update_jacobian_at_contexts_is_the_derivative_of_the_context_update():
    "Catches a finite-n Jacobian that is not the derivative of the expected update it is reported for."
    t = random_tasks(2, seed=4, d=2)
    m = SoftmaxICTD(2, 1, init_gain=0.5, seed=3)
    st = sample_trajectories(t.P, 6, t.d_pi, seed=1)
    g, J = update_jacobian(m, t, st)
    assert torch.allclose(g.norm(), context_update(m, t, st).norm(), atol=1e-12)
    flat = torch.cat([v.flatten() for v in model_params(m).values()])
    def at(x):
        mm, p0 = copy.deepcopy(m), model_params(m)
        parts = dict(zip(p0, torch.split(x, [v.numel() for v in p0.values()])))
        with torch.no_grad():
            for l, lay in enumerate(mm.layers):
                for k, q in parts.items(): getattr(lay, k).copy_(q.reshape(p0[k].shape)[0, l])
        return update_jacobian(mm, t, st)[0]
    for j in (5, 40):
        e = torch.zeros_like(flat); e[j] = 1e-6
        assert torch.allclose(J[:, j], (at(flat + e) - at(flat - e)) / 2e-6, atol=1e-6)

@pytest.mark.unit
def test_shared_recursion_of_theta_star_is_chapter_5s_and_the_models():
    "Catches a prediction for the iterated layer that is not chapter 5's recursion, or a population iterate that differs from it."
    m = SoftmaxICTD.from_theta_star(4, 1, 3. * torch.eye(4, dtype=torch.float64), 0.5, 0.8, shared=True)
    t = random_tasks(4, seed=21, gamma=0.8)
    rec = shared_recursion(m, t, 5)
    assert torch.allclose(rec, td_recursion(learned_kernel(m, t)[0], t.P, t.r, gamma=0.8, alpha=0.5, n_iters=5).movedim(-2, 0), atol=1e-12)
    m5 = get_family("softmax").module(dataclasses.replace(EMERGENCE, n_layers=5, shared=True, gamma=0.8), {k: v[0] for k, v in model_params(m).items()})
    assert torch.allclose(population_predict(m5, t), rec[5], atol=1e-12)

@pytest.mark.claims
def test_theta_star_is_unstable_at_the_training_context_on_fresh_contexts():
    "Catches 'theta* is an attractor of the mean TD dynamics at n = 30' (the book's primary dynamics claim), on other contexts."
    tasks = held_out_prompts(dataclasses.replace(EMERGENCE, seed=2000))[0]
    (beta, alpha) = star_points()["theta* (beta 1, alpha 1)"]
    m = SoftmaxICTD.from_theta_star(4, 3, beta * torch.eye(4, dtype=torch.float64), alpha, 0.9)
    r = jacobian_spectrum(*sampled_jacobians(m, tasks, 30, n_batches=4, batch_size=6, seed=7))
    assert r["max_real"] > 2 * r["max_real_se"] and r["neu"] > 2 * r["neu_se"], r
