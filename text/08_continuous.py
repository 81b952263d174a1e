# %%
#| default_exp continuous

# %%
#| export
from __future__ import annotations
import math
import numpy as np
import torch
from fastcore.basics import patch
from ictd.boyan import as_tensor, check_gamma, weighted_error
from ictd.core import check_choice, check_int, check_number, check_work, stream_generator
from ictd.wstd import weighted_softmax_td
from ictd.tasks import Contexts, TDExamples
from ictd.engine import PROTOCOLS, EvalSet, PretrainConfig, Protocol, get_family, register_protocol

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import dataclasses
from IPython.display import Markdown
from ictd.core import record_claim
from ictd.model import SoftmaxICTD
from ictd.state_tokens import token_predict, trajectory_tokens
from ictd.engine import get_protocol
from ictd.state_tokens import model_params
from ictd.pretrain import pretrain_many
from ictd.prompt import build_prompt
from ictd.wstd import context_weights


# %% [markdown]
# # Continuous states
# > Weighted softmax TD on Markov reward processes with continuous states and exact values: the bilinear score of two or three features is a von Mises or a Gaussian kernel, and the constructed Transformer runs kernel TD on the trajectory alone.

# %% [markdown]
# Weighted softmax TD can be read as *policy evaluation in kernel space*, yet every experiment so far
# ran on a finite chain of a few states. The algorithm never needs the state
# space: it runs on the features of the trajectory's states and on the query's features, nothing
# else. This chapter takes it to processes whose states are real numbers or angles, where no two
# states of a context are ever equal, the tabular picture of the
# [convergence chapter](convergence.html) breaks down, and the kernel is all there is.
#
# ::: {.callout-note}
# **Everything in this chapter is the project's own work [ours]**, beyond what the paper claims:
# the two processes and their closed-form values, the kernel identities, the population analysis
# and every experiment. The paper's claims are those of the earlier chapters; here we ask what they
# become when states are continuous.
# :::
#
# *How to read this chapter.* The lesson is three statements. The score of two features is a
# classical smoothing kernel, so the constructed Transformer runs **kernel TD** (Proposition 8.1,
# with a worked example by hand); in the large-context limit kernel TD has **no smoothing bias**,
# each harmonic or polynomial degree converging at its own geometric rate (Proposition 8.2); and on
# one context its fixed point is the trajectory's **own return chain** (Proposition 8.3). Before them
# come the two processes with exact values that every statement is tested on; after them, random
# families of the processes for the training engine. Each statement has its proof folded (click to open) and one check. The code a reader calls
# (`NoisyRotation`, `GaussianAR1`, `kernel_td`, `population_msve`, `family_config`) is
# documented where it appears; helpers, input validation and exhaustive tests are in the last
# section, [Implementation and tests](#implementation-and-tests). Symbols follow the
# [notation page](notation.html): states are $x, y$ (real numbers or angles), $S_0..S_n$ the
# trajectory. The [next chapter](continuous_experiments.html) measures what the statements predict:
# the error against depth, context length and bandwidth, against linear TD, and pretraining on the
# families (does training find the kernel?).

# %% [markdown]
# ## Two processes with exact values
#
# Both processes take their parameters, none of them random, in the constructor, and share one
# interface: `sample_trajectory(n, seed)` returns the states $S_0..S_n$ (a stationary start) and the
# rewards with `rewards[k-1]` $= R_k = r(S_{k-1})$, as in [chapter 0](boyan.html); `v_pi(states)`
# evaluates the true value in closed form; `features(states)` gives the features the Transformer
# sees; `grid(m)` is a quadrature of the stationary law (points and weights), on which value errors
# are measured: $\mathrm{MSVE}(\hat v) = \sum_j w_j (\hat v(x_j) - v_\pi(x_j))^2$.
#
# ### The noisy rotation on the circle
#
# $S_{t+1} = S_t + \vartheta + \sigma \xi_t \pmod{2\pi}$ with $\xi_t \sim N(0, 1)$ i.i.d. For any
# integer $k$, $E[e^{ikS_{t+1}} \mid S_t = x] = p_k e^{ikx}$ with $p_k = e^{ik\vartheta - k^2\sigma^2/2}$
# (the characteristic function of the Gaussian step): **each harmonic is an eigenfunction of the
# transition operator**. So if $r(x) = \mathrm{Re}\sum_k r_k e^{ikx}$, then
#
# $$v_\pi(x) = \sum_{t \ge 0}\gamma^t E[r(S_t) \mid S_0 = x] = \mathrm{Re}\sum_k \frac{r_k}{1 - \gamma p_k}\, e^{ikx}.$$
#
# For $r = \cos$ this is $v_\pi(x) = \mathrm{Re}\,[e^{ix} / (1 - \gamma e^{i\vartheta - \sigma^2/2})]$.
# The default reward is rougher on purpose: $r(x) = \mathrm{sign}(\sin x)$, $+1$ on the upper
# half of the circle and $-1$ on the lower, a square wave with $r_k = -4i/(\pi k)$ for odd $k$.
# Its series converges slowly, but $\frac{1}{1 - \gamma p_k} = 1 + \frac{\gamma p_k}{1 - \gamma p_k}$
# splits the value into the reward itself plus a correction whose coefficients fall like
# $e^{-k^2\sigma^2/2}$:
#
# $$v_\pi(x) = r(x) + \mathrm{Re}\sum_{k \text{ odd}} r_k\,\frac{\gamma p_k}{1 - \gamma p_k}\, e^{ikx},$$
#
# summed until the terms are below $10^{-17}$. Why this reward: a discontinuous value is where a
# kernel's bandwidth matters (too wide blurs the jump, too narrow averages too few transitions),
# and where two features cannot represent the value linearly. The stationary law is uniform
# ($\sigma > 0$), so the grid is $m$ equally spaced angles with weights $1/m$.

# %%
#| export
def _positive(x, name:str)->float: return check_number(x, name, 0., strict=True)
def _length(n, name:str="n")->int: return check_int(n, name, 1)

def _angles(states)->torch.Tensor:
    return as_tensor(states, "states")

class ContinuousProcess:
    "The interface shared by the processes of this chapter: subclasses define `reward`, `step`, `stationary`, `v_pi`, `features`, `grid`."
    def sample_trajectory(self, n:int,     # number of transitions
                          seed=None,        # int or `numpy.random.Generator`
                         )->tuple:          # (states (n + 1,) float64 tensor S_0..S_n, rewards (n,), rewards[k-1] = R_k = r(S_{k-1}))
        "A stationary trajectory of `n` transitions."
        n, rng = _length(n), np.random.default_rng(seed)
        s = np.empty(n + 1)
        s[0] = self.stationary((), rng)
        for t in range(n): s[t + 1] = self.step(s[t], rng)
        states = torch.from_numpy(s)
        return states, self.reward(states[:-1])

    def msve(self, v_hat,   # (..., m) estimates at the points of `grid(m)`
            )->torch.Tensor: # (...,) sum_j w_j (v_hat(x_j) - v_pi(x_j))^2
        "Mean squared value error under the stationary law, by the quadrature `grid(m)`."
        v_hat = as_tensor(v_hat, "v_hat")
        x, w = self.grid(v_hat.shape[-1])
        return weighted_error(v_hat, self.v_pi(x).to(v_hat), w.to(v_hat))


# %% [markdown]
# A process only says how to draw its stationary law and one step; the base class turns those
# into trajectories, and its closed-form `v_pi` and quadrature `grid` into an MSVE, so that every
# learner of this part is scored the same way on both processes:

# %%
show_doc(ContinuousProcess.sample_trajectory)


# %% [markdown]
# The rotation fills in the interface with the Fourier series above; its harmonics and transition
# eigenvalues are kept as methods because the large-context limit below reuses them.

