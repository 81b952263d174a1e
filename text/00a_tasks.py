# %%
#| default_exp tasks

# %%
#| export
from __future__ import annotations
from dataclasses import dataclass
import numpy as np
import torch
from ictd.boyan import MRP, as_tensor, chain_from_uniforms, check_gamma, random_boyan_chain
from ictd.boyan import reordered_positionals

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *
from types import SimpleNamespace
from ictd.boyan import sample_trajectory

# %%
from ictd.core import record_claim

# %% [markdown]
# # Many tasks at once
# > Random Boyan chains stacked along a batch dimension, and their trajectories sampled in lock-step: the data every experiment of the book averages over.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - Random Boyan chains stacked along a batch dimension (`TaskBatch`), and their trajectories sampled in lock-step.
# - How a seed names a set of tasks, once for the whole book.
# - The fast pools of tasks that pretraining draws.
# :::

# %% [markdown]
# [Chapter 0](boyan.html) draws one Markov reward process and one trajectory at a time. But every
# claim the book measures is a claim about a *distribution* of tasks: the experiments of the later
# chapters average over hundreds of random chains and several context lengths, and pretraining
# ([chapter 6](pretrain.html)) draws thousands of tasks per run. Looping over chains one at a time
# would make those experiments slow and, worse, easy to get subtly inconsistent (two experiments
# that think they use "the tasks of seed 7" but draw them differently). This short chapter stacks
# tasks along a leading dimension, samples their trajectories together, and fixes once how a seed
# names a set of tasks. It is about the testbed only: nothing here knows about attention or TD.
#
# *How to read this chapter.* A batch of tasks, trajectories sampled in lock-step (with a small
# worked example), the seed conventions, and the fast pools that pretraining draws. The input
# checks are in the last section, [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## A batch of tasks
#
# A `TaskBatch` holds the matrices of several chains (`len(batch)` of them) that share their number of states, their feature
# dimension and their discount. `random_tasks` draws chain $b$ of seed $u$ from its own stream,
# child $b$ of `numpy.random.SeedSequence(u)` (`task_rng(u, b)`), so a batch is reproducible, task $b$ can be
# rebuilt on its own, and the batches of two seeds share no stream.

# %%
#| code-fold: true
#| code-summary: "TaskBatch"
#| export
TASK_FIELDS = ("P", "r", "phi", "d_pi", "v_pi")  # a TaskBatch's tensors, in order


@dataclass(eq=False)
class TaskBatch:
    (
        "Tasks stacked along a leading dimension (all with the same number of states, features and "
        "discount)."
    )

    P: torch.Tensor  # (B, s, s) transition matrices
    r: torch.Tensor  # (B, s) rewards
    phi: torch.Tensor  # (B, s, d) features
    d_pi: torch.Tensor  # (B, s) stationary distributions
    v_pi: torch.Tensor  # (B, s) true values
    gamma: float  # the common discount factor

    def __post_init__(self):
        "Refuse, naming the field, a value that is not a tensor, or a `gamma` outside [0, 1)."
        from ictd.core import check_type  # imported when called: ictd.core imports this module

        for k in TASK_FIELDS:
            check_type(getattr(self, k), torch.Tensor, k)
        check_gamma(self.gamma)

    def __len__(self):
        return self.P.shape[0]

    def to(self, device=None, dtype=None) -> TaskBatch:
        "The batch with every tensor on `device` and in the floating `dtype` (None: unchanged)."
        return self.map(lambda x: x.to(device=device, dtype=dtype))

    def __getitem__(self, idx):
        (
            "Task `idx` as an `MRP` for an integer; a `TaskBatch` of the selected tasks for a"
            " slice, a list or a tensor of indices."
        )
        if isinstance(idx, (int, np.integer)) or (
            isinstance(idx, torch.Tensor) and idx.ndim == 0 and not idx.is_floating_point()
        ):
            i = int(idx)
            if not -len(self) <= i < len(self):
                raise IndexError(f"task {i} of a batch of {len(self)}")
            return MRP(
                self.P[i],
                self.r[i],
                self.gamma,
                self.phi[i],
                device=self.P.device,
                dtype=self.P.dtype,
            )
        return self.map(lambda x: x[idx])

    def map(self, fn) -> TaskBatch:
        (
            "The batch with `fn` applied to each of its tensors (P, r, phi, d_pi, v_pi): to move it"
            " to a device, or take a slice."
        )
        return TaskBatch(*(fn(getattr(self, k)) for k in TASK_FIELDS), self.gamma)

    @classmethod
    def stack(cls, batches: list, device=None) -> TaskBatch:
        (
            "Task batches of equal shapes and discount stacked along a new leading axis, on"
            " `device` (default: theirs)."
        )
        batches = list(batches)
        if not batches or len({b.gamma for b in batches}) > 1:
            raise ValueError("`batches` must be a non-empty list of TaskBatch with one discount")
        return cls(
            *(torch.stack([getattr(b, k) for b in batches]).to(device) for k in TASK_FIELDS),
            batches[0].gamma,
        )


