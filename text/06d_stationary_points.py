# %%
#| default_exp experiments.stationary

# %%
#| export
from __future__ import annotations
import json, math, time
from pathlib import Path
import torch
from ictd.core import TaskBatch, atomic_write_text, check_int, check_number, check_type, provenance
from ictd.model import SoftmaxICTD, theta_star
from ictd.state_tokens import StateTokens, model_params, population_tokens, token_layers, token_predict
from ictd.tasks import random_tasks


# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %% [markdown]
# # Stationary points of pretraining
# > Where the mean semi-gradient TD update vanishes in the population state-token model: what a uniform layer writes, why every layer starts as one, and what Newton's method finds.

# %%
#| export
HEADS = ("A", "V_cur", "V_tgt")

def layer_stack(model:SoftmaxICTD)->torch.Tensor:
    "A model's parameters as one float64 tensor (L, 3, D, D): layer, then (A, V_cur, V_tgt)."
    check_type(model, SoftmaxICTD, "model")
    if model.shared: raise ValueError("`model` must have separate layers (shared=False)")
    return torch.stack([model_params(model)[k][0].detach().double() for k in HEADS], 1)

def _params(p:torch.Tensor)->dict:
    "(S, L, 3, D, D) stacked parameter sets -> the dict of (S, L, D, D) tensors the state-token pass takes."
    return {k: p[:, :, i] for i, k in enumerate(HEADS)}

def _population(tasks:TaskBatch, S:int)->tuple:
    one = TaskBatch(*(getattr(tasks, k)[None] for k in ("P", "r", "phi", "d_pi", "v_pi")), tasks.gamma)
    x = population_tokens(one)
    return one, StateTokens(*(t.expand(S, *t.shape[1:]) for t in (x.Z, x.log_w, x.succ)), x.q)

def mean_updates(p:torch.Tensor,     # (S, L, 3, D, D) parameter sets, or (L, 3, D, D) for one
                 tasks:TaskBatch,    # the fixed batch of tasks to average over
                )->torch.Tensor:     # the same shape: the mean update E[delta grad TF] of each set, at n = infinity
    "The mean semi-gradient TD update $U(\\theta) = \\mathbb E[\\delta\\, \\nabla_\\theta \\mathrm{TF}]$ at $n = \\infty$, for many parameter sets at once."
    check_type(tasks, TaskBatch, "tasks")
    one_set = p.ndim == 4
    P = (p[None] if one_set else p).detach().double()
    if P.ndim != 5 or P.shape[2] != 3 or P.shape[-1] != P.shape[-2] or P.shape[-1] != tasks.phi.shape[-1] + 2:
        raise ValueError(f"`p` must be (S, L, 3, D, D) with D = d + 2 = {tasks.phi.shape[-1] + 2}, got {tuple(p.shape)}")
    one, x = _population(tasks, P.shape[0])
    P = P.requires_grad_()
    v = token_predict(_params(P), P.shape[1], x)                                    # (S, B, s)
    with torch.no_grad(): delta = one.r + tasks.gamma * (one.P @ v[..., None])[..., 0] - v
    U = torch.autograd.grad((one.d_pi * delta * v).sum() / len(tasks), P)[0]
    return U[0] if one_set else U

def update_norm(p, tasks)->float:
    "The norm of the mean update at one parameter set (L, 3, D, D); its square is `population_neu`."
    return mean_updates(p, tasks).norm().item()

# %%
#| export
def update_jacobian_fd(p:torch.Tensor,    # (L, 3, D, D) one parameter set
                       tasks:TaskBatch,   # the batch of tasks
                       h:float=1e-5,      # central-difference step
                       chunk:int=256,     # parameter sets per batched call
                      )->torch.Tensor:    # (n, n) dU/dtheta over the flattened parameters
    "The Jacobian of the mean update by central differences, every perturbed set in batched calls of `mean_updates`."
    n = p.numel()
    E = torch.eye(n, dtype=torch.float64).reshape(n, *p.shape)
    cols = [(mean_updates(p + h * E[i:i + chunk], tasks) - mean_updates(p - h * E[i:i + chunk], tasks)).reshape(-1, n) / (2 * h)
            for i in range(0, n, chunk)]
    return torch.cat(cols).T

