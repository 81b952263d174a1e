"""Chapter 6d (stationary points of pretraining): its three propositions on random inputs the book does not show,
the finite-difference Jacobian against the exact one, and the saved zeros of the mean update recomputed from their
parameters."""
import json
import pytest, torch
from conftest import ROOT
from ictd.core import TaskBatch
from ictd.model import SoftmaxICTD
from ictd.tasks import random_tasks
from ictd.state_tokens import population_predict, token_layer
from ictd.mechanism import update_jacobian
from ictd.experiments.stationary import (_population, layer_stack, level_td_stack, mean_updates, polish, spectrum_summary,
                                          study_tasks, update_jacobian_fd, update_norm, warm_td_values)
from ictd.state_tokens import population_neu

SAVED = ROOT / "nbs" / "data" / "stationary_points.json"

def _model(p):
    m = SoftmaxICTD(p.shape[-1] - 2, n_layers=p.shape[0], seed=0)
    with torch.no_grad():
        for l, lay in enumerate(m.layers):
            for i, k in enumerate(("A", "V_cur", "V_tgt")): getattr(lay, k).copy_(p[l, i])
    return m

@pytest.mark.unit
@pytest.mark.parametrize("seed", [101, 102, 103])
def test_a_uniform_layer_writes_one_vector_to_every_column(seed):
    "Proposition 6d.1 on random tasks (7 states, d = 3, random features), random tokens and random heads: catches a uniform write that depends on the column or on V_cur and V_tgt apart."
    g = torch.Generator().manual_seed(seed)
    tasks = random_tasks(5, seed=seed, n_states=7, d=3)
    one, x = _population(tasks, 1)
    first, heads = torch.randn(3, 5, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, 5, generator=g, dtype=torch.float64)
    Z1 = token_layer(x.Z, *(h[None] for h in first), x)[0]
    Z2 = token_layer(Z1, torch.zeros(1, 5, 5, dtype=torch.float64), heads[0][None], heads[1][None], x)[0]
    z_bar = (Z1[..., :7] * one.d_pi[:, :, None, :]).sum(-1)
    assert (Z2 - Z1 - (heads[0] + heads[1]) @ z_bar[..., None]).abs().max() < 1e-12
    # the sum is what matters: moving weight between the two heads leaves the write unchanged
    Z3 = token_layer(Z1, torch.zeros(1, 5, 5, dtype=torch.float64), (heads[0] + heads[1])[None], torch.zeros(1, 5, 5, dtype=torch.float64), x)[0]
    assert (Z3 - Z2).abs().max() < 1e-12

@pytest.mark.unit
@pytest.mark.parametrize("L, level, beta, alpha", [(2, 0.7, 2., 1.), (4, 1.2, 8., 0.6)])
def test_level_layer_then_theta_star_is_warm_started_td(L, level, beta, alpha):
    "Proposition 6d.2 on one-hot tasks the book does not draw: catches a level that reaches keys and queries differently."
    tasks = random_tasks(6, seed=77, features="onehot")
    v = population_predict(_model(level_td_stack(10, L, level, beta, alpha, tasks.gamma)), tasks).detach()
    assert (v - warm_td_values(tasks, L, level, beta, alpha)).abs().max() < 1e-12
    assert (v - warm_td_values(tasks, L, 0., beta, alpha)).abs().max() > 1e-3     # the level matters

@pytest.mark.unit
@pytest.mark.parametrize("features, L", [("onehot", 2), ("random", 4)])
def test_the_update_at_zero_moves_only_value_rows_and_the_same_in_every_layer(features, L):
    "Proposition 6d.3: catches any update at zero on A or on rows other than the value row, or one that differs between layers."
    tasks = random_tasks(9, seed=55, features=features, **({} if features == "onehot" else dict(d=3)))
    D = tasks.phi.shape[-1] + 2
    U = mean_updates(torch.zeros(L, 3, D, D, dtype=torch.float64), tasks)
    r_bar = (tasks.d_pi * tasks.r).sum(-1)
    z_bar = torch.cat([(tasks.d_pi[..., None] * tasks.phi).sum(-2), r_bar[:, None], torch.zeros_like(r_bar)[:, None]], -1)
    expect = torch.zeros_like(U)
    expect[:, 1:, -1] = (r_bar[:, None] * z_bar).mean(0)
    assert (U - expect).abs().max() < 1e-14 and expect.abs().max() > 1e-2