# %%
show_doc(TaskBatch)


# %% [markdown]
# `stack_tasks` builds a batch from chains already drawn, one tensor per field with the chains along
# the new leading axis. Chains of different sizes or discounts cannot share a tensor, so it refuses
# them (checked in [Implementation and tests](#implementation-and-tests)).

# %%
#| code-fold: true
#| code-summary: "stack_tasks"
#| export
def stack_tasks(mrps: list) -> TaskBatch:  # MRPs with equal shapes and discount
    "Stack a list of MRPs into a `TaskBatch`."
    mrps = list(mrps)
    if not mrps or not all(isinstance(m, MRP) for m in mrps):
        raise ValueError("`mrps` must be a non-empty list of MRP")
    if len({(m.n_states, m.d, m.gamma) for m in mrps}) > 1:
        raise ValueError("`mrps` must share n_states, d and gamma")
    return TaskBatch(
        *(torch.stack([getattr(m, k) for m in mrps]) for k in ("P", "r", "phi", "d_pi", "v_pi")),
        mrps[0].gamma
    )


# %%
chains = [random_boyan_chain(d=2, seed=k) for k in range(3)]
trio = stack_tasks(chains)
test_eq((len(trio), trio.gamma, trio.phi.shape), (3, 0.9, (3, 10, 2)))
test_eq(trio.v_pi[2], chains[2].v_pi)


# %% [markdown]
# Which random stream a task reads is fixed by `task_rng`: task $b$ of a batch of seed $u$ draws from
# child $b$ of `numpy.random.SeedSequence(u)`. Naming one task's stream is what lets task $b$ be
# rebuilt alone and a long pool be drawn in pieces; children of one seed never share a stream.

# %%
#| code-fold: true
#| code-summary: "task_rng"
#| export
def task_rng(
    seed: int, b: int  # the seed of a batch of tasks  # the task's index in the batch
) -> np.random.Generator:
    (
        "Task `b`'s generator: `numpy.random.default_rng` on child `b` of "
        "`numpy.random.SeedSequence(seed)`, as `spawn` makes it."
    )
    if int(seed) != seed or seed < 0 or int(b) != b or b < 0:
        raise ValueError(f"`seed` and `b` must be integers >= 0, got {seed!r} and {b!r}")
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(b),)))


# %%
test_eq(
    task_rng(3, 2).random(4), np.random.default_rng(np.random.SeedSequence(3).spawn(3)[2]).random(4)
)
test_ne(task_rng(3, 2).random(4), task_rng(3, 1).random(4))
test_fail(lambda: task_rng(3, -1), contains="`seed` and `b` must be integers >= 0")


# %% [markdown]
# `random_tasks` puts the two together: task $b$ of the batch is `random_boyan_chain` on the stream
# `task_rng(seed, first + b)`, and the batch is their stack.