# %%
#| export
def polish(p:torch.Tensor,         # (L, 3, D, D) the start
           tasks:TaskBatch,        # the batch of tasks
           tol:float=1e-10,        # stop when the norm of the mean update is below this
           max_jacobians:int=5,    # Jacobians to compute at most
           steps_per_jacobian:int=20, # Levenberg-Marquardt steps that reuse one Jacobian
          )->tuple:                # (the last point, the update norm after every accepted step)
    "Levenberg-Marquardt on $U(\\theta) = 0$: each step tries a range of damping values on one Jacobian and keeps the best."
    tol, max_jacobians = check_number(tol, "tol", 0, True), check_int(max_jacobians, "max_jacobians", 1)
    p = p.detach().double().clone()
    g = mean_updates(p, tasks).flatten()
    hist = [g.norm().item()]
    damping = 10.0 ** torch.arange(-14., 2.5, 0.5, dtype=torch.float64)
    for _ in range(max_jacobians):
        if hist[-1] < tol: break
        J = update_jacobian_fd(p, tasks)
        lam, Q = torch.linalg.eigh(J.T @ J)
        for _ in range(steps_per_jacobian):
            b = Q.T @ (J.T @ g)
            cands = torch.stack([p - (Q @ (b / (lam + mu))).reshape(p.shape) for mu in damping * lam.max()])
            norms = mean_updates(cands, tasks).flatten(1).norm(dim=-1)
            k = int(norms.argmin())
            if norms[k] >= hist[-1]: break
            ratio = norms[k].item() / hist[-1]
            p = cands[k]; g = mean_updates(p, tasks).flatten(); hist.append(g.norm().item())
            if hist[-1] < tol or ratio > 0.5: break
    return p, hist

# %%
#| export
def level_td_stack(d:int,          # feature dimension
                   n_layers:int,   # depth L >= 2
                   level:float,    # lambda: layer 1 writes lambda R-bar / (1 - gamma) into every value slot
                   beta:float,     # TD layers: W = beta I
                   alpha:float,    # TD layers: step size
                   gamma:float,    # discount factor
                  )->torch.Tensor: # (L, 3, d + 2, d + 2)
    "A uniform level layer (A = 0, value row of V_cur reading the reward row) followed by L - 1 layers of theta*(beta I, alpha)."
    n_layers = check_int(n_layers, "n_layers", 2)
    D = d + 2
    first = torch.zeros(3, D, D, dtype=torch.float64)
    first[1, D - 1, d] = check_number(level, "level") / (1 - gamma)
    td = torch.stack(theta_star(d, check_number(beta, "beta") * torch.eye(d, dtype=torch.float64), alpha, gamma))
    return torch.stack([first] + [td] * (n_layers - 1))

def warm_td_values(tasks:TaskBatch, n_layers:int, level:float, beta:float, alpha:float)->torch.Tensor:
    "(B, s) the population recursion $v_{l+1} = v_l + \\alpha M_\\pi(r + \\gamma P v_l - v_l)$ run L - 1 times from the level $\\lambda \\bar r / (1 - \\gamma)$."
    M = torch.softmax(beta * tasks.phi @ tasks.phi.mT + tasks.d_pi.log()[:, None, :], dim=-1)
    v = (level * (tasks.d_pi * tasks.r).sum(-1, keepdim=True) / (1 - tasks.gamma)).expand_as(tasks.r)
    for _ in range(n_layers - 1): v = v + alpha * (M @ (tasks.r + tasks.gamma * (tasks.P @ v[..., None])[..., 0] - v)[..., None])[..., 0]
    return v

LEVEL_TD_GRID = dict(level=(0., 0.5, 0.85, 1.), beta=(1., 3., 5., 10.), alpha=(0.5, 1.))   # the family's constants searched

