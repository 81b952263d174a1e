"""Reference training loops, kept outside the package so that the engine is checked against code it does not share.

- `one_seed_pretrain(config)`: the book's one-seed loop as it was before the batched engine (a `SoftmaxICTD`
  module, `torch.optim.Adam`, two forward passes per step, every metric computed per model); it draws its
  examples with the public `td_batch` and its tasks with `random_tasks`. Only changes: its seeds follow the package's named streams (`ictd.core.run_stream`), and the recorded mean training
  loss, NEU estimates and block cosines are kept in float64 (they were float32 tensors of float64 numbers).
- `predecessor_pretrain(config, n_steps)`: the unbatched loop in the style of the linear-attention predecessor's
  public code: one prompt at a time, one backward pass per example, gradients accumulated over the batch.
"""
import math
import torch
from ictd.boyan import check_gamma
from ictd.core import nudged, run_stream
from ictd.prompt import build_prompt
from ictd.model import SoftmaxICTD, theta_star
from ictd.tasks import random_tasks, sample_trajectories
from ictd.pretrain import td_batch

def _task_kwargs(config): return dict(n_states=config.n_states, d=config.d, gamma=config.gamma, features=config.features)

def held_out_tasks(config):
    tasks = random_tasks(config.eval_tasks, seed=run_stream(config.seed, "eval_pool"), **_task_kwargs(config))
    return tasks, sample_trajectories(tasks.P, tasks.d_pi, n=config.n, seed=run_stream(config.seed, "eval_contexts"))

def expected_update(model, batch, gamma):
    params = [p for p in model.parameters()]
    v = model.predict(batch.Z).squeeze(-1)
    with torch.no_grad(): delta = batch.reward + check_gamma(gamma) * model.predict(batch.Z_next).squeeze(-1) - v
    grads = torch.autograd.grad((delta * v).mean(), params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])

def neu(model, tasks, n, n_batches=8, batch_size=64, seed=0):
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(int(seed))
    g = torch.stack([expected_update(model, td_batch(tasks, batch_size, n, gen), tasks.gamma) for _ in range(int(n_batches))])
    K = len(g)
    return ((g.sum(0).square().sum() - g.square().sum()) / (K * (K - 1))).item()

def population_predict(model, tasks):
    phi, P = tasks.phi.to(torch.float64), tasks.P
    B, s, d = phi.shape
    zero = phi.new_zeros(B, 1, s)
    keys, queries = torch.cat([phi.mT, tasks.r[:, None], zero], 1), torch.cat([phi.mT, zero, zero], 1)
    log_w = tasks.d_pi.log().unsqueeze(-1)
    for l in range(model.n_layers):
        A, V_cur, V_tgt = model.layer(l).params(keys)
        successor = keys @ P.mT
        attend = lambda Zc: torch.softmax(keys.mT @ A @ Zc + log_w, dim=-2)
        keys, queries = (Zc + (V_cur @ keys + V_tgt @ successor) @ attend(Zc) for Zc in (keys, queries))
    return queries[:, d + 1, :]

def population_neu(model, tasks):
    v = population_predict(model, tasks)
    with torch.no_grad(): delta = tasks.r + tasks.gamma * (tasks.P @ v.unsqueeze(-1)).squeeze(-1) - v
    grads = torch.autograd.grad((tasks.d_pi * delta * v).sum(-1).mean(), list(model.parameters()), allow_unused=True)
    return sum(g.square().sum() for g in grads if g is not None).item()

def kernel_diagonality_per_layer(model, Z, states, n):
    B, s = states.shape[0], Z.shape[-1] - n - 1
    same = (states[:, :n, None] == torch.arange(s, device=states.device)).to(Z.dtype)
    Zs = model(Z, n=n, return_all=True)
    return torch.stack([(model.layer(l).attention(Zs[:, l], n=n)[:, :n, n + 1:] * same).sum(1).mean() for l in range(model.n_layers)])

def block_cosines(model, gamma):
    star = theta_star(model.d, torch.eye(model.d, dtype=torch.float64), alpha=1., gamma=gamma)
    cos = lambda a, b: (a.flatten() @ b.flatten() / (a.norm() * b.norm()).clamp(min=1e-300)).item()
    return torch.tensor([[cos(p.detach().double(), t) for p, t in zip((lay.A, lay.V_cur, lay.V_tgt), star)]
                         for lay in (model.layer(l) for l in range(model.n_layers))], dtype=torch.float64)

