"""The side loops that `pretrain_many` replaced, frozen as they were (commit acd7b8d) so that tests can check the engine
reproduces them: `pretrain_linear_many` (chapter 7, the predecessor's sliding-window protocol) and `pretrain_family`
(chapter 7a, continuous task families). Only their imports changed (to where the pieces they use now live), and their seeds follow the package's named
streams (`ictd.core.run_stream`) in place of the offsets they had."""
import torch
from ictd.core import run_stream
from ictd.tasks import sample_trajectories
from ictd.engine import PretrainConfig, softmax_init
from ictd.state_tokens import token_predict, trajectory_tokens
from ictd.pretrain import stack_pools
from ictd.tasks import task_pool
from ictd.linear import build_linear_prompt, linear_init, linear_measures, linear_predict, sliding_windows
from ictd.sliding import fitted_td_step, sliding_td_loss, start_distributions

def held_out_linear(config, seeds):
    out = []
    for s in seeds:
        tasks, gen = task_pool(config, config.eval_tasks, run_stream(s, "eval_pool")), torch.Generator().manual_seed(run_stream(s, "eval_contexts"))
        states = sample_trajectories(tasks.P, start_distributions(config.eval_tasks, config.n_states, gen), n=config.n, seed=gen)
        rows = torch.arange(config.eval_tasks)[:, None]
        phi, r = tasks.phi[rows, states], tasks.r[rows, states]
        Zc = build_linear_prompt(phi, r[..., :-1], phi[..., :1, :], config.gamma)[..., :config.n]
        out.append((tasks, Zc))
    return stack_pools([t for t, _ in out]), torch.stack([z for _, z in out])

def _trajectories(config, seeds, gens, first_task, count, per_task):
    T = config.n + config.batch_size + 1
    phi, r, states = [], [], []
    for s, g in zip(seeds, gens):
        tasks = task_pool(config, count, run_stream(s, "train_pool"), first=first_task)
        mu = start_distributions(count, config.n_states, g).repeat_interleave(per_task, 0)
        states.append(sample_trajectories(tasks.P.repeat_interleave(per_task, 0), mu, n=T, seed=g).unflatten(0, (count, per_task)))
        phi.append(tasks.phi); r.append(tasks.r)
    return torch.stack(phi), torch.stack(r), torch.stack(states)

def pretrain_linear_many(config, seeds=(0,), chunk=25, callback=None):
    "Sliding-window TD pretraining of linear Transformers, one run per seed, stacked (the old side loop of chapter 7)."
    seeds, n, L, per_task = [int(s) for s in seeds], config.n, config.n_layers, config.n_steps // config.n_tasks
    params = {k: v.requires_grad_(True) for k, v in linear_init(config, seeds).items()}
    opt = torch.optim.Adam(params.values(), lr=config.lr, weight_decay=config.weight_decay)
    gens = [torch.Generator().manual_seed(run_stream(s, "data")) for s in seeds]
    alpha, (held, Zc) = fitted_td_step(n=n, n_layers=L, gamma=config.gamma, n_states=config.n_states, d=config.feature_dim), held_out_linear(config, seeds)
    history = {}
    def record(step):
        for k, v in dict(step=torch.full((len(seeds),), float(step)), tasks=torch.full((len(seeds),), step / per_task),
                         **linear_measures(params["P"], params["Q"], held, Zc, alpha, L)).items():
            history.setdefault(k, []).append(v.clone())
    record(0)
    step = 0
    for first in range(0, config.n_tasks, chunk):
        phi, r, states = _trajectories(config, seeds, gens, first, min(chunk, config.n_tasks - first), per_task)
        for t in range(phi.shape[1]):
            for b in range(per_task):
                Z, rw = sliding_windows(phi[:, t], r[:, t], states[:, t, b], n, config.gamma)
                loss = sliding_td_loss(linear_predict(config, params, Z, n)[..., 0], rw, gamma=config.gamma).sum()
                opt.zero_grad(); loss.backward(); opt.step()
                step += 1
                if callback is not None: callback(step)
                if step % config.eval_every == 0: record(step)
    return dict(P=params["P"].detach(), Q=params["Q"].detach(), alpha_td=alpha, history={k: torch.stack(v, -1) for k, v in history.items()})

def family_batch(family, gens, batch_size, n):
    out = []
    for g in gens:
        t, states, q, q1 = family.sample(batch_size, n, g)
        out.append((states, family.reward(t, states[:, :-1]), torch.stack([q, q1], -1), family.reward(t, q)))
    states, R, Q, r_q = (torch.stack(x) for x in zip(*out))
    return trajectory_tokens(family.features(states), R, family.features(Q)), r_q

def family_msve(params, n_layers, family, ctx):
    S, phi = params["A"].shape[0], family.features(ctx["states"])
    ex = lambda t: t[None].expand(S, *t.shape)
    tokens = trajectory_tokens(ex(phi), ex(ctx["rewards"]), ex(family.features(ctx["x"]).expand(len(phi), -1, -1)))
    with torch.no_grad(): v = token_predict({k: p.detach().double() for k, p in params.items()}, n_layers, tokens)
    return ((v - ctx["v"]) ** 2 * ctx["w"]).sum(-1)

def pretrain_family(family, seeds, n=30, n_layers=3, n_steps=500, lr=1e-2, batch_size=64, init_gain=0.1, weight_decay=1e-6,
                    dtype=torch.float32, eval_every=100, eval_tasks=64, eval_seed=0):
    # eval_seed: was 10**6 when `family.contexts(n, length, seed)` took a plain seed; it is now the root of the named task
    # sets (chapter 7b), whose held-out set the engine uses with root 0. Nothing else changed.
    "Multi-task TD pretraining of one softmax Transformer per seed on a continuous family (the old side loop of chapter 7a)."
    seeds = list(seeds)
    cfg = PretrainConfig(d=family.d, n_layers=n_layers, init_gain=init_gain)
    params = {k: v.requires_grad_() for k, v in softmax_init(cfg, seeds, dtype).items()}
    opt = torch.optim.Adam(params.values(), lr=lr, weight_decay=weight_decay)
    gens, ctx = [torch.Generator().manual_seed(run_stream(s, "data")) for s in seeds], family.contexts(eval_tasks, n, eval_seed)
    hist = {k: [] for k in ("steps", "msve", "A", "V_cur", "V_tgt")}
    for step in range(n_steps + 1):
        if step % eval_every == 0 or step == n_steps:
            hist["steps"].append(step); hist["msve"].append(family_msve(params, n_layers, family, ctx).mean(-1))
            for k in ("A", "V_cur", "V_tgt"): hist[k].append(params[k].detach().double().clone())
        if step == n_steps: break
        tokens, r_q = family_batch(family, gens, batch_size, n)
        v = token_predict(params, n_layers, tokens)
        loss = 0.5 * (r_q.to(v) + family.gamma * v[..., 1].detach() - v[..., 0]).square().mean(-1)
        opt.zero_grad(); loss.sum().backward(); opt.step()
    out = {k: torch.stack(v) if k != "steps" else torch.tensor(v) for k, v in hist.items()}
    out["params"] = {k: out[k][-1] for k in ("A", "V_cur", "V_tgt")}
    return out