@pytest.mark.unit
def test_mean_update_is_the_gradient_of_population_neu_and_its_jacobian_is_exact():
    "Catches a mean update or finite-difference Jacobian that is not the one chapters 6 and 6b define."
    tasks = random_tasks(3, seed=8, n_states=3, features="onehot")
    m = SoftmaxICTD(3, n_layers=2, init_gain=0.7, seed=9)
    p = layer_stack(m)
    assert abs(update_norm(p, tasks) ** 2 - population_neu(m, tasks)) < 1e-13
    g, J = update_jacobian(m, tasks)
    order = torch.arange(p.numel()).reshape(p.shape[0], 3, 5, 5).permute(1, 0, 2, 3).flatten()
    assert (mean_updates(p, tasks).flatten()[order] - g).abs().max() < 1e-14
    assert (update_jacobian_fd(p, tasks)[order][:, order] - J).abs().max() < 1e-8

def _saved():
    if not SAVED.exists(): pytest.skip("no saved study")
    return json.loads(SAVED.read_text())

@pytest.mark.claims
def test_saved_zeros_are_zeros_of_the_mean_update_and_predict_nothing():
    "Recomputes the norm of the mean update at every saved zero from its parameters: catches a zero that is not one (below 1e-10), a search whose saved history is not what its parameters give, and a zero that is one for other tasks too (the page says it is not)."
    study, tasks = _saved(), study_tasks("onehot")
    fresh = random_tasks(128, seed=4242, features="onehot")      # tasks neither the study nor the book draws
    zeros = [r for r in study["searches"] if r["converged"]]
    assert zeros
    for r in study["searches"]:
        p = torch.tensor(r["params"], dtype=torch.float64)
        norm = update_norm(p, tasks)
        assert abs(norm - r["history"][-1]) <= 1e-6 * r["history"][-1] + 1e-12, (r["name"], norm, r["history"][-1])
        if r["converged"]:
            assert norm < 1e-10, (r["name"], norm)
            assert population_predict(_model(p), tasks).abs().max() < 1e-6
            assert update_norm(p, fresh) > 1e-3, (r["name"], "a zero of the batch is not one on other tasks")
        else:
            assert norm >= 1e-10, (r["name"], norm)     # a search reported as not converged did not reach the tolerance

@pytest.mark.claims
def test_a_saved_zero_at_two_layers_is_a_saddle():
    "Recomputes the Jacobian at the first saved two-layer zero (a few seconds): catches a verdict or counts the spectrum does not give."
    study, tasks = _saved(), study_tasks("onehot")
    r = next(r for r in study["searches"] if r["converged"] and r["n_layers"] == 2)
    spec = spectrum_summary(update_jacobian_fd(torch.tensor(r["params"], dtype=torch.float64), tasks))
    assert spec["verdict"] == r["spectrum"]["verdict"] == "saddle"
    assert spec["n_positive"] >= 1 and abs(spec["max_real"] - r["spectrum"]["max_real"]) < 1e-6

@pytest.mark.unit
def test_polish_reaches_a_zero_from_a_small_init_on_a_small_problem():
    "Catches a search that stops short of the tolerance or reports a norm the point does not have."
    tasks = random_tasks(4, seed=13, n_states=4, features="onehot")
    p, hist = polish(layer_stack(SoftmaxICTD(4, n_layers=2, init_gain=0.1, seed=21)), tasks, max_jacobians=10)
    assert hist[-1] < 1e-10 and update_norm(p, tasks) < 1e-10

@pytest.mark.unit
def test_bad_input_names_the_argument():
    tasks = study_tasks("onehot", n_tasks=2)
    with pytest.raises(ValueError, match="`p` must be"): mean_updates(torch.zeros(1, 3, 4, 4, dtype=torch.float64), tasks)
    with pytest.raises(TypeError, match="`tasks`"): mean_updates(torch.zeros(1, 3, 12, 12, dtype=torch.float64), "tasks")
    with pytest.raises(ValueError, match="`features`"): study_tasks("unit")
    with pytest.raises(ValueError, match="`model`"): layer_stack(SoftmaxICTD(4, n_layers=2, shared=True, seed=0))
    with pytest.raises(ValueError, match="`tol`"): polish(torch.zeros(1, 3, 12, 12, dtype=torch.float64), tasks, tol=0.)

@pytest.mark.claims
def test_a_larger_batch_gives_a_zero_closer_to_one_for_other_tasks():
    "Recomputes the saved batch-size check from its parameters: catches zeros that are not zeros of their batch, and a fresh-task norm that does not fall with the batch (on tasks neither the page nor the study draws)."
    path = ROOT / "nbs" / "data" / "stationary_batch.json"
    if not path.exists(): pytest.skip("no saved batch check")
    bs = json.loads(path.read_text())["searches"]
    other = random_tasks(256, seed=31337, features="onehot")
    norms = []
    for r in bs:
        p = torch.tensor(r["params"], dtype=torch.float64)
        assert update_norm(p, study_tasks("onehot", n_tasks=r["n_tasks"])) < 1e-10
        norms.append(update_norm(p, other))
    assert norms[-1] < norms[0] / 2, norms