# %%
#| code-fold: true
#| code-summary: "random_tasks"
#| export
def random_tasks(
    n_tasks: int,  # number of random Boyan chains B
    seed: int = 0,  # task b is `random_boyan_chain(..., seed=task_rng(seed, first + b))`
    first: int = 0,  # index of the first task: a batch of tasks first..first + B - 1 of the seed
    **kwargs,  # passed to `random_boyan_chain` (n_states, d, gamma, features, rewards)
) -> TaskBatch:
    "A batch of random Boyan chains, task b drawn from its own child stream of `seed`."
    if int(n_tasks) != n_tasks or n_tasks < 1:
        raise ValueError(f"`n_tasks` must be a positive integer, got {n_tasks}")
    return stack_tasks(
        random_boyan_chain(seed=task_rng(seed, first + b), **kwargs) for b in range(int(n_tasks))
    )


# %%
show_doc(random_tasks)

# %%
tasks = random_tasks(5, seed=3, d=2)
test_eq((len(tasks), tasks.P.shape, tasks.phi.shape), (5, (5, 10, 10), (5, 10, 2)))
test_eq(tasks.P[4], random_boyan_chain(d=2, seed=task_rng(3, 4)).P)
test_eq(tasks.v_pi[2], random_boyan_chain(d=2, seed=np.random.SeedSequence(3).spawn(3)[2]).v_pi)
test_eq(random_tasks(2, seed=3, first=3, d=2).P, tasks.P[3:])


# %% [markdown]
# ## Trajectories in lock-step
#
# The sampler draws one trajectory per task, with all tasks stepping together: one `searchsorted`
# per time step for the whole batch, on the cumulative rows of the transition matrices. A context
# of length $n$ is the prefix of a longer trajectory, so the contexts of one task are nested, as
# when a prompt grows.

# %%
#| code-fold: true
#| code-summary: "sample_trajectories"
#| export
@reordered_positionals(("P", "n", "d0", "seed"), lambda args: len(args) > 2 or len(args) == 2 and isinstance(args[1], int))
def sample_trajectories(
    P,  # (B, s, s) transition matrices
    d0,  # (B, s) distributions of S_0 (d_pi for stationary contexts)
    *,
    n: int,  # number of transitions
    seed=None,  # int or CPU `torch.Generator`: a torch stream, not `sample_trajectory`'s numpy one
) -> torch.Tensor:  # (B, n+1) long tensor of states S_0..S_n, on P's device
    "Sample one trajectory per task, all tasks stepping together."
    P = as_tensor(P, "P", torch.float64)
    if P.ndim != 3 or P.shape[-1] != P.shape[-2]:
        raise ValueError(f"`P` must have shape (B, s, s), got {tuple(P.shape)}")
    d0 = as_tensor(d0, "d0", torch.float64, P.device)
    if d0.shape != P.shape[:2]:
        raise ValueError(f"`d0` must have shape {tuple(P.shape[:2])}, got {tuple(d0.shape)}")
    if (
        not torch.isfinite(d0).all()
        or (d0 < 0).any()
        or not torch.allclose(d0.sum(-1), torch.ones_like(d0[:, 0]), atol=1e-10)
    ):
        raise ValueError("`d0` must hold probability distributions: non-negative rows summing to 1")
    if (P < 0).any() or not torch.allclose(P.sum(-1), torch.ones_like(P[..., 0]), atol=1e-10):
        raise ValueError("`P` must be row-stochastic: non-negative rows summing to 1")
    if int(n) != n or n < 0:
        raise ValueError(f"`n` must be a non-negative integer, got {n}")
    gen = (
        seed
        if isinstance(seed, torch.Generator)
        else torch.Generator().manual_seed(np.random.SeedSequence(seed).generate_state(1)[0].item())
    )
    (B, s), n = P.shape[:2], int(n)
    u = torch.rand(n + 1, B, 1, generator=gen, dtype=torch.float64).to(P.device)
    cum, rows = P.cumsum(-1).contiguous(), torch.arange(B, device=P.device)
    S = torch.empty(n + 1, B, dtype=torch.long, device=P.device)
    S[0] = (
        torch.searchsorted(d0.cumsum(-1).contiguous(), u[0], right=True)
        .squeeze(-1)
        .clamp(max=s - 1)
    )
    for t in range(n):
        S[t + 1] = (
            torch.searchsorted(cum[rows, S[t]], u[t + 1], right=True).squeeze(-1).clamp(max=s - 1)
        )
    return S.T.contiguous()