# %%
#| export
class NoisyRotation(ContinuousProcess):
    "A rotation of the circle by `mu` plus Gaussian noise, with reward sign(sin s) ('square') or cos s ('cos')."
    d = 2          # features (cos s, sin s)
    def __init__(self, mu:float=0.5,       # mean rotation per step (radians)
                 sigma:float=0.3,          # standard deviation of the Gaussian noise per step (radians), > 0
                 gamma:float=0.9,          # discount factor in [0, 1)
                 reward:str="square",      # 'square': sign(sin s); 'cos': cos s
                ):
        self.mu, self.sigma, self.gamma = check_number(mu, "mu"), _positive(sigma, "sigma"), check_gamma(gamma)
        self.reward_kind = check_choice(reward, ("square", "cos"), "reward")
        if reward == "square" and self.sigma < 0.01: raise ValueError(f"`sigma` must be at least 0.01 with the square reward (its value series needs 9 / sigma harmonics), got {sigma}")

    def __repr__(self): return f"NoisyRotation(mu={self.mu}, sigma={self.sigma}, gamma={self.gamma}, reward={self.reward_kind!r})"

    def transition_eigenvalues(self, k)->torch.Tensor:
        "$p_k = e^{ik\\vartheta - k^2\\sigma^2/2}$: $E[e^{ikS'} | S = s] = p_k e^{iks}$."
        k = torch.as_tensor(k, dtype=torch.float64)
        return torch.exp(1j * k * self.mu - k ** 2 * self.sigma ** 2 / 2)

    def reward_harmonics(self, k_max:int)->tuple:
        "(k, c_k) for k = 1..k_max: the reward is Re sum_k c_k e^{iks}."
        k = torch.arange(1, _length(k_max, "k_max") + 1, dtype=torch.float64)
        if self.reward_kind == "cos": c = (k == 1).to(torch.complex128)
        else: c = torch.where(k % 2 == 1, -4j / (math.pi * k), 0j)
        return k, c

    def reward(self, states)->torch.Tensor:
        "r(s) at each state."
        s = _angles(states)
        return torch.cos(s) if self.reward_kind == "cos" else torch.sign(torch.sin(s))

    def features(self, states)->torch.Tensor:
        "(..., 2) features (cos s, sin s)."
        s = _angles(states)
        return torch.stack([torch.cos(s), torch.sin(s)], -1)

    def v_pi(self, states)->torch.Tensor:
        "The true value in closed form (the reward plus a Fourier series truncated below 1e-17)."
        s = _angles(states)
        k_max = 1 if self.reward_kind == "cos" else max(1, math.ceil(math.sqrt(2 * 40) / self.sigma))
        k, c = self.reward_harmonics(k_max)
        p = self.transition_eigenvalues(k)
        g = self.gamma * p / (1 - self.gamma * p)
        return self.reward(s) + (torch.exp(1j * s.unsqueeze(-1) * k) @ (c * g)).real

    def step(self, states, rng:np.random.Generator)->np.ndarray:
        "One transition from each of `states` (numpy), drawn with `rng`."
        s = np.asarray(states, dtype=np.float64)
        return np.mod(s + self.mu + self.sigma * rng.standard_normal(s.shape), 2 * np.pi)

    def stationary(self, size, rng:np.random.Generator)->np.ndarray:
        "Draws from the stationary law (uniform on [0, 2 pi))."
        return rng.uniform(0, 2 * np.pi, size)

    def grid(self, m:int=128)->tuple:
        "(states (m,), weights (m,)): a quadrature of the stationary law (equally spaced angles)."
        m = _length(m, "m")
        return torch.arange(m, dtype=torch.float64) * (2 * math.pi / m), torch.full((m,), 1 / m, dtype=torch.float64)


# %%
show_doc(NoisyRotation)

# %%
show_doc(NoisyRotation.v_pi)

# %%
rot = NoisyRotation()
S, R = rot.sample_trajectory(500, seed=0)
test_eq((S.shape, R.shape, S.dtype), ((501,), (500,), torch.float64))
test_eq(R, torch.sign(torch.sin(S[:-1])))
test_eq(rot.sample_trajectory(500, seed=0)[0], S)
assert ((S >= 0) & (S < 2 * math.pi)).all()
test_close(((S[1:] - S[:-1] - rot.mu + math.pi) % (2 * math.pi) - math.pi).std().item(), rot.sigma,
           eps=0.03)
test_eq(rot.features(S).shape, (501, 2))
cosine = NoisyRotation(reward="cos")
s = torch.linspace(0, 2 * math.pi, 7, dtype=torch.float64)
test_close(cosine.v_pi(s), (torch.exp(1j * s) / (1 - 0.9 * np.exp(0.5j - 0.3 ** 2 / 2))).real,
           eps=1e-14)
rot


# %% [markdown]
# ### A linear-Gaussian AR(1) process with a polynomial reward
#
# $S_{t+1} = a S_t + \sigma \xi_t$ on the real line, $|a| < 1$, stationary law
# $N(0, \sigma_\infty^2)$ with $\sigma_\infty^2 = \sigma^2 / (1 - a^2)$. The transition operator maps
# polynomials of degree $D$ to polynomials of degree $D$:
# $E[(aS + \sigma\xi)^j \mid S = x] = \sum_{i \le j} \binom{j}{i} a^i x^i \sigma^{j-i} E[\xi^{j-i}]$,
# with $E[\xi^p] = (p-1)!!$ for even $p$ and $0$ for odd $p$. In the monomial basis it is an upper
# triangular matrix $\mathcal T_{a,\sigma}$ with diagonal $a^j$, so for a polynomial reward with
# coefficients $\mathbf r$ the value is the polynomial with coefficients
#
# $$\mathbf v_\pi = (I - \gamma \mathcal T_{a,\sigma})^{-1} \mathbf r,$$
#
# a triangular solve (the diagonal $1 - \gamma a^j$ is never zero). The default is $a = 0.8$,
# $\sigma = 0.6$ (so $\sigma_\infty = 1$) and the cubic reward $r(x) = x - x^3/3$. Why this process: its
# stationary law has unbounded support and its features $(x, x^2, 1)$ are unbounded, the opposite of
# the circle; and a cubic value lies outside the span of those three features, so linear TD on them
# has a floor while the kernel has none. The grid is $m$ equally spaced points on
# $[-4 \sigma_\infty, 4 \sigma_\infty]$ weighted by the normal density, normalised.

# %%
#| export
def gaussian_moment(p:int)->float:
    "E[xi^p] for xi ~ N(0, 1): (p - 1)!! for even p, 0 for odd p."
    return 0. if p % 2 else float(np.prod(np.arange(p - 1, 0, -2))) if p else 1.


# %%
test_eq([gaussian_moment(p) for p in range(7)], [1., 0., 1., 0., 3., 0., 15.])


# %% [markdown]
# With these moments the expectation of a polynomial after one affine-plus-noise step is a
# polynomial again, and the map between their coefficients is the triangular matrix of the text.
# It is written for any scale $c$ and noise $\tau$ because the large-context limit below applies
# it to the kernel's own Gaussian smoother, not only to the transition:

# %%
#| export
def gaussian_operator(scale:float,   # c in s -> c s + tau xi
                      tau:float,     # noise standard deviation tau
                      degree:int,    # highest degree D
                     )->torch.Tensor:  # (D + 1, D + 1) T with (T w)_m the coefficient of s^m in E[sum_j w_j (c s + tau xi)^j]
    "The map $f \\mapsto E[f(c s + \\tau\\xi)]$ on polynomial coefficients (monomial basis, upper triangular)."
    T = torch.zeros(degree + 1, degree + 1, dtype=torch.float64)
    for j in range(degree + 1):
        for m in range(j + 1): T[m, j] = math.comb(j, m) * scale ** m * tau ** (j - m) * gaussian_moment(j - m)
    return T


# %% [markdown]
# For degree 2, $E[(cs + \tau\xi)^2] = c^2 s^2 + \tau^2$ gives the last column, and with no
# noise and $c = 1$ the operator is the identity:

# %%
test_close(gaussian_operator(0.8, 0.6, 2)[:, 2],
           torch.tensor([0.36, 0., 0.64], dtype=torch.float64), eps=1e-15)
test_eq(gaussian_operator(1., 0., 3), torch.eye(4, dtype=torch.float64))


# %% [markdown]
# Rewards and values are then polynomials given by their coefficients, evaluated at many states at once:

# %%
#| export
def polyval(coef:torch.Tensor,  # (k,) coefficients, constant first
            s:torch.Tensor,     # (...) points
           )->torch.Tensor:     # (...) the polynomial at `s`
    "sum_j coef[j] s^j."
    s = as_tensor(s, "s")
    coef = as_tensor(coef, "coef", s.dtype)
    return s.unsqueeze(-1) ** torch.arange(len(coef), dtype=s.dtype) @ coef


# %%
test_eq(polyval([1., 2., 3.], torch.tensor([[0., 2.]], dtype=torch.float64)),
        torch.tensor([[1., 17.]], dtype=torch.float64))


# %%
#| export
class GaussianAR1(ContinuousProcess):
    "The AR(1) process S' = a S + sigma xi on the real line with a polynomial reward."
    d = 3          # features (s, s^2, 1)
    def __init__(self, a:float=0.8,                      # autoregression coefficient, |a| < 1
                 sigma:float=0.6,                        # noise standard deviation, > 0
                 gamma:float=0.9,                        # discount factor in [0, 1)
                 reward:tuple=(0., 1., 0., -1 / 3),      # polynomial coefficients of the reward, constant first
                ):
        a = check_number(a, "a")
        if not abs(a) < 1: raise ValueError(f"`a` must satisfy |a| < 1, got {a}")
        self.a, self.sigma, self.gamma = a, _positive(sigma, "sigma"), check_gamma(gamma)
        c = torch.as_tensor(np.asarray(reward, dtype=np.float64))
        if c.ndim != 1 or len(c) < 1 or not torch.isfinite(c).all(): raise ValueError(f"`reward` must be a non-empty 1-d sequence of finite coefficients, got {reward!r}")
        self.reward_coef, self.std = c, self.sigma / math.sqrt(1 - a ** 2)
        self.degree = len(c) - 1
        self.transition_matrix = gaussian_operator(a, self.sigma, self.degree)
        self.value_coef = torch.linalg.solve_triangular(torch.eye(self.degree + 1, dtype=torch.float64) - self.gamma * self.transition_matrix, c.unsqueeze(1), upper=True).squeeze(1)

    def __repr__(self): return f"GaussianAR1(a={self.a}, sigma={self.sigma}, gamma={self.gamma}, reward={tuple(self.reward_coef.tolist())})"
    def reward(self, states)->torch.Tensor: "r(s), a polynomial."; return polyval(self.reward_coef, states)
    def v_pi(self, states)->torch.Tensor: "The true value: the polynomial with coefficients (I - gamma T)^{-1} c."; return polyval(self.value_coef, states)

    def features(self, states)->torch.Tensor:
        "(..., 3) features (s, s^2, 1)."
        s = as_tensor(states, "states")
        return torch.stack([s, s ** 2, torch.ones_like(s)], -1)

    def step(self, states, rng:np.random.Generator)->np.ndarray:
        "One transition from each of `states` (numpy), drawn with `rng`."
        s = np.asarray(states, dtype=np.float64)
        return self.a * s + self.sigma * rng.standard_normal(s.shape)

    def stationary(self, size, rng:np.random.Generator)->np.ndarray:
        "Draws from the stationary law N(0, sigma^2 / (1 - a^2))."
        return self.std * rng.standard_normal(size)

    def grid(self, m:int=128)->tuple:
        "(states (m,), weights (m,)): equally spaced on [-4 std, 4 std], weighted by the stationary density."
        x = torch.linspace(-4 * self.std, 4 * self.std, _length(m, "m"), dtype=torch.float64)
        w = torch.exp(-x ** 2 / (2 * self.std ** 2))
        return x, w / w.sum()