def level_td_grid(tasks:TaskBatch, n_layers:int, grid:dict=LEVEL_TD_GRID)->list:
    "NEU of every member of the level + TD family on the grid: (level, beta, alpha, NEU) rows, in one batched call."
    d, pts = tasks.phi.shape[-1], [(l, b, a) for l in grid["level"] for b in grid["beta"] for a in grid["alpha"]]
    U = mean_updates(torch.stack([level_td_stack(d, n_layers, l, b, a, tasks.gamma) for l, b, a in pts]), tasks)
    return [(l, b, a, u.square().sum().item()) for (l, b, a), u in zip(pts, U)]

# %%
#| export
def layer_diagonality(p:torch.Tensor, tasks:TaskBatch)->list:
    "Each layer's population diagonality: the mean share of a query state's attention on its own state (uniform: below `UNIFORM_BELOW`)."
    _, x = _population(tasks, 1)
    s = tasks.r.shape[-1]
    with torch.no_grad(): atts = token_layers(_params(p[None].double()), p.shape[0], x)[1]
    return [a[0][..., :, s:].diagonal(dim1=-2, dim2=-1).mean().item() for a in atts]

def mean_flow(tasks:TaskBatch,        # the batch of tasks
              n_layers:int,           # depth L
              eta:float=1.,           # Euler step of the flow d theta / dt = U(theta)
              n_steps:int=4000,       # steps
              record_every:int=200,   # steps between records
              start:torch.Tensor=None,# (L, 3, D, D); default zero
             )->dict:                 # t, update norm, parameter norm and per-layer diagonality at each record; the last point
    "Euler integration of the mean semi-gradient flow $\\dot\\theta = U(\\theta)$ at $n = \\infty$ (no optimiser, no sampling)."
    D = tasks.phi.shape[-1] + 2
    p = torch.zeros(n_layers, 3, D, D, dtype=torch.float64) if start is None else start.detach().double().clone()
    out = dict(t=[], update_norm=[], param_norm=[], diagonality=[])
    for k in range(check_int(n_steps, "n_steps", 1) + 1):
        U = mean_updates(p, tasks)
        if k % record_every == 0:
            for key, val in zip(out, (k * eta, U.norm().item(), p.norm().item(), layer_diagonality(p, tasks))): out[key].append(val)
        p = p + eta * U
    return out | dict(last=p)

# %%
#| export
def spectrum_summary(J:torch.Tensor,       # (n, n) Jacobian of the mean update at a stationary point
                     zero_tol:float=1e-7,  # eigenvalues below this times the largest modulus count as zero modes
                    )->dict:
    "Stability of a rest point of $\\dot\\theta = U(\\theta)$: zero modes, eigenvalues with positive real part, and the verdict."
    ev = torch.linalg.eigvals(J)
    scale = ev.abs().max().item()
    zero = ev.abs() < zero_tol * scale
    re = ev.real[~zero]
    n_pos = int((re > 0).sum())
    return dict(n_params=len(ev), n_zero=int(zero.sum()), n_positive=n_pos, n_negative=int((re < 0).sum()),
                max_real=re.max().item(), min_real=re.min().item(), largest_modulus=scale, verdict="saddle" if n_pos else "stable")

def uniform_positions(runs:list)->list:
    "For saved runs (`save_runs` dicts of one configuration), the 1-based positions of each model's uniform layers (`layer_anatomy`'s rule)."
    from ictd.experiments.mechanism import load_models
    from ictd.mechanism import learned_kernel
    from ictd.emergence import UNIFORM_BELOW, held_out_prompts
    models = load_models(runs)
    tasks = held_out_prompts(models[0][0])[0]
    diag = [learned_kernel(m, tasks).diagonal(dim1=-2, dim2=-1).mean((-2, -1)) for _, m in models]
    return [tuple(int(i) + 1 for i in (d < UNIFORM_BELOW).nonzero().flatten()) for d in diag]

# %%
#| export
STUDY_TASKS = dict(n_tasks=64, seed=20_261_203)   # the fixed batch of tasks every stationary-point computation averages over

