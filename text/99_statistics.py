# %%
#| default_exp stats

# %%
#| export
from __future__ import annotations
import math
import torch
from scipy import stats as sps
from ictd.core import check_int, check_number

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *


# %% [markdown]
# # Statistics
# > The few statistics the book states its measured claims with: a mean with its standard error, binomial tails and
# > exact intervals for rates over seeds, and a normal tail, in one module.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - The book's claims about training are claims about a distribution of seeds: a mean with its standard error, or a
#   rate (how many seeds show an effect) with an exact interval and a one-sided test against a chance level.
# - Each function here is a thin, checked wrapper of `scipy.stats`, so the chapters say what they test in one name.
# - Each is checked against the formula it stands for, computed another way.
# :::

# %% [markdown]
# ## A mean over seeds
#
# Seeds are independent draws of a training run, so a statistic measured on each seed has a mean whose standard error
# is the seeds' standard deviation over $\sqrt m$.

# %%
#| export
def mean_se(x:torch.Tensor,  # (seeds, ...) one value per seed
           )->tuple:         # (mean, standard error), each of shape (...)
    "Mean over the leading seed dimension and its standard error."
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"`x` must be a real floating tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[0] < 2: raise ValueError(f"`x` needs at least 2 seeds along dimension 0, got shape {tuple(x.shape)}")
    return x.mean(0), x.std(0) / math.sqrt(x.shape[0])


# %%
m, s = mean_se(torch.tensor([[1., 10.], [3., 10.], [5., 10.]], dtype=torch.float64))
test_close(m, torch.tensor([3., 10.], dtype=torch.float64)); test_close(s, torch.tensor([2 / math.sqrt(3), 0.], dtype=torch.float64))


# %% [markdown]
# ## Rates over seeds
#
# When $k$ of $m$ seeds show an effect, the count is a draw of $\mathrm{Binomial}(m, p)$. Three questions about $p$
# recur: could chance at a rate $p_0$ give $k$ or more (the upper tail, a one-sided exact test); which rates are
# compatible with $k$ (the Clopper-Pearson interval, which inverts the two tails); and how many seeds out of $m$ an
# effect must reach for the test to reject $p_0$.

# %%
#| export
def _count(k, m):
    m = check_int(m, "m", 1)
    return check_int(k, "k", 0, f"an integer in [0, {m}]", high=m), m

def binomial_tail(k:int,    # successes
                  m:int,    # trials
                  p:float,  # success probability
                 )->float:  # P(X >= k), X ~ Binomial(m, p): the one-sided exact p-value of k
    "Upper tail of the binomial distribution."
    k, m = _count(k, m)
    return float(sps.binom.sf(k - 1, m, check_number(p, "p", 0., high=1.)))

def rate_interval(k:int,            # successes
                  m:int,            # trials
                  level:float=0.95, # coverage
                 )->tuple:          # (rate k/m, low, high)
    "The rate k/m with its exact two-sided Clopper-Pearson interval."
    k, m = _count(k, m)
    ci = sps.binomtest(k, m).proportion_ci(confidence_level=check_number(level, "level", 0., True, high=1.), method="exact")
    return k / m, float(ci.low), float(ci.high)

def rate_lower(k:int,            # successes
               m:int,            # trials
               level:float=0.95, # coverage
              )->float:          # the one-sided Clopper-Pearson lower bound on p
    "One-sided exact lower confidence bound on a rate from k successes in m trials."
    k, m = _count(k, m)
    level = check_number(level, "level", 0., True, high=1.)
    return 0. if k == 0 else float(sps.beta.ppf(1 - level, k, m - k + 1))

def min_successes(m:int,             # trials (seeds)
                  p0:float,          # chance rate of one seed showing the effect
                  level:float=0.05,  # test level
                 )->int:             # smallest k with P(Binomial(m, p0) >= k) <= level
    "The count of seeds an effect must reach in `m` seeds to reject the chance rate `p0`."
    m, p0 = check_int(m, "m", 1), check_number(p0, "p0", 0., high=1.)
    if p0 >= 1: raise ValueError(f"`p0` must lie in [0, 1), got {p0}")
    return next(k for k in range(m + 2) if k > m or binomial_tail(k, m, p0) <= level)

def normal_greater(z:float,  # a z-score
                  )->float:  # P(Z >= z), Z standard normal
    "One-sided p-value of a z-score."
    return float(sps.norm.sf(check_number(z, "z")))


# %% [markdown]
# Each against the formula it stands for: the tail as the sum $\sum_{j \ge k} \binom{m}{j} p^j (1-p)^{m-j}$; the
# interval's ends as the rates at which the two tails equal $(1 - \text{level})/2$ (the definition of Clopper-Pearson),
# and in closed form where one exists (10 of 10 seeds: the lower end is $0.025^{1/10}$); the one-sided bound as the rate
# at which the upper tail equals $1 - \text{level}$:

# %%
comb_tail = lambda k, m, p: sum(math.comb(m, j) * p ** j * (1 - p) ** (m - j) for j in range(k, m + 1))
for k, m, p in ((0, 5, 0.3), (3, 10, 0.5), (9, 10, 0.25), (30, 30, 0.9)):
    test_close(binomial_tail(k, m, p), comb_tail(k, m, p), eps=1e-13)
for k, m in ((0, 10), (3, 10), (10, 10), (17, 40)):
    rate, low, high = rate_interval(k, m)
    test_eq(rate, k / m)
    if k > 0: test_close(comb_tail(k, m, low), 0.025, eps=1e-9)
    if k < m: test_close(1 - comb_tail(k + 1, m, high), 0.025, eps=1e-9)
    lo1 = rate_lower(k, m)
    if k > 0: test_close(comb_tail(k, m, lo1), 0.05, eps=1e-9)
test_eq(rate_interval(0, 10)[1], 0.); test_eq(rate_interval(10, 10)[2], 1.)
test_close(rate_interval(10, 10)[1], 0.025 ** (1 / 10), eps=1e-12)
test_eq(min_successes(10, 0.5), 9)    # P(X >= 9) = 11/1024 <= 0.05 < P(X >= 8) = 56/1024
test_close(normal_greater(1.959963984540054), 0.025, eps=1e-12)

# %% [markdown]
# ## Implementation and tests
#
# Bad input is refused, naming the argument:

# %%
test_fail(lambda: binomial_tail(11, 10, 0.5), contains="`k` must be an integer in [0, 10]")
test_fail(lambda: rate_interval(3, 0), contains="`m`")
test_fail(lambda: rate_interval(3, 10, level=1.5), contains="`level`")
test_fail(lambda: min_successes(10, 1.0), contains="`p0` must lie in [0, 1)")
test_fail(lambda: mean_se(torch.ones(1)), contains="`x` needs at least 2 seeds")
test_fail(lambda: mean_se([1., 2.]), contains="`x` must be a real floating tensor")

# %%
show_doc(mean_se)

# %%
show_doc(binomial_tail)

# %%
show_doc(rate_interval)

# %%
show_doc(rate_lower)

# %%
show_doc(min_successes)

# %%
show_doc(normal_greater)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