# %%
show_doc(GaussianAR1)

# %%
ar = GaussianAR1()
S, R = ar.sample_trajectory(2000, seed=1)
test_eq((S.shape, R.shape), ((2001,), (2000,)))
test_close(R, S[:-1] - S[:-1] ** 3 / 3, eps=1e-12)
test_close(S.std().item(), ar.std, eps=0.1)
test_close(torch.corrcoef(torch.stack([S[:-1], S[1:]]))[0, 1].item(), ar.a, eps=0.05)
x, w = ar.grid(101)
test_close((w * x ** 2).sum().item(), ar.std ** 2, eps=1e-3)
test_eq(ar.features(torch.tensor([2.])), torch.tensor([[2., 4., 1.]], dtype=torch.float64))
test_close(GaussianAR1(reward=(1., 2.)).value_coef,
           torch.tensor([(1 / 0.1), 2 / (1 - 0.9 * 0.8)], dtype=torch.float64), eps=1e-12)
print(f"{ar}: value coefficients {[round(c, 4) for c in ar.value_coef.tolist()]}")


# %% [markdown]
# The linear check: for $r(x) = 1 + 2x$, $v_\pi(x) = \frac{1}{1-\gamma} + \frac{2}{1 - \gamma a}x$,
# read off $E[S_t \mid S_0 = x] = a^t x$.
#
# ### Checking the closed forms against Monte Carlo
#
# The closed forms are derivations, so we test them against the definition: from each of a few
# start states, simulate many independent paths for $H$ steps, with $\gamma^H$ below $10^{-8}$, and
# average the discounted returns. The closed form passes if every start state's Monte Carlo mean lies
# within $4.5$ standard errors of it (for a correct formula, the chance that one of eight states
# fails is about $5 \cdot 10^{-5}$). The same test must **reject** a wrong formula: we feed it the
# value the rotation would have without noise ($\sigma = 0$ in the closed form) and the AR(1) value
# with the noise moments dropped.

# %%
#| export
def mc_returns(process:ContinuousProcess, # a process of this chapter
               states,              # (m,) start states
               n_paths:int=4000,    # independent paths per start state
               tol:float=1e-8,      # the horizon H is the smallest with gamma^H < tol
               seed=None,           # int or `numpy.random.Generator`
              )->tuple:             # (mean (m,), standard error (m,)) of the discounted return from each start state
    "Monte Carlo estimate of $v_\\pi$ at `states`: the mean discounted return of `n_paths` simulated paths, with its standard error."
    rng, g = np.random.default_rng(seed), process.gamma
    s = np.repeat(np.asarray(as_tensor(states, "states"))[:, None], _length(n_paths, "n_paths"), 1)
    tol = check_number(tol, "tol", 0, strict=True, high=1, what="a number in (0, 1]")
    horizon = max(1, math.ceil(math.log(tol) / math.log(g))) if g > 0 else 1
    check_work(horizon, "steps", f"the Monte Carlo rollouts (gamma = {g}, tol = {tol:g})", "use a larger `tol` or a smaller gamma")
    G = np.zeros_like(s)
    for t in range(horizon):
        G += g ** t * process.reward(torch.from_numpy(s)).numpy()
        s = process.step(s, rng)
    return torch.from_numpy(G.mean(1)), torch.from_numpy(G.std(1, ddof=1) / math.sqrt(s.shape[1]))


# %% [markdown]
# The test statistic compares a candidate value with those returns in units of their standard
# error, one start state at a time; the cell after it runs it on the right and the wrong formulas.

# %%
#| export
def mc_z_scores(process:ContinuousProcess,  # a process of this chapter
                states:torch.Tensor,        # (m,) start states
                v:torch.Tensor,             # (m,) the candidate value at `states`
                **kwargs,                   # passed to `mc_returns` (n_paths, tol, seed)
               )->torch.Tensor:             # (m,) z-scores
    "|MC mean - v| / standard error at each state, for a candidate value `v` (m,)."
    mean, se = mc_returns(process, states, **kwargs)
    return (mean - as_tensor(v, "v")).abs() / se


# %%
starts_rot = torch.linspace(0, 2 * math.pi, 8, dtype=torch.float64)[:-1] + 0.3
starts_ar = torch.linspace(-2, 2, 8, dtype=torch.float64)
no_noise = NoisyRotation(sigma=1e-9, reward="cos")
noise_free_ar = GaussianAR1(sigma=1e-9)
z = {"rotation, square reward": mc_z_scores(rot, starts_rot, rot.v_pi(starts_rot), seed=10),
     "rotation, cos reward": mc_z_scores(cosine, starts_rot, cosine.v_pi(starts_rot), seed=11),
     "AR(1), cubic reward": mc_z_scores(ar, starts_ar, ar.v_pi(starts_ar), seed=12),
     "rotation, cos reward, WRONG (noise-free) value":
         mc_z_scores(cosine, starts_rot, no_noise.v_pi(starts_rot), seed=11),
     "AR(1), WRONG (noise-free) value": mc_z_scores(ar, starts_ar, noise_free_ar.v_pi(starts_ar),
                                                    seed=12)}
for k, zk in z.items():
    if "WRONG" in k: assert zk.max() > 4.5, (k, zk)
    else: assert zk.max() < 4.5, (k, zk)
record_claim("closed-forms",
             "The closed-form values of the noisy rotation and of the Gaussian AR(1) agree with "
             "Monte Carlo returns (every z-score below 4.5), and wrong formulas are rejected.",
             "measured", "continuous", "#checking-the-closed-forms-against-monte-carlo")
Markdown("| process and value | largest z-score |\n|---|---|\n"
         + "\n".join(f"| {k} | {v.max().item():.2f} |" for k, v in z.items()))


# %% [markdown]
# The largest z-score over the start states is below 4.5 for each closed form, and far above it for the
# wrong ones. (`tests/test_continuous.py` repeats this on other parameters and seeds, and checks the
# Bellman equation $v = r + \gamma P v$ by Gauss-Hermite quadrature of the noise.)

# %% [markdown]
# ## The kernels a Transformer computes
#
# The constructed Transformer of the [dual-head chapter](dual_head.html) scores key $S_{k-1}$ for a
# target $x$ by $g(S_{k-1}, x) = \phi(S_{k-1})^\top W \phi(x)$ and weighs the TD error of transition
# $k$ by $K_k(x) = e^{g(S_{k-1}, x)} / \sum_{k'} e^{g(S_{k'-1}, x)}$. Two choices of $W$ turn this
# into a classical smoothing kernel.
#
# ::: {.proposition}
# **Proposition 8.1 [ours].** (a) On the circle with $\phi(x) = (\cos x, \sin x)$ and $W = \beta I$,
# $g(y, x) = \beta\cos(x - y)$, so $K_k(x) \propto e^{\beta\cos(x - S_{k-1})}$: the **von Mises
# kernel** with concentration $\beta$ (close to a Gaussian in the angle with variance $1/\beta$
# when $\beta$ is large). (b) On the line with $\phi(x) = (x, x^2, 1)$ and
#
# $$W_\beta = \beta\begin{bmatrix} 1 & 0 & 0\\ 0 & 0 & -\tfrac12\\ 0 & -\tfrac12 & 0\end{bmatrix},$$
#
# $g(y, x) = -\tfrac{\beta}{2}(x - y)^2$, so $K_k(x) \propto e^{-\beta (x - S_{k-1})^2/2}$: the
# **Gaussian kernel** with bandwidth $1/\sqrt\beta$.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# (a) $\beta(\cos y\cos x + \sin y \sin x) = \beta\cos(x - y)$. (b)
# $\phi(y)^\top W_\beta \phi(x) = \beta\,y x - \tfrac\beta2 y^2\cdot 1 - \tfrac\beta2\cdot 1\cdot x^2
# = -\tfrac\beta2 (x - y)^2$. In both cases $K_k$ is the normalised kernel by definition of the
# softmax. $\square$
# :::
#
# So the Transformer, with its parameters $\theta^*(W, \alpha, \gamma)$ unchanged, runs **kernel TD**
# (Nadaraya-Watson weighting of TD errors) with a bandwidth set by the scale $\beta$ of $W$. The
# AR(1) case needs the constant feature: the score is bilinear in the features, and a squared
# distance is bilinear only in $(x, x^2, 1)$. `score_matrix(beta)` returns each process's $W$.