def evaluate(model, eval_tasks, eval_states, config, neu_seed=0):
    rows = torch.arange(len(eval_tasks))[:, None]
    phi, n = eval_tasks.phi, config.n
    Z = build_prompt(phi[rows, eval_states], eval_tasks.r[rows, eval_states[:, :-1]], phi)
    with torch.no_grad():
        v = model.predict(Z, n=n)
        msve = ((v - eval_tasks.v_pi).square() * eval_tasks.d_pi).sum(-1).mean()
        diag = kernel_diagonality_per_layer(model, Z, eval_states, n)
    return dict(msve=msve.reshape(1), neu=torch.tensor([neu(model, eval_tasks, n, n_batches=4, batch_size=64, seed=neu_seed)], dtype=torch.float64),
                neu_population=torch.tensor([population_neu(model, eval_tasks)], dtype=torch.float64),
                diagonality=diag, value_weights=model.value_weights(), cosine=block_cosines(model, config.gamma))

def one_seed_pretrain(config, n_steps=None, callback=None):
    "The pre-engine loop: returns (model, history); `n_steps` overrides the configuration's, `callback(step)` follows each step (for timing)."
    n_steps = config.n_steps if n_steps is None else n_steps
    d = config.n_states if config.features == "onehot" else config.d
    model = SoftmaxICTD(d, n_layers=config.n_layers, shared=config.shared, init_gain=config.init_gain, seed=run_stream(config.seed, "init"))
    with torch.no_grad():   # the rounding nudge of ICTD_PERTURB, drawn as the engine draws it (a no-op when unset)
        for j, k in enumerate(sorted(("A", "V_cur", "V_tgt"))):
            for lay, w in zip(model.layers, nudged(torch.stack([getattr(lay, k) for lay in model.layers]), config.seed, j)): getattr(lay, k).copy_(w)
    held_out, eval_states = held_out_tasks(config)
    train = random_tasks(config.n_tasks, seed=run_stream(config.seed, "train_pool"), **_task_kwargs(config))
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen, history, losses = torch.Generator().manual_seed(run_stream(config.seed, "data")), {}, []
    def record(step, loss):
        for k, v in dict(step=torch.tensor([step]), loss=torch.tensor([loss], dtype=torch.float64), **evaluate(model, held_out, eval_states, config)).items():
            history.setdefault(k, []).append(v)
    for step in range(n_steps + 1):
        if step % config.eval_every == 0: record(step, float(torch.tensor(losses[-config.eval_every:], dtype=torch.float64).mean()) if losses else math.nan)
        if step == n_steps: break
        b = td_batch(train, config.batch_size, config.n, gen)
        v = model.predict(b.Z, n=config.n).squeeze(-1)
        with torch.no_grad(): target = b.reward + config.gamma * model.predict(b.Z_next, n=config.n).squeeze(-1)
        loss = 0.5 * (target - v).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
        if callback is not None: callback(step + 1)
    return model, {k: torch.stack(v) for k, v in history.items()}

def predecessor_pretrain(config, n_steps, callback=None):
    "The unbatched style of the predecessor's public code: one prompt per forward and backward pass, gradients summed over the batch."
    d = config.n_states if config.features == "onehot" else config.d
    model = SoftmaxICTD(d, n_layers=config.n_layers, shared=config.shared, init_gain=config.init_gain, seed=run_stream(config.seed, "init"))
    with torch.no_grad():   # the rounding nudge of ICTD_PERTURB, drawn as the engine draws it (a no-op when unset)
        for j, k in enumerate(sorted(("A", "V_cur", "V_tgt"))):
            for lay, w in zip(model.layers, nudged(torch.stack([getattr(lay, k) for lay in model.layers]), config.seed, j)): getattr(lay, k).copy_(w)
    train = random_tasks(min(config.n_tasks, 256), seed=run_stream(config.seed, "train_pool"), **_task_kwargs(config))
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(run_stream(config.seed, "data"))
    for step in range(n_steps):
        opt.zero_grad()
        for _ in range(config.batch_size):
            b = td_batch(train, 1, config.n, gen)
            v = model.predict(b.Z[0], n=config.n)
            with torch.no_grad(): target = b.reward[0] + config.gamma * model.predict(b.Z_next[0], n=config.n)
            (0.5 * (target - v).square().sum() / config.batch_size).backward()
        opt.step()
        if callback is not None: callback(step + 1)
    return model