# %%
show_doc(sample_trajectories)

# %% [markdown]
# *A worked example.* Three chains of four states, and a trajectory of eight transitions from each,
# starting from the stationary distribution: line $b$ is task $b$'s trajectory $S_0, \dots, S_8$. Each
# step is a jump of one or two states to the right, except from the last state, which can go
# anywhere. The shorter contexts of the same tasks are prefixes of these rows (checked).

# %%
small = random_tasks(3, seed=0, n_states=4)
S_small = sample_trajectories(small.P, small.d_pi, n=8, seed=0)
steps = S_small[:, 1:] - S_small[:, :-1]
assert ((steps == 1) | (steps == 2) | (S_small[:, :-1] == 3)).all()
test_eq(sample_trajectories(small.P, small.d_pi, n=5, seed=0), S_small[:, :6])
for b, row in enumerate(S_small.tolist()):
    print(f"task {b}: " + " → ".join(map(str, row)))

# %% [markdown]
# The batched sampler is reproducible, only takes allowed transitions, and the joint frequencies
# of its transitions over $2 \times 10^4$ steps per task match $d_\pi(x) P(x, y)$ up to sampling
# error (the number printed is the largest gap over the 8 tasks and 100 state pairs):

# %%
#| code-fold: true
#| code-summary: "Code of the check"
tasks = random_tasks(8, seed=10, features="onehot")
S = sample_trajectories(tasks.P, tasks.d_pi, n=20_000, seed=0)
test_eq(S.shape, (8, 20_001))
test_eq(sample_trajectories(tasks.P, tasks.d_pi, n=50, seed=0), S[:, :51])
test_ne(sample_trajectories(tasks.P, tasks.d_pi, n=50, seed=1), S[:, :51])
pairs = S[:, :-1] * 10 + S[:, 1:]
joint = torch.stack([torch.bincount(p, minlength=100) for p in pairs]).reshape(8, 10, 10) / 20_000
assert (joint[tasks.P == 0] == 0).all()
joint_gap = (joint - tasks.d_pi.unsqueeze(-1) * tasks.P).abs().max().item()
assert joint_gap < 0.01, joint_gap
joint_gap

# %% [markdown]
# ## Seeds
#
# Every random draw of this chapter and of chapter 0 takes a seed or a generator, under three
# conventions:
#
# * **a chain** of seed $k$ reads `numpy.random.default_rng(k)` in the fixed order of chapter 0,
#   whatever its feature kind;
# * **a batch** of seed $k$ draws chain $b$ from child $b$ of `numpy.random.SeedSequence(k)`
#   (`task_rng`; `random_tasks` and `task_pool` alike), so the batches of two seeds share no chain and
#   a long pool can be drawn in pieces (`first`); a training run draws its pools from named streams
#   of its seed (`ictd.core.run_stream`, appendix A), never from an offset added to it;
# * **a trajectory**: `sample_trajectory` draws from the numpy stream `default_rng(seed)`, and
#   `sample_trajectories` from a torch stream (a CPU `torch.Generator` seeded with the first word of
#   `numpy.random.SeedSequence(seed)`, or the generator passed in), because the training engine
#   hands it its own torch generators. Both are exact samplers of the same chain (the joint
#   frequencies above, and chapter 0's long-run frequencies), but the same integer seed gives
#   *different* trajectories in the two. They are kept apart rather than unified because both
#   streams are fixed by results already in the book: the chapters' examples and figures use the
#   first, the saved training runs the second.