# %%
#| export
@patch
def score_matrix(self:NoisyRotation, beta:float)->torch.Tensor:
    "W = beta I: the von Mises kernel of concentration beta on (cos s, sin s)."
    return check_number(beta, "beta", 0., strict=True) * torch.eye(2, dtype=torch.float64)


# %%
test_eq(NoisyRotation().score_matrix(3.), 3 * torch.eye(2, dtype=torch.float64))


# %% [markdown]
# On the line the matrix is Proposition 8.1(b)'s $W_\beta$; the check evaluates the bilinear score
# of a few pairs of states and compares it with $-\beta(x - y)^2/2$:

# %%
#| export
@patch
def score_matrix(self:GaussianAR1, beta:float)->torch.Tensor:
    "W_beta with (s, s^2, 1)^T W_beta (t, t^2, 1) = -beta (s - t)^2 / 2: the Gaussian kernel of bandwidth 1/sqrt(beta)."
    b = check_number(beta, "beta", 0., strict=True)
    return torch.tensor([[b, 0., 0.], [0., 0., -b / 2], [0., -b / 2, 0.]], dtype=torch.float64)


# %%
ys, xs = torch.tensor([-1., 0.5, 2.],
                      dtype=torch.float64), torch.tensor([0.3, -2., 1.], dtype=torch.float64)
test_close(ar.features(ys) @ ar.score_matrix(3.) @ ar.features(xs).T,
           -1.5 * (xs[None] - ys[:, None]) ** 2, eps=1e-13)

# %% [markdown]
# **A worked example.** Four transitions on the circle whose keys sit at the angles
# $S_0..S_3 = 0, \pi/2, \pi, 3\pi/2$ (the last state $S_4$ is not a key), the target $x = 0$ and
# $W = 2I$. The scores $\beta\cos(x - S_{k-1})$ are $2, 0, -2, 0$, so the weights are
# $e^{2}, 1, e^{-2}, 1$ divided by their sum $e^2 + 2 + e^{-2}$: the key at the target gets most of the
# weight, the opposite key the least, and the two keys a quarter turn away get equal weights. The
# cell computes the weights by this formula and by the library's softmax weights from the features
# and $W$, and checks that they agree:

# %%
S_ex = torch.tensor([0., math.pi / 2, math.pi, 3 * math.pi / 2, 0.3], dtype=torch.float64)
by_hand = torch.tensor([math.e ** 2, 1., math.e ** -2, 1.],
                       dtype=torch.float64) / (math.e ** 2 + 2 + math.e ** -2)
w_ex = context_weights(rot.features(S_ex), rot.score_matrix(2.),
                       rot.features(torch.zeros(1, dtype=torch.float64)))[:, -1]
test_close(w_ex, by_hand, eps=1e-12)
header = "| key $S_{k-1}$ | score $2\\cos(0 - S_{k-1})$ | weight $K_k(0)$ |\n|---|---|---|\n"
Markdown(header + "\n".join(
    f"| ${a}$ | {g:g} | {w:.4f} |" for a, g, w in zip(["0", "\\pi/2", "\\pi", "3\\pi/2"],
                                                      [2, 0, -2, 0], w_ex.tolist())))


# %%
#| export
def kernel_td(process:ContinuousProcess, # a process of this chapter
              states:torch.Tensor,  # (..., n + 1) states S_0..S_n
              rewards:torch.Tensor, # (..., n) rewards, rewards[..., k-1] = R_k
              *,                    # the rest by keyword: alpha and beta are two floats easily swapped
              alpha:float,          # step size
              beta:float,           # kernel scale: W = process.score_matrix(beta)
              n_layers:int,         # depth L (number of TD iterations)
              queries:torch.Tensor, # (q,) or (..., q) query states
              return_all:bool=False,  # return v_0..v_L instead of v_L
             )->torch.Tensor:       # (..., q) estimates at the queries; (..., L + 1, q) with `return_all`
    "Weighted softmax TD with the process's kernel, read out at the query states: what the constructed Transformer computes."
    S, n_layers = as_tensor(states, "states"), check_int(n_layers, "n_layers")
    if S.ndim < 1 or S.shape[-1] < 2: raise ValueError(f"`states` must have shape (..., n + 1) with n >= 1, got {tuple(S.shape)}")
    phi, R = process.features(S), as_tensor(rewards, "rewards")
    Q = process.features(queries).to(phi)
    if Q.ndim == 2 and phi.ndim > 2: Q = Q.expand(phi.shape[:-2] + Q.shape)
    n = phi.shape[-2] - 1
    W = process.score_matrix(beta).to(phi)
    return weighted_softmax_td(phi, R, W, alpha=alpha, gamma=process.gamma, n_iters=n_layers, phi_queries=Q, return_all=return_all)[..., n + 1:]


# %%
show_doc(kernel_td)


# %% [markdown]
# The identities, checked to rounding error on sampled trajectories (the weights computed by the
# library from features and $W$, against the kernels computed directly from the states); then the
# Transformer itself, `SoftmaxICTD.from_theta_star` on the prompt of `build_prompt`, against
# `kernel_td`, for several depths, on both processes, in float64. The experiments of the next chapter use
# `kernel_td`, which is faster and, by this check, the same function.

# %%
def direct_weights(kernel, keys, targets):
    K = kernel(keys[:, None] - targets[None, :])
    return K / K.sum(0)

von_mises_8 = lambda u: torch.exp(8. * torch.cos(u))
gaussian_8 = lambda u: torch.exp(-8. * u ** 2 / 2)
for proc, kernel in [(rot, von_mises_8), (ar, gaussian_8)]:
    S, R = proc.sample_trajectory(300, seed=2)
    queries = proc.grid(16)[0]
    lib = context_weights(proc.features(S), proc.score_matrix(8.), proc.features(queries))
    test_close(lib, direct_weights(kernel, S[:-1], torch.cat([S, queries])), eps=1e-12)
    for L in (1, 7, 30):
        tf = SoftmaxICTD.from_theta_star(proc.d, proc.score_matrix(8.), n_layers=L, alpha=0.8,
                                         gamma=proc.gamma)
        Z = build_prompt(proc.features(S), R, proc.features(queries))
        test_close(tf.predict(Z, n=300),
                   kernel_td(proc, S, R, beta=8., alpha=0.8, n_layers=L, queries=queries),
                   eps=1e-11)
gap = (tf.predict(Z, n=300) - kernel_td(ar, S, R, beta=8., alpha=0.8, n_layers=30,
                                        queries=queries)).abs().max().item()
assert gap < 1e-11
record_claim("kernel-td",
             "With $\\theta^*$ and the score matrices of Proposition 8.1, the softmax Transformer "
             "runs kernel TD with a von Mises kernel on the circle and a Gaussian kernel on the "
             "line (checked to 1e-11 in float64).",
             "proved", "continuous", "#the-kernels-a-transformer-computes")
print("largest gap between the Transformer and kernel TD (AR(1), 30 layers): below 1e-11")


# %% [markdown]
# ## What the large-context limit predicts
#
# As $n \to \infty$ with a stationary context, the softmax average over keys becomes an average
# over the stationary law $d$: $K_k(x)$ tends to the **population smoother**
# $M(x, dy) = d_\pi(y)h(y, x)\,dy / \int d_\pi(z)h(z, x)\,dz$ (with $h = e^g$ the kernel), and since
# $E[\delta_k \mid S_{k-1} = y] = r(y) + \gamma (Pv)(y) - v(y)$, the layer recursion becomes
#
# $$v_{l+1} = v_l + \alpha M (r + \gamma P v_l - v_l),$$
#
# the continuous-state version of the recursion of the [convergence chapter](convergence.html)
# (we argue the limit by the ergodic theorem, key by key, and check it by measurement in the [next
# chapter](continuous_experiments.html#error-against-depth); a
# uniform convergence proof is beyond this chapter). Both processes make $M$ and $P$ simple.
#
# - **Circle.** $d_\pi$ is uniform and the von Mises kernel depends on $x - y$ only, so $M$ is a
#   convolution: $M e^{ikx} = \mu_k e^{ikx}$ with $\mu_k = I_k(\beta)/I_0(\beta)$ (modified
#   Bessel functions), the Fourier coefficients of the normalised von Mises density; and
#   $P e^{ikx} = p_k e^{ikx}$. The recursion acts harmonic by harmonic:
#   $v_l = \mathrm{Re}\sum_k v_k\,(1 - b_k^{\,l})\,e^{ikx}$ with $v_k = r_k/(1 - \gamma p_k)$ and
#   $b_k = 1 - \alpha\mu_k(1 - \gamma p_k)$, the eigenvalues of the error matrix
#   $B = I - \alpha M(I - \gamma P)$ of [chapter 5](convergence.html).
# - **AR(1).** The product of the normal stationary density $N(0, \sigma_\infty^2)$ and the Gaussian
#   kernel is normal in $y$: $M f(x) = E[f(a_M x + \sigma_M\xi)]$ with $a_M = \beta \sigma_\infty^2 / (1 + \beta
#   \sigma_\infty^2)$ and $\sigma_M^2 = \sigma_\infty^2 / (1 + \beta \sigma_\infty^2)$. Like $P$, it is a triangular
#   map on polynomial coefficients, with diagonal $a_M^j$; the recursion stays among polynomials of
#   the reward's degree, and its eigenvalues are $b_j = 1 - \alpha a_M^j (1 - \gamma a^j)$.
#
# ::: {.proposition}
# **Proposition 8.2 [ours].** For $0 < \alpha \le 1$ and every $\beta > 0$, the population recursion
# converges to $v_\pi$ on both processes: there is **no smoothing bias** in the limit. Each harmonic
# $k$ (each degree $j$) converges geometrically at rate $|b_k|$ ($|b_j|$). On the circle
# $\mu_k \to 0$ as $k \to \infty$, so the rates approach 1: there is no uniform rate, and a
# value with high harmonics (the square wave) needs depth to resolve them.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Circle: $0 < \mu_k \le 1$ (the von Mises density is positive and has positive Fourier
# coefficients $I_k(\beta) > 0$), so $|b_k| \le 1 - \alpha\mu_k + \alpha\mu_k\gamma|p_k| < 1$
# and $v_l$'s coefficient $v_k(1 - b_k^l) \to v_k$, the coefficient of $v_\pi$. AR(1): the error
# $\mathbf v_l - \mathbf v_\pi$ of the coefficients is multiplied by the triangular matrix
# $I - \alpha \mathcal T_M(I - \gamma \mathcal T_P)$ whose eigenvalues are its diagonal entries $b_j$,
# with $0 < \alpha a_M^j(1 - \gamma a^j) < \alpha a_M^j (1 + \gamma) < 2$, so $|b_j| < 1$ and the
# error vanishes geometrically. $\square$
# :::
#
# `population_values` computes $v_0..v_L$ of this recursion at any states, in closed form.

