"""The seed-stacked forward pass on state tokens (chapter 3a, `ictd.state_tokens`), on seeds and shapes the book does not show."""
import pytest, torch
from ictd.convergence import td_recursion
from ictd.core import TaskBatch
from ictd.model import SoftmaxICTD
from ictd.prompt import build_prompt
from ictd.state_tokens import (model_params, population_neu, population_predict, population_tokens, state_tokens, token_layers,
                               token_predict, trajectory_tokens)
from ictd.tasks import random_tasks, sample_trajectories, stationary_examples, task_features

torch.set_num_threads(1)

def examples(seed:int, n_states:int, d:int, n:int, B:int=6):
    "A pool of one seed, stationary examples with two queries (x_q, x_q'), and their full prompts."
    pool = TaskBatch.stack([random_tasks(5, seed=seed, n_states=n_states, d=d)])
    ex = stationary_examples(pool, torch.rand(1, B, n + 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    pairs = torch.stack([ex.query, ex.successor], -1)
    (phi_s, r_s), phi_q = task_features(pool, ex.task, ex.states), task_features(pool, ex.task, pairs)[0]
    return pool, ex, pairs, build_prompt(phi_s[0], r_s[0, :, :-1], phi_q[0])

@pytest.mark.unit
@pytest.mark.parametrize('seed,n_states,d,n,shared', [(101, 10, 4, 30, False), (102, 6, 3, 5, True), (103, 12, 2, 80, False), (104, 5, 5, 1, True)])
def test_state_tokens_equal_the_full_forward(seed, n_states, d, n, shared):
    "Values at the queries and every layer's query columns equal chapter 3's forward pass (a wrong count, successor or bias would not)."
    pool, ex, pairs, Z = examples(seed, n_states, d, n)
    model = SoftmaxICTD(d, n_layers=3, shared=shared, init_gain=1., seed=seed)
    x = state_tokens(pool, ex.task, ex.states, pairs)
    with torch.no_grad():
        torch.testing.assert_close(token_predict(model_params(model), 3, x)[0], model.predict(Z, n=n), atol=1e-12, rtol=0)
        Zs, full = token_layers(model_params(model), 3, x)[0], model(Z, n=n, return_all=True)
        for l in range(4): torch.testing.assert_close(Zs[l][0][..., -2:], full[:, l][..., -2:], atol=1e-12, rtol=0)

@pytest.mark.unit
def test_seeds_stacked_equal_each_alone():
    "Three seeds' parameters and prompts through one pass give each seed's own values (a pass that mixed seeds would not)."
    models = [SoftmaxICTD(3, n_layers=2, init_gain=1., seed=s) for s in (201, 202, 203)]
    tasks = [examples(s, 7, 3, 20) for s in (211, 212, 213)]
    xs = [state_tokens(pool, ex.task, ex.states, pairs) for pool, ex, pairs, _ in tasks]
    params = {k: torch.cat([model_params(m)[k] for m in models]) for k in ("A", "V_cur", "V_tgt")}
    stacked = type(xs[0])(*(torch.cat([getattr(x, f) for x in xs]) for f in ("Z", "log_w", "succ")), xs[0].q)
    with torch.no_grad():
        together = token_predict(params, 2, stacked)
        for i, (m, (_, _, _, Z)) in enumerate(zip(models, tasks)):
            torch.testing.assert_close(together[i], m.predict(Z, n=20), atol=1e-12, rtol=0)

@pytest.mark.unit
def test_trajectory_tokens_equal_the_full_forward():
    "Every context column its own key: the same values as the full prompt, also for continuous-valued features."
    g = torch.Generator().manual_seed(301)
    phi, r, phi_q = torch.randn(4, 16, 3, generator=g, dtype=torch.float64), torch.randn(4, 15, generator=g, dtype=torch.float64), torch.randn(4, 2, 3, generator=g, dtype=torch.float64)
    model = SoftmaxICTD(3, n_layers=3, init_gain=1., seed=302)
    x = trajectory_tokens(phi[None], r[None], phi_q[None])
    with torch.no_grad():
        torch.testing.assert_close(token_predict(model_params(model), 3, x)[0], model.predict(build_prompt(phi, r, phi_q), n=15), atol=1e-12, rtol=0)

@pytest.mark.unit
def test_population_predict_of_theta_star_is_the_population_recursion():
    "With theta* the n = infinity forward pass is v_{l+1} = v_l + alpha M_pi (r + gamma P v_l - v_l), exactly."
    tasks = random_tasks(16, seed=401, features="onehot")
    W = 6. * torch.eye(10, dtype=torch.float64)
    M_pi = torch.softmax(tasks.phi @ W @ tasks.phi.mT + tasks.d_pi.log()[:, None, :], dim=-1)
    rec = td_recursion(M_pi, tasks.P, tasks.r, gamma=tasks.gamma, alpha=0.7, n_iters=9)[..., -1, :]
    model = SoftmaxICTD.from_theta_star(10, W, n_layers=9, alpha=0.7, gamma=tasks.gamma)
    with torch.no_grad(): torch.testing.assert_close(population_predict(model, tasks), rec, atol=1e-12, rtol=0)

@pytest.mark.unit
def test_population_predict_is_the_limit_of_long_contexts():
    "The gap to a finite stationary context falls about like n^(-1/2) (a wrong limit would leave a gap that stays)."
    model, tasks = SoftmaxICTD(4, n_layers=2, init_gain=1., seed=501), random_tasks(3, seed=502)
    pool, which, every = TaskBatch.stack([tasks]), torch.arange(3)[None], torch.arange(10).expand(1, 3, 10)
    with torch.no_grad():
        limit = population_predict(model, tasks)
        def gap(n):
            return torch.tensor([(token_predict(model_params(model), 2, state_tokens(pool, which, sample_trajectories(tasks.P, tasks.d_pi, n=n, seed=k)[None], every))[0]
                                  - limit).abs().max() for k in range(503, 511)]).mean()
        short, long = gap(200), gap(20000)
    assert long < short / 4, (short, long)

@pytest.mark.unit
def test_population_neu_with_zero_value_heads():
    "With zero value heads v = 0 and delta = r: NEU is the squared norm of the value rows' gradients, in closed form."
    tasks, model = random_tasks(3, seed=601), SoftmaxICTD(4, n_layers=1, init_gain=1., seed=602)
    with torch.no_grad(): model.layers[0].V_cur.zero_(); model.layers[0].V_tgt.zero_()
    Z = population_tokens(tasks).Z
    keys, queries = Z[..., :10], Z[..., 10:]
    att = torch.softmax((model.layers[0].A.detach().mT @ keys).mT @ queries + tasks.d_pi.log()[..., None], dim=-2)
    w = (tasks.d_pi * tasks.r)[..., None]
    expected = (keys @ att @ w).mean(0).square().sum() + (keys @ tasks.P.mT @ att @ w).mean(0).square().sum()
    assert abs(population_neu(model, tasks) - expected.item()) < 1e-12 * max(1., expected.item())

@pytest.mark.unit
def test_population_predict_refuses_mismatched_features():
    with pytest.raises(ValueError, match="`tasks` have d = 4 features but the model expects d = 2"):
        population_predict(SoftmaxICTD(2, n_layers=1, seed=0), random_tasks(2, seed=0))