def study_tasks(features:str="onehot", n_tasks:int=STUDY_TASKS["n_tasks"], seed:int=STUDY_TASKS["seed"])->TaskBatch:
    "The study's fixed batch of tasks: one-hot features, or d = 4 random features (the headline configuration's)."
    if features == "onehot": return random_tasks(n_tasks, seed=seed, features="onehot")
    if features == "random": return random_tasks(n_tasks, seed=seed, features="random", d=4)
    raise ValueError(f"`features` must be 'onehot' or 'random', got {features!r}")

def _starts(tasks:TaskBatch, L:int, flow_end:torch.Tensor, trained:list)->dict:
    d, best = tasks.phi.shape[-1], min(level_td_grid(tasks, L), key=lambda r: r[3])
    out = {"theta*": torch.stack(theta_star(d, best[1] * torch.eye(d, dtype=torch.float64), best[2], tasks.gamma)).expand(L, 3, d + 2, d + 2).clone()}
    out["level + TD"] = level_td_stack(d, L, *best[:3], tasks.gamma)
    out["mean flow from zero"] = flow_end
    for seed in (L, L + 10): out[f"small random init (seed {seed})"] = layer_stack(SoftmaxICTD(d, L, init_gain=0.1, seed=seed))
    for i, p in enumerate(trained): out[f"trained (one-hot cell, seed {i})"] = p
    return out

def run_stationary_study(out_dir="nbs/data",        # folder of the JSON file
                         flow_steps:int=6000,       # Euler steps of each mean flow
                         eta:float=0.5,             # Euler step
                         max_jacobians:int=4,       # Jacobians per Levenberg-Marquardt search
                         n_trained:int=2,           # trained one-hot models (L = 3) used as starts
                         command:str="run_stationary_study()", # recorded in the file
                        )->Path:                    # the file written, `stationary_points.json`
    "The mean flows from zero, the level + TD family's NEU, and Levenberg-Marquardt searches for zeros of the mean update from several starts."
    t0 = time.time()
    flows, searches = {}, []
    for feats, L in (("onehot", 2), ("onehot", 3), ("random", 3)):
        fl = mean_flow(study_tasks(feats), L, eta, flow_steps, record_every=max(1, flow_steps // 40))
        flows[f"{feats}, L = {L}"] = {k: v for k, v in fl.items() if k != "last"} | dict(last=fl["last"].tolist())
    runs = json.loads((Path(out_dir) / "contest_runs2.json").read_text())["cells"]["one-hot"]["runs"][:n_trained]
    from ictd.experiments.mechanism import load_models
    trained = [layer_stack(m) for _, m in load_models(runs)]
    tasks = study_tasks("onehot")
    for L in (2, 3):
        flow_end = torch.tensor(flows[f"onehot, L = {L}"]["last"], dtype=torch.float64)
        for name, start in _starts(tasks, L, flow_end, trained if L == 3 else []).items():
            t1 = time.time()
            p, hist = polish(start, tasks, max_jacobians=max_jacobians)
            rec = dict(name=name, n_layers=L, history=hist, converged=hist[-1] < 1e-10, start_norm=start.norm().item(), final_norm=p.norm().item(),
                       moved=(p - start).norm().item(), diagonality=layer_diagonality(p, tasks), params=p.tolist())
            if rec["converged"]: rec["spectrum"] = spectrum_summary(update_jacobian_fd(p, tasks))
            searches.append(rec | dict(seconds=time.time() - t1))
    payload = dict(tasks=STUDY_TASKS, eta=eta, flow_steps=flow_steps, max_jacobians=max_jacobians, flows=flows, searches=searches,
                   family={f"L = {L}": level_td_grid(tasks, L) for L in (2, 3)}, seconds=time.time() - t0)
    return atomic_write_text(Path(out_dir) / "stationary_points.json", json.dumps(dict(provenance=provenance(command), **payload)))

def load_stationary(data_dir="data")->dict:
    "The saved study of `run_stationary_study`."
    return json.loads((Path(data_dir) / "stationary_points.json").read_text())

# %%
#| hide
import nbdev; nbdev.nbdev_export()