# %%
#| export
def von_mises_harmonics(beta:float,    # concentration
                        k_max:int,     # highest harmonic
                       )->torch.Tensor:  # (k_max + 1,) mu_k = I_k(beta) / I_0(beta), k = 0..k_max
    "Fourier coefficients of the normalised von Mises density, by the FFT of $e^{\\beta(\\cos t - 1)}$ on a fine grid."
    beta, k_max = check_number(beta, "beta", 0., strict=True), check_int(k_max, "k_max", 1)
    m = 2 ** math.ceil(math.log2(max(4 * k_max, 64 * math.sqrt(beta) + 64)))
    t = torch.arange(m, dtype=torch.float64) * (2 * math.pi / m)
    F = torch.fft.rfft(torch.exp(beta * (torch.cos(t) - 1))).real
    return (F / F[0])[:k_max + 1].clamp(min=0.)


# %%
#| export
@patch
def population_values(self:NoisyRotation, beta:float, alpha:float, n_layers:int, states)->torch.Tensor:
    "(L + 1, m) values v_0..v_L of the population recursion at `states` (harmonic by harmonic)."
    s, alpha, n_layers = as_tensor(states, "states"), check_number(alpha, "alpha"), check_int(n_layers, "n_layers")
    k_max = 1 if self.reward_kind == "cos" else max(1, math.ceil(math.sqrt(80 * check_number(beta, "beta", 0., strict=True))) + 1)
    k, c = self.reward_harmonics(k_max)
    p, lam = self.transition_eigenvalues(k), von_mises_harmonics(beta, k_max)[1:]
    f = 1 - alpha * lam * (1 - self.gamma * p)
    learned = 1 - f ** torch.arange(n_layers + 1, dtype=torch.float64).unsqueeze(1)   # (L + 1, K)
    return ((learned * c / (1 - self.gamma * p)) @ torch.exp(1j * k.unsqueeze(1) * s)).real


# %% [markdown]
# On the line the same recursion runs on polynomial coefficients: the kernel's smoother of
# concentration $\beta$ under the stationary law $N(0, \sigma_\infty^2)$ is the Gaussian operator
# with $c = \beta\sigma_\infty^2/(1 + \beta\sigma_\infty^2)$ and $\tau^2 = \sigma_\infty^2/(1 + \beta\sigma_\infty^2)$.
# Both versions are checked together in the cell after it.

# %%
#| export
@patch
def population_values(self:GaussianAR1, beta:float, alpha:float, n_layers:int, states)->torch.Tensor:
    "(L + 1, m) values v_0..v_L of the population recursion at `states` (on polynomial coefficients)."
    b, s2 = check_number(beta, "beta", 0., strict=True), self.std ** 2
    alpha, n_layers = check_number(alpha, "alpha"), check_int(n_layers, "n_layers")
    T_M = gaussian_operator(b * s2 / (1 + b * s2), math.sqrt(s2 / (1 + b * s2)), self.degree)
    I = torch.eye(self.degree + 1, dtype=torch.float64)
    w, ws = torch.zeros(self.degree + 1, dtype=torch.float64), []
    for _ in range(n_layers + 1):
        ws.append(w)
        w = w + alpha * T_M @ (self.reward_coef + (self.gamma * self.transition_matrix - I) @ w)
    return torch.stack([polyval(x, states) for x in ws])


# %% [markdown]
# Checks: the population
# recursion at large depth equals $v_\pi$; its first step is $\alpha M r$, computed for the AR(1)
# by quadrature of the Gaussian smoother; and the AR(1) rates are the diagonal entries above.

# %%
for proc in (cosine, ar):
    x, _ = proc.grid(64)
    test_close(proc.population_values(10., 1., 2000, x)[-1], proc.v_pi(x), eps=1e-9)
def grid_recursion(proc, beta, alpha, L, m=2048):
    "The population recursion on the circle, P and M as m x m matrices (no Fourier series)."
    # off the reward's jumps at 0 and pi
    x = proc.grid(m)[0] + math.pi / m
    u = (x[None, :] - x[:, None] + math.pi) % (2 * math.pi) - math.pi      # y - x, wrapped
    P = sum(torch.exp(-(u - proc.mu + 2 * math.pi * j) ** 2 / (2 * proc.sigma ** 2))
            for j in (-1, 0, 1))
    P, M = P / P.sum(1, keepdim=True), torch.softmax(beta * torch.cos(u), 1)
    v = torch.zeros(m, dtype=torch.float64)
    for _ in range(L): v = v + alpha * M @ (proc.reward(x) + proc.gamma * P @ v - v)
    return x, v
x, v_grid = grid_recursion(rot, 10., 0.8, 12)
test_close(rot.population_values(10., 0.8, 12, x)[-1], v_grid, eps=2e-3)
nodes, hw = np.polynomial.hermite_e.hermegauss(40)
b, s2 = 2., ar.std ** 2
c_m, tau = b * s2 / (1 + b * s2), math.sqrt(s2 / (1 + b * s2))
x = torch.linspace(-2, 2, 5, dtype=torch.float64)
quad_states = c_m * x[:, None] + tau * torch.from_numpy(nodes)
quad_weights = torch.from_numpy(hw / hw.sum())
Mr = (ar.reward(quad_states) * quad_weights).sum(1)
test_close(ar.population_values(b, 0.7, 1, x)[1], 0.7 * Mr, eps=1e-12)
mu_rot = von_mises_harmonics(10., 3)[1:]
f_rot = (1 - mu_rot * (1 - 0.9 * rot.transition_eigenvalues(torch.arange(1., 4.)))).abs()
order = ["first", "second", "third"]
fastest, slowest = order[f_rot.argmin()], order[f_rot.argmax()]
record_claim("population-limit",
             "In the large-context limit, kernel TD with $0 < \\alpha \\le 1$ converges to "
             "$v_\\pi$ with no smoothing bias, each harmonic or polynomial degree at its own "
             "geometric rate (Proposition 8.2).",
             "proved", "continuous", "#what-the-large-context-limit-predicts")
Markdown(f"$|b_k|$ for $k = 1, 2, 3$: {', '.join(f'{f:.3f}' for f in f_rot.tolist())}. With "
         f"$\\beta = 10$ and "
         f"$\\alpha = 1$ the {fastest} harmonic converges fastest per layer and the {slowest} "
         f"slowest: over these "
         "three, $|1 - \\gamma p_k|$ grows with $k$ faster than $\\mu_k$ shrinks.")


# %% [markdown]
# The ordering does not persist: $\mu_k \to 0$ as $k$ grows, so the rate $|b_k|$ of harmonic $k$
# tends to 1, and the highest harmonics of the reward are the slowest to converge.

# %% [markdown]
# The next chapter measures errors against this limit; `population_msve` is its MSVE at each depth.
# With the cosine reward only the first harmonic is present, so the population MSVE falls exactly
# at the rate $|b_1|^2$ per layer: the check below reads $|b_1|$ off the curve.

# %%
#| export
def population_msve(process:ContinuousProcess, *, alpha:float, beta:float, n_layers:int, m:int=512)->torch.Tensor:
    "(L + 1,) MSVE of the population recursion at depths 0..L."
    return process.msve(process.population_values(beta, alpha, n_layers, process.grid(m)[0]))


# %%
pop_cos = population_msve(cosine, beta=5., alpha=1., n_layers=40)
f_1 = (1 - von_mises_harmonics(5.,
                               1)[1] * (1 - cosine.gamma * cosine.transition_eigenvalues(1.))).abs()
test_close((pop_cos[40] / pop_cos[20]) ** (1 / 40), f_1, eps=1e-9)
f_1.item()