# %%
#| code-fold: true
#| code-summary: "Code of the check"
k = 40
assert not any(
    torch.equal(a, b) for a in random_tasks(4, seed=k + 1).P for b in random_tasks(4, seed=k).P
)
one = random_tasks(1, seed=k)
test_eq(
    one.P[0], random_boyan_chain(seed=task_rng(k, 0)).P
)  # the same chain, sampled both ways with the same integer seed:
test_ne(
    sample_trajectories(one.P, one.d_pi, n=30, seed=k)[0],
    sample_trajectory(random_boyan_chain(seed=task_rng(k, 0)), n=30, seed=k)[0],
)


# %% [markdown]
# ## Training pools, vectorised
#
# Pretraining (chapter 6) draws pools of thousands of chains, and building them one
# `random_boyan_chain` at a time is slow. `task_pool` draws task $b$ from
# `task_rng(seed, b)` in the same order, passes the uniforms of all tasks to the
# same `chain_from_uniforms` in one call, and batches the linear algebra (the stationary
# distributions by one batched least-squares solve). Its tasks are `random_tasks`' tasks: the
# transition matrices, rewards, features and values exactly, the stationary distributions to
# rounding.

# %%
#| code-fold: true
#| code-summary: "task_pool"
#| export
def task_pool(
    config,  # the task settings: n_states, d, features, gamma (e.g. a PretrainConfig)
    n_tasks: int,  # number of tasks T
    seed: int,  # task b draws from `task_rng(seed, first + b)`
    first: int = 0,  # index of the first task (a pool drawn in pieces)
) -> TaskBatch:  # P (T, s, s), r (T, s), phi (T, s, d), d_pi, v_pi
    (
        "`random_tasks(n_tasks, seed, first, ...)` for the configuration's tasks, vectorised: one "
        "draw per task, batched solves."
    )
    if int(n_tasks) != n_tasks or n_tasks < 1:
        raise ValueError(f"`n_tasks` must be a positive integer, got {n_tasks}")
    s, d, g, T = config.n_states, config.d, config.gamma, int(n_tasks)
    u = np.stack([task_rng(seed, first + b).random(2 * s - 2 + s * d + s) for b in range(T)])
    P, phi = chain_from_uniforms(u[:, :-s], s, d, config.features)
    P, phi, r = (
        torch.from_numpy(x) for x in (P, phi, -1 + (1 - -1) * u[:, -s:])
    )  # r as `rng.uniform(-1, 1)`
    I = torch.eye(s, dtype=torch.float64)
    A = torch.cat([P.mT - I, torch.ones(T, 1, s, dtype=torch.float64)], 1)
    e = torch.zeros(T, s + 1, 1, dtype=torch.float64)
    e[:, -1] = 1
    d_pi = torch.linalg.lstsq(A, e, driver="gelsd").solution.squeeze(-1).clamp(min=0)
    return TaskBatch(
        P, r, phi, d_pi / d_pi.sum(-1, keepdim=True), torch.linalg.solve(I - g * P, r), g
    )


# %%
show_doc(task_pool)

# %% [markdown]
# Both draw each chain with `chain_from_uniforms`, so the pools of every feature kind of one
# seed are one set of tasks, as in chapter 0: the same $P$, $r$, $d_\pi$ and $v_\pi$, bit for bit,
# with only $\Phi$ differing. Chapter 7's side-by-side of one-hot and random features relies on
# this. The cell checks it on pools of the default task settings, and that `task_pool` equals
# `random_tasks` for every kind and several sizes:

# %%
#| code-fold: true
#| code-summary: "Code of the check"
for features in ("random", "unit", "onehot"):
    for s, d in ((10, 4), (5, 3), (2, 1)):
        cfg = SimpleNamespace(n_states=s, d=d, gamma=0.9, features=features)
        fast_pool, slow_pool = task_pool(cfg, 20, 7), random_tasks(
            20, seed=7, n_states=s, d=d, features=features
        )
        for k in ("P", "r", "phi", "v_pi"):
            test_eq(getattr(fast_pool, k), getattr(slow_pool, k))
        test_close(fast_pool.d_pi, slow_pool.d_pi, eps=1e-14)
        test_eq(task_pool(cfg, 5, 7, first=15).P, fast_pool.P[15:])
pools = {
    f: task_pool(SimpleNamespace(n_states=10, d=4, gamma=0.9, features=f), 256, 1)
    for f in ("random", "unit", "onehot")
}
for pool in pools.values():
    for k in ("P", "r", "d_pi", "v_pi"):
        test_eq(getattr(pool, k), getattr(pools["random"], k))
test_eq(pools["onehot"].phi, torch.eye(10, dtype=torch.float64).expand(256, 10, 10))
record_claim(
    "pool-kinds-share-tasks",
    "The task pools of the random, unit and one-hot feature kinds of one seed hold the same chains"
    " ($P$, $r$, $d_\\pi$, $v_\\pi$ bit for bit); only $\\Phi$ differs.",
    "proved",
    "tasks",
    "#training-pools-vectorised",
)
print(
    f"{len(pools)} kinds x {len(pools['random'])} tasks: P, r, d_pi and v_pi identical across kinds"
)

# %% [markdown]
# ## Implementation and tests
#
# The input checks of this chapter's functions: each bad argument fails with a `ValueError` that
# names it. Every cell runs when the book is built.

# %% [markdown]
# ### Helpers of the lesson
#
# The methods and functions the lesson uses to build and name batches of tasks.

# %%
show_doc(TaskBatch.map)

# %%
show_doc(TaskBatch.stack)

# %%
show_doc(stack_tasks)

# %%
show_doc(task_rng)

# %% [markdown]
# ### Bad input

# %%
#| code-fold: true
test_fail(lambda: random_tasks(0), contains="`n_tasks` must be a positive integer")
test_fail(
    lambda: stack_tasks([random_boyan_chain(seed=0), random_boyan_chain(n_states=5, seed=0)]),
    contains="`mrps` must share",
)
t5 = random_tasks(2, seed=0)
for k in ("P", "r", "phi", "d_pi", "v_pi"):
    test_fail(
        lambda: TaskBatch(**{**{f: getattr(t5, f) for f in TASK_FIELDS}, k: "abc"}, gamma=0.9),
        contains=f"`{k}` must be a Tensor",
    )
for g in ("abc", 1.0, -0.1):
    test_fail(lambda: TaskBatch(*(getattr(t5, f) for f in TASK_FIELDS), g), contains="`gamma`")

# %%
#| code-fold: true
for msg, f in {
    "`d0` must have shape (8, 10)": lambda: sample_trajectories(tasks.P, tasks.d_pi[0], n=5),
    "`n` must be a non-negative integer": lambda: sample_trajectories(tasks.P, tasks.d_pi, n=-2),
    "`P` must have shape (B, s, s)": lambda: sample_trajectories(tasks.P[0], tasks.d_pi, n=5),
    "`d0` must hold probability distributions": lambda: sample_trajectories(
        tasks.P, 2 * tasks.d_pi - tasks.d_pi.roll(1, -1), n=5
    ),
    "`P` must be row-stochastic": lambda: sample_trajectories(-tasks.P, tasks.d_pi, n=5),
}.items():
    test_fail(f, contains=msg)

# %%
#| code-fold: true
test_fail(lambda: task_pool(cfg, 0, 7), contains="`n_tasks` must be a positive integer")

# %%
#| export
from ictd.boyan import check_arguments

check_arguments(
    globals()
)  # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