# %% [markdown]
# ## A fixed point that is the return chain
#
# On a finite chain, the fixed point of the Transformer's iteration at a given context is the
# certainty-equivalence value of the context's empirical MRP (the [weighted softmax TD
# chapter](weighted_softmax_td.html)). With continuous states no state is ever visited twice, and
# that limit degenerates: the fixed point below is the certainty-equivalence value of the empirical
# MRP in which every state is visited once and $S_n$ is never left (chapter 1's case without its
# hypothesis; chapter 1's Proposition 1.8 covers the general fixed point).
#
# ::: {.proposition}
# **Proposition 8.3 [ours].** If the states $S_0..S_{n-1}$ are distinct and the kernel is strictly
# positive definite (both kernels above are), every fixed point of weighted softmax TD on the context
# has all TD errors zero, $v(S_{k-1}) = R_k + \gamma v(S_k)$ for $k = 1..n$: the trajectory's own
# discounted return, with $v(S_n)$ free.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# At a fixed point $\sum_k K_k(S_j)\,\delta_k = 0$ for the targets $j = 0..n-1$. The matrix
# $K_k(S_j) = h(S_{k-1}, S_j)/\sum_{k'} h(S_{k'-1}, S_j)$ is the Gram matrix of distinct
# points times a positive diagonal, hence invertible, so $\delta = 0$. $\square$
# :::
#
# The statement holds in exact arithmetic. In float64 a wide kernel's Gram matrix is singular to
# working precision already at short contexts, and then round-off, not the proposition, decides
# which nearby point the iterates settle on. The condition number of the
# Gram matrix $[h(S_i, S_j)]_{i,j<n}$ on the circle, $n = 30$ (what this fixed point means
# for the depth of a Transformer is measured in the [next chapter](continuous_experiments.html)):

# %%
S_gram = rot.sample_trajectory(30, seed=3)[0][:-1]
gram_gap = torch.cos(S_gram[:, None] - S_gram[None, :]) - 1
gram_cond = {b: torch.linalg.cond(torch.exp(b * gram_gap)).item() for b in (1., 10., 100., 1000.)}
assert gram_cond[1.] > 1e12 and gram_cond[1000.] < 1e6, gram_cond
record_claim("return-chain",
             "On a context of distinct states, every fixed point of weighted softmax TD with a "
             "strictly positive definite kernel is the trajectory's own return chain (Proposition "
             "8.3).",
             "proved", "continuous", "#a-fixed-point-that-is-the-return-chain")
Markdown("Condition number of the Gram matrix at $n = 30$: " + "; ".join(
    rf"$\beta = {b:g}$: " + ("above $10^{12}$" if c > 1e12 else f"{c:.1e}")
    for b, c in gram_cond.items()) + ".")


# %% [markdown]
# ## Continuous task families for pretraining {.deep-dive}
#
# ::: {.callout-note}
# **This section is the project's own construction [ours].** The paper pretrains on Boyan chains
# only; the task families and the training on continuous trajectories are ours.
# :::
#
# The [pretraining chapter](pretrain.html) trains the softmax Transformer by multi-task
# semi-gradient TD on random Boyan chains and asks whether $\theta^*$ emerges: value-row weights
# (reward, successor value, current value) with the pattern $(+, +, -)$ of $\theta^*$, successor over
# current near $-\gamma$, and a diagonal kernel. With continuous states no two keys share a state,
# so "diagonal" has no meaning; the question becomes **whether the score block $A_{:d,:d}$ learns a
# kernel of Proposition 8.1** ($\beta I$ on $(\cos x, \sin x)$, $W_\beta$ on $(x, x^2, 1)$), and with
# which bandwidth.
#
# Each training example is a context of a *new* process, whose parameters are drawn afresh, so that
# nothing about a task can be memorised and values must be read from the context:
#
# - **rotation family**: $\vartheta \sim U(-1, 1)$, $\sigma \sim U(0.2, 0.5)$, reward
#   $r_0 + \mathrm{sign}\sin(x - \varphi)$ with phase $\varphi \sim U(0, 2\pi)$ and level
#   $r_0 \sim U(-1, 1)$, so $v_\pi(x) = \frac{r_0}{1-\gamma} + v^{\mathrm{square}}_\pi(x - \varphi)$.
#   Why the level: without it every task's value is odd about a half turn,
#   $v_\pi(x + \pi) = -v_\pi(x)$ (the square wave has odd harmonics only), so a kernel of negative
#   scale (peaked at the antipode) with a negated reward weight predicts exactly as well as
#   $\beta I$, and the sign of a learned kernel would not be identified;
# - **AR(1) family**: $a \sim U(0.5, 0.9)$ and $\sigma = \sqrt{1 - a^2}$, so the stationary law is
#   $N(0, 1)$ for every task and the features share one scale; the reward is a random cubic
#   $\sum_{j \le 3} r_j\,\mathrm{He}_j(x)/\sqrt{j!}$ with $r_j \sim U(-1, 1)$.
#
# `RotationFamily` and `GaussianAR1Family` draw tasks from a `torch.Generator`, sample a stationary
# context, a stationary query $x_q$ and its successor $x_q'$ per task, and give every task's
# closed-form value through the processes above.

# %%
#| export
def _uniform(bounds, size, gen)->torch.Tensor:
    lo, hi = bounds
    return lo + (hi - lo) * torch.rand(size, generator=gen, dtype=torch.float64)

def _range(bounds, name:str, low=-math.inf)->tuple:
    try: lo, hi = (float(b) for b in bounds)
    except (TypeError, ValueError): raise ValueError(f"`{name}` must be a pair (low, high), got {bounds!r}") from None
    if not (low <= lo <= hi < math.inf): raise ValueError(f"`{name}` must satisfy {low:g} <= low <= high < inf, got {bounds!r}")
    return lo, hi

TASK_SETS = ("held_out", "tune", "test")   # the named task sets of a family: sub-streams 0, 1, 2 of their root seed

class TaskFamily:
    "Random processes of one kind sharing features, grid and kernel form; subclasses define `draw`, `sample`, `reward`, `v_pi`."
    def features(self, states)->torch.Tensor: "The features of `self.base`."; return self.base.features(states)

    def contexts(self, n_tasks:int,   # number of tasks
                 n:int,               # context length
                 seed:int=0,          # the root seed of the task sets
                 which:str="held_out", # the task set, one of `TASK_SETS`: its own sub-stream of `seed`
                 m:int=64,            # grid points of the MSVE
                )->dict:              # states (E, n + 1), rewards (E, n), grid x (m,), weights w (m,), true values v (E, m)
        "The tasks of one named set, one stationary context each, and their true values on the grid."
        gen = stream_generator(seed, TASK_SETS.index(check_choice(which, TASK_SETS, "which")))
        tasks, states, _, _ = self.sample(check_int(n_tasks, "n_tasks", 1), check_int(n, "n", 1), gen)
        x, w = self.base.grid(m)
        return dict(states=states, rewards=self.reward(tasks, states[:, :-1]), x=x, w=w, v=self.v_pi(tasks, x))


# %% [markdown]
# A family fixes the features, the grid and the form of the kernel (its `base` process), and
# varies everything else from task to task; `contexts` is documented with the task sets in
# [Implementation and tests](#task-sets-and-the-engines-protocol). The rotation family draws its
# four parameters per task, and each task's value is $r_0/(1-\gamma)$ plus a shifted square-wave value:

# %%
#| export
def _per_task(x, states): return x.reshape(-1, *[1] * (states.ndim - 1))

class RotationFamily(TaskFamily):
    "Noisy rotations with random drift and noise, and a square-wave reward with random phase and level."
    d = 2
    def __init__(self, mu:tuple=(-1., 1.),      # range of the drift mu (radians per step)
                 sigma:tuple=(0.2, 0.5),        # range of the noise sigma (radians per step), >= 0.01
                 level:tuple=(-1., 1.),         # range of the reward level b
                 gamma:float=0.9,               # discount factor
                ):
        self.mu, self.sigma, self.level = _range(mu, "mu"), _range(sigma, "sigma", 0.01), _range(level, "level")
        self.base, self.gamma = NoisyRotation(gamma=gamma), check_gamma(gamma)
        self.kernel_mask = torch.ones(2, 2, dtype=torch.float64)   # every entry of A[:2, :2] changes the weights

    def __repr__(self): return f"RotationFamily(mu={self.mu}, sigma={self.sigma}, level={self.level}, gamma={self.gamma})"

    def draw(self, B:int, gen)->dict:
        "Parameters of B tasks: mu, sigma, phase, level, each (B,)."
        return dict(mu=_uniform(self.mu, B, gen), sigma=_uniform(self.sigma, B, gen), phase=_uniform((0, 2 * math.pi), B, gen), level=_uniform(self.level, B, gen))

    def sample(self, B:int, n:int, gen)->tuple:
        "(tasks, states (B, n + 1), query (B,), successor (B,)): a new task per row, a stationary context, query and successor."
        t = self.draw(B, gen)
        u = torch.rand(B, 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
        steps = t["mu"][:, None] + t["sigma"][:, None] * torch.randn(B, n + 1, generator=gen, dtype=torch.float64)
        states = (u[:, :1] + torch.cat([steps.new_zeros(B, 1), steps[:, :n].cumsum(-1)], -1)) % (2 * math.pi)
        return t, states, u[:, 1], (u[:, 1] + steps[:, n]) % (2 * math.pi)

    def reward(self, tasks:dict, states)->torch.Tensor:
        "r(s) = level + sign(sin(s - phase)) of each task (states (B, ...))."
        return _per_task(tasks["level"], states) + torch.sign(torch.sin(states - _per_task(tasks["phase"], states)))

    def v_pi(self, tasks:dict, x)->torch.Tensor:
        "(B, m) true values of each task at the points x (m,): level / (1 - gamma) plus the shifted square-wave value."
        return torch.stack([lv / (1 - self.gamma) + NoisyRotation(mu, sg, self.gamma).v_pi((x - ph) % (2 * math.pi))
                            for mu, sg, ph, lv in zip(*(tasks[k].tolist() for k in ("mu", "sigma", "phase", "level")))])


# %%
show_doc(RotationFamily)

# %% [markdown]
# The AR(1) family draws its cubic in the probabilists' Hermite basis $\mathrm{He}_j/\sqrt{j!}$,
# orthonormal under $N(0, 1)$, so that the four coefficients weigh equally in the reward's size
# whatever $a$; `HERMITE` holds that basis in monomial coefficients, and the check below verifies
# its orthonormality by Gauss-Hermite quadrature:

# %%
#| export
HERMITE = torch.tensor([[1., 0., 0., 0.], [0., 1., 0., 0.], [-1., 0., 1., 0.], [0., -3., 0., 1.]], dtype=torch.float64) / torch.tensor([1., 1., math.sqrt(2), math.sqrt(6)], dtype=torch.float64)[:, None]

class GaussianAR1Family(TaskFamily):
    "AR(1) processes with random a, stationary law N(0, 1), and a random cubic reward in the Hermite basis."
    d = 3
    def __init__(self, a:tuple=(0.5, 0.9),      # range of the autoregression coefficient, inside (-1, 1)
                 coef:float=1.,                 # Hermite coefficients c_j ~ U(-coef, coef), j = 0..3
                 gamma:float=0.9,               # discount factor
                ):
        self.a, self.coef = _range(a, "a", -1 + 1e-9), check_number(coef, "coef", 0., strict=True)
        if self.a[1] >= 1: raise ValueError(f"`a` must lie inside (-1, 1), got {a!r}")
        self.base, self.gamma = GaussianAR1(a=0.8, sigma=0.6, gamma=gamma), check_gamma(gamma)
        self.kernel_mask = torch.tensor([[1.] * 3, [1.] * 3, [0.] * 3], dtype=torch.float64)   # the key's constant feature (row 2) only shifts all scores of a query

    def __repr__(self): return f"GaussianAR1Family(a={self.a}, coef={self.coef}, gamma={self.gamma})"

    def draw(self, B:int, gen)->dict:
        "Parameters of B tasks: a (B,) and the reward's monomial coefficients c (B, 4)."
        return dict(a=_uniform(self.a, B, gen), c=(2 * torch.rand(B, 4, generator=gen, dtype=torch.float64) - 1) * self.coef @ HERMITE)

    def sample(self, B:int, n:int, gen)->tuple:
        "(tasks, states (B, n + 1), query (B,), successor (B,)): a new task per row, a stationary context, query and successor."
        t = self.draw(B, gen)
        a, xi = t["a"], torch.randn(B, n + 3, generator=gen, dtype=torch.float64)
        sig, s = (1 - a ** 2).sqrt(), [xi[:, 0]]
        for k in range(n): s.append(a * s[-1] + sig * xi[:, k + 1])
        return t, torch.stack(s, -1), xi[:, n + 1], a * xi[:, n + 1] + sig * xi[:, n + 2]

    def reward(self, tasks:dict, states)->torch.Tensor:
        "r(s), each task's cubic (states (B, ...))."
        c = tasks["c"].reshape(len(tasks["c"]), *[1] * (states.ndim - 1), 4)
        return (states.unsqueeze(-1) ** torch.arange(4, dtype=states.dtype) * c).sum(-1)

    def v_pi(self, tasks:dict, x)->torch.Tensor:
        "(B, m) true values of each task at the points x (m,)."
        return torch.stack([GaussianAR1(a, math.sqrt(1 - a ** 2), self.gamma, tuple(c)).v_pi(x) for a, c in zip(tasks["a"].tolist(), tasks["c"].tolist())])


# %%
gh_x, gh_w = np.polynomial.hermite_e.hermegauss(8)
He = HERMITE @ torch.from_numpy(gh_x) ** torch.arange(4.)[:, None]
test_close((He * torch.from_numpy(gh_w / gh_w.sum())) @ He.T, torch.eye(4, dtype=torch.float64),
           eps=1e-13)


# %% [markdown]
# To check a family's values against Monte Carlo, `task_process` turns one drawn task into an
# object `mc_returns` can simulate.

# %%
#| export
def task_process(family:TaskFamily,  # the family the task was drawn from
                 task:dict,          # one task, `family.draw(1, gen)`
                )->ContinuousProcess: # with gamma, reward(states) and step(states, rng)
    "One task of a family as a process `mc_returns` can simulate."
    reward = lambda s: family.reward(task, s.reshape(1, -1)).reshape(s.shape)
    if isinstance(family, RotationFamily):
        mu, sg = task["mu"].item(), task["sigma"].item()
        return _DrawnTask(family.gamma, reward, lambda s, rng: np.mod(s + mu + sg * rng.standard_normal(s.shape), 2 * np.pi))
    a = task["a"].item()
    return _DrawnTask(family.gamma, reward, lambda s, rng: a * s + math.sqrt(1 - a * a) * rng.standard_normal(s.shape))

class _DrawnTask(ContinuousProcess):
    "One drawn task of a family: its discount, reward function and transition, all `mc_returns` simulates."
    def __init__(self, gamma:float, reward, step): self.gamma, self.reward, self.step = gamma, reward, step


# %% [markdown]
# Checks: the sampled transitions have each task's drift and noise (rotation) or autoregression
# (AR(1)); the values solve each task's Bellman equation, checked by Monte Carlo returns of single
# tasks drawn from the family (z-scores as in the Monte Carlo section); bad ranges are refused.

# %%
fam_rot, fam_ar = RotationFamily(), GaussianAR1Family()
t, S, q, q1 = fam_rot.sample(4, 2000, torch.Generator().manual_seed(0))
step = (S[:, 1:] - S[:, :-1] - t["mu"][:, None] + math.pi) % (2 * math.pi) - math.pi
test_close(step.std(1), t["sigma"], eps=0.03)
t_ar, S_ar, _, _ = fam_ar.sample(4, 4000, torch.Generator().manual_seed(0))
test_close(torch.stack([torch.corrcoef(torch.stack([s[:-1], s[1:]]))[0, 1] for s in S_ar]),
           t_ar["a"], eps=0.05)
test_close(S_ar.std(1), torch.ones(4, dtype=torch.float64), eps=0.1)
starts = torch.linspace(0.3, 6., 6, dtype=torch.float64)
for fam, x0 in [(fam_rot, starts), (fam_ar, starts / 3 - 1)]:
    task = fam.draw(1, torch.Generator().manual_seed(3))
    assert mc_z_scores(task_process(fam, task), x0, fam.v_pi(task, x0)[0], n_paths=2000,
                       seed=4).max() < 4.5


# %% [markdown]
# ### Training on trajectories with the engine
#
# The batched engine of the [pretraining chapter](pretrain.html) (`pretrain_many`) trains on these
# families through a protocol of its own. Its examples are `Contexts` of features rather than of
# state indices: a new task per example, a stationary context, a query and its successor, each
# seed's from its own generator; the held-out set is the first `eval_tasks` tasks of the family's
# `"held_out"` task set (sub-stream 0 of root seed 0, the same for every training seed), one context each, with the values on the family's grid
# and the grid's weights for the MSVE. The softmax family encodes a continuous context as state
# tokens with every context state its own key: log weight $0$, and the successor of key $k$ the
# column $k + 1$ (`trajectory_tokens`, chapter 6); on it the engine's forward pass is the
# Transformer of chapter 3 exactly (checked below). `family_config` is the configuration of a run
# on a family (it registers the family's protocol under a name that spells out the family's
# settings); the loss, the optimiser and the seed axis are the engine's.

# %%
#| export
def family_protocol(family:TaskFamily,   # the task family
                    eval_seed:int=0,     # root seed of the held-out task set (the same for every training seed)
                   )->Protocol:
    "The engine's protocol for a continuous task family: fresh tasks every example, held-out tasks on the family's grid."
    def check(config):
        if config.d != family.d or config.gamma != family.gamma: raise ValueError(f"`config` must have d = {family.d} and gamma = {family.gamma} for this family, got d = {config.d}, gamma = {config.gamma}")
    def sample(config, data, gens, step, state):
        check(config)
        out = []
        for g in gens:
            t, states, q, q1 = family.sample(config.batch_size, config.n, g)
            out.append((family.features(states), family.reward(t, states[:, :-1]), family.features(torch.stack([q, q1], -1)), family.reward(t, q)))
        phi, R, phi_q, r_q = (torch.stack(x).to(data["device"]) for x in zip(*out))
        return TDExamples(Contexts(phi=phi, r=R, phi_q=phi_q), r_q)
    def eval_set(config, seeds, device=None):
        check(config)
        ctx, S = family.contexts(config.eval_tasks, config.n, eval_seed, "held_out"), len(seeds)
        ex = lambda x: x[None].expand(S, *x.shape).to(device)
        phi, grid = family.features(ctx["states"]), family.features(ctx["x"])
        x = Contexts(phi=ex(phi), r=ex(ctx["rewards"]), phi_q=ex(grid.expand(len(phi), -1, -1)))
        return EvalSet(get_family(config.attention).prompt(config, x), ex(ctx["v"]), ex(ctx["w"].expand_as(ctx["v"])))
    return Protocol(sample=sample, eval_set=eval_set, data=lambda config, seeds, device: dict(device=device))


# %% [markdown]
# A protocol is registered under a name before a configuration can use it; `family_config` does
# that once per family, so that a reader only writes `pretrain_many(family_config(family), seeds)`.
# The shapes of the protocol's batches and of the history it produces are tested in
# [Implementation and tests](#task-sets-and-the-engines-protocol).

# %%
#| export
def family_config(family:TaskFamily,  # the task family (its protocol is registered under `repr(family)` on first use)
                  **settings,         # `PretrainConfig` fields; defaults: n = 30, L = 3, 500 steps, lr 1e-2, float32, 64 held-out tasks
                 )->PretrainConfig:
    "The configuration of softmax pretraining on a continuous family: `pretrain_many(family_config(family), seeds)`."
    name = repr(family)
    if name not in PROTOCOLS: register_protocol(name, family_protocol(family))
    defaults = dict(n=30, n_layers=3, n_steps=500, lr=1e-2, dtype="float32", eval_every=100, eval_tasks=64, record_params=True)
    fixed = dict(d=family.d, gamma=family.gamma, protocol=name)     # the family's own: a setting may repeat them, never change them
    for k, v in fixed.items():
        if k in settings and settings[k] != v:
            raise ValueError(f"`{k}` is the family's ({v!r}), got {settings[k]!r}: " + ("make the family with that gamma instead" if k == "gamma" else "it cannot be set here"))
    return PretrainConfig(**(defaults | settings | fixed))


# %%
show_doc(family_config)

# %%
S, R = rot.sample_trajectory(40, seed=0)
x_q = rot.grid(8)[0]
model = SoftmaxICTD(2, n_layers=3, init_gain=0.5, seed=3)
tokens = trajectory_tokens(rot.features(S)[None], R[None], rot.features(x_q)[None])
test_close(token_predict(model_params(model), 3, tokens)[0],
           model.predict(build_prompt(rot.features(S), R, rot.features(x_q)), n=40), eps=1e-13)

# %% [markdown]
# ## Implementation and tests
#
# The helpers behind the lesson, the refusal of bad input, and the exhaustive checks. Every
# constructor and function of this chapter refuses bad input with a `ValueError` that names the
# argument and what was expected:

# %%
test_fail(lambda: NoisyRotation(sigma=0.), contains="`sigma` must be a finite number > 0")
test_fail(lambda: NoisyRotation(sigma=0.001), contains="`sigma` must be at least 0.01")
test_fail(lambda: NoisyRotation(reward="saw"), contains="`reward` must be one of ('square', 'cos')")
test_fail(lambda: NoisyRotation(mu=math.nan), contains="`mu` must be a finite number")
test_fail(lambda: GaussianAR1(a="0.5"), contains="`a` must be a finite number")
test_fail(lambda: polyval([1.], [math.inf]), contains="`s` contains NaN or inf")
test_fail(lambda: rot.sample_trajectory(0), contains="`n` must be an integer >= 1")
test_fail(lambda: GaussianAR1(a=1.), contains="`a` must satisfy |a| < 1")
test_fail(lambda: GaussianAR1(reward=()), contains="`reward` must be a non-empty")
test_fail(lambda: GaussianAR1().score_matrix(0.), contains="`beta` must be a finite number > 0")
test_fail(lambda: rot.score_matrix(0.), contains="`beta` must be a finite number > 0")
test_fail(lambda: RotationFamily(sigma=(0., 0.5)), contains="`sigma` must satisfy 0.01 <= low")
test_fail(lambda: GaussianAR1Family(a=(0.5, 1.)), contains="`a` must lie inside (-1, 1)")
# 1.8e8 steps
test_fail(lambda: mc_returns(NoisyRotation(gamma=0.9999999), [0.]),
          contains="the Monte Carlo rollouts")
test_fail(lambda: mc_returns(rot, [0.], tol=0.), contains="`tol` must be a number in (0, 1]")
test_fail(lambda: fam_ar.contexts(4, 20, which="train"), contains="`which` must be one of")

# %% [markdown]
# ### Monte Carlo returns
#
# The simulator behind the Monte Carlo check of the closed forms:

# %%
show_doc(mc_returns)

# %% [markdown]
# ### The von Mises harmonics
#
# The Fourier coefficients $\mu_k$ of the population smoother on the circle, computed by an FFT,
# checked against the ratio of modified Bessel functions $I_1(\beta)/I_0(\beta)$ at three
# concentrations:

# %%
show_doc(von_mises_harmonics)

# %%
for b in (0.5, 3., 40.):
    bt = torch.tensor(b, dtype=torch.float64)
    test_close(von_mises_harmonics(b, 3)[1], (torch.special.i1e(bt) / torch.special.i0e(bt)).item(),
               eps=1e-12)

# %% [markdown]
# ### Task sets and the engine's protocol
#
# A family's named task sets are sub-streams of one root seed (the held-out set is the same whatever
# the call), and the engine's protocol hands out batches of the documented shapes, records its
# history at the evaluation steps, and refuses a configuration whose feature dimension does not
# match the family:

# %%
show_doc(TaskFamily.contexts)

# %%
cfg_ar = family_config(fam_ar, n=20, batch_size=5, n_steps=4, eval_every=2, eval_tasks=4)
b = get_protocol(cfg_ar.protocol).sample(cfg_ar, dict(device=None),
                                         [torch.Generator().manual_seed(s) for s in (0, 1)], 0, {})
test_eq((b.x.phi.shape, b.x.phi_q.shape, b.reward.shape), ((2, 5, 21, 3), (2, 5, 2, 3), (2, 5)))
runs = pretrain_many(cfg_ar, [0, 1], progress=False)
test_eq([r.history["step"][:, 0].tolist() for r in runs], [[0, 2, 4]] * 2)
test_eq(runs[0].history["msve"].shape[0], 3)
test_eq(fam_ar.contexts(4, 20)["v"], fam_ar.contexts(4, 20, 0, "held_out")["v"])
assert not torch.equal(fam_ar.contexts(4, 20, which="tune")["v"],
                       fam_ar.contexts(4, 20, which="test")["v"])
test_fail(lambda: pretrain_many(dataclasses.replace(cfg_ar, d=4), [0]),
          contains="`config` must have d = 3")
# never silently replaced by the family's
test_fail(lambda: family_config(fam_ar, gamma=0.5), contains="`gamma` is the family's")
test_eq(family_config(fam_ar, gamma=fam_ar.gamma, n_steps=4).gamma, fam_ar.gamma)


# %% [markdown]
# ### Richer feature bases
#
# Chapter 8a compares kernel TD with linear TD on richer features than $\phi$: each process's `basis(states, size)`,
# the Fourier features $(1, \cos ks, \sin ks)_{k \le \bar k}$ on the circle and the normalised Hermite polynomials
# $\mathrm{He}_j(x/\sigma_\infty)/\sqrt{j!}$, $j \le D$, on the line. They are methods of the processes, defined here
# with the classes, and checked in [chapter 8a](continuous_experiments.html#richer-features-and-lstd).

# %%
#| export
@patch
def basis(self:NoisyRotation, states, size:int)->torch.Tensor:
    "(..., 2 size + 1) features (1, cos ks, sin ks) for k = 1..size."
    s = as_tensor(states, "states").unsqueeze(-1)
    k = torch.arange(1, check_int(size, "size", 1) + 1, dtype=s.dtype)
    return torch.cat([torch.ones_like(s), torch.cos(k * s), torch.sin(k * s)], -1)


# %%
#| export
@patch
def basis(self:GaussianAR1, states, size:int)->torch.Tensor:
    "(..., size + 1) normalised probabilists' Hermite polynomials He_j(s / std) / sqrt(j!), j = 0..size."
    x = as_tensor(states, "states") / self.std
    H = [torch.ones_like(x), x]
    for j in range(1, check_int(size, "size", 1)): H.append(x * H[j] - j * H[j - 1])
    return torch.stack([h / math.sqrt(math.factorial(j)) for j, h in enumerate(H[:size + 1])], -1)


# %% [markdown]
# ### API entries of the page's other functions
#
# The functions the lesson uses but does not teach (the engine's plug-ins, measures, tables and plots), documented here:

# %%
show_doc(gaussian_moment)

# %%
show_doc(gaussian_operator)

# %%
show_doc(polyval)

# %%
show_doc(mc_z_scores)

# %%
show_doc(population_msve)

# %%
show_doc(TaskFamily)

# %%
show_doc(GaussianAR1Family)

# %%
show_doc(task_process)

# %%
show_doc(family_protocol)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %% [markdown]
# The exported module's functions check their arguments against their annotations
# (chapter 0's `check_arguments`), naming the argument:

# %%
import ictd.continuous

# %%
test_fail(lambda: ictd.continuous.polyval("abc", [1.]), contains="`coef` must be a tensor")
test_fail(lambda: ictd.continuous.mc_returns("rotation", [0.]),
          contains="`process` must be a ContinuousProcess")
