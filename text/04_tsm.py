# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from ictd.boyan import as_tensor, random_boyan_chain, sample_trajectory
from ictd.prompt import build_prompt
from ictd.model import *
from ictd.model import _generator, _token_rows, _xavier, _carry


# %% [markdown]
# # One head and a temporal shift
# > The dual-head layer is an ordinary single softmax head reading its input through a parameter-free shift of the token axis.

# %% [markdown]
# The paper observes that its two heads are less exotic than they look: the dual-head layer is a
# single ordinary softmax head whose input has passed through a parameter-free *temporal shift*.
# This chapter makes that statement exact, in a general form that holds for every parameter value,
# not only for the constructed $\theta^*$. As in the previous chapter, **the exact form, Theorem 2
# and its proof are the project's own**; the paper states the equivalence.
#
# The shift is the one used by the Temporal Shift Module of video models (Lin, Gan and Han, 2019),
# which moves some channels of each frame's feature map one frame forward or backward in time, so
# that a 2D network can mix information across frames at zero parameters and zero multiplications.
# Here the frames are the tokens of a trajectory, and shifting the value channel one token back
# hands each transition the value of its successor state, which is all the target-value head ever
# reads.
#
# The code of this chapter is exported to `ictd.model`, next to the dual-head layer.

# %% [markdown]
# ## The temporal shift
#
# ::: {.definition}
# **Definition (temporal shift; our exact form).** For a set $C$ of channels (rows) of a prompt $Z$
# with $n$ context transitions, $\mathrm{TSM}_C(Z)$ appends to $Z$ the rows $C$ shifted one token to the left along the context:
#
# $$\mathrm{TSM}_C(Z) = \begin{pmatrix} Z \\ Z[C, :]\, \Pi \end{pmatrix}, \qquad
# \big(Z[C, :]\,\Pi\big)[:, j] = \begin{cases} Z[C, j+1] & j < n \\ 0 & j \ge n. \end{cases}$$
# :::
#
# The general form shifts all $d+2$ channels ($C = \{0, \dots, d+1\}$, the default); the form that
# the constructed parameters need shifts the value channel only, $C = \{d+1\}$. As in [chapter 3](dual_head.html),
# $\Pi$ is never formed: the shift is a copy along the token axis.

# %%
#| export model
def _channels(channels, D:int)->list:
    if channels is None: return list(range(D))
    idx = [channels] if isinstance(channels, int) else list(channels)
    if not idx or any(int(c) != c or not 0 <= c < D for c in idx) or len(set(idx)) != len(idx):
        raise ValueError(f"`channels` must be distinct row indices in 0..{D - 1} (or None for all), got {channels}")
    return [int(c) for c in idx]


# %%
#| export model
def temporal_shift(Z,              # (..., D, N) prompt (D = d + 2 rows)
                   n:int,          # number of context transitions
                   channels=None,  # rows to shift: None (all D rows), an index, or a list of indices
                  )->torch.Tensor: # (..., D + c, N): Z with the c shifted rows appended below
    "Temporal shift module: append `channels` of `Z` shifted one token left, so context column j sees column j + 1."
    Z = as_tensor(Z, "Z")
    if Z.ndim < 2: raise ValueError(f"`Z` must have shape (..., D, N), got {tuple(Z.shape)}")
    N = Z.shape[-1]
    if int(n) != n or not 1 <= n <= N - 1:
        raise ValueError(f"`n` must be an integer in 1..{N - 1} (the columns of `Z` minus the last-state column), got {n}")
    idx = _channels(channels, Z.shape[-2])
    return torch.cat([Z, successor_shift(Z[..., idx, :], int(n))], dim=-2)


# %%
show_doc(temporal_shift)

# %% [markdown]
# On a prompt with three context transitions and one query, the shifted value row holds
# $v(S_1), v(S_2), v(S_3)$ at the context columns and zeros at the last-state and query columns:

# %%
Zt = torch.arange(24, dtype=torch.float64).reshape(4, 6)  # d = 2, n = 3 (+ last state + 2 queries)
T = temporal_shift(Zt, 3, channels=[3])
test_eq(T.shape, (5, 6))
test_eq(T[:4], Zt)
test_eq(T[4], torch.tensor([19., 20., 21., 0., 0., 0.], dtype=torch.float64))
Pi = torch.zeros(6, 6, dtype=torch.float64)
for j in range(3): Pi[j + 1, j] = 1.
test_eq(temporal_shift(Zt, 3), torch.cat([Zt, Zt @ Pi]))
test_eq(temporal_shift(Zt.expand(2, 3, 4, 6), 3, channels=3), T.expand(2, 3, 5, 6))
for msg, args in {"`channels` must be distinct row indices in 0..3": (Zt, 3, [4]),
                  "`channels` must be distinct": (Zt, 3, [1, 1]),
                  "`n` must be an integer in 1..5": (Zt, 6, None),
                  "`Z` must have shape (..., D, N)": (torch.zeros(3), 1, None)}.items():
    test_fail(lambda: temporal_shift(*args), contains=msg)
T


# %% [markdown]
# ## The single-head layer
#
# `SingleHeadTSMLayer` is one ordinary softmax head. Its scores $z_i^\top A z_j$ read the prompt
# $Z$ (equivalently: a score matrix on $\mathrm{TSM}_C(Z)$ that is $A$ padded with zeros), its value
# matrix $V$ is $(d+2) \times (d+2+|C|)$ and reads the shifted prompt, and its output is added to
# the prompt:
#
# $$Z_{l+1} = Z_l + V\, \mathrm{TSM}_C(Z_l)\, S_l .$$
#
# The shift is recomputed from $Z_{l+1}$ before the next layer; it has no parameters.

# %%
#| export model
class SingleHeadTSMLayer(nn.Module):
    "One softmax head whose value matrix reads the prompt through a temporal shift of `channels`."
    def __init__(self, d:int,            # feature dimension; tokens have d + 2 rows
                 channels=None,          # rows the shift appends: None (all d + 2) or indices, e.g. [d + 1]
                 init_gain:float=0.1,    # gain of the Xavier-normal initialisation
                 seed=None,              # int or `torch.Generator` for the initialisation
                 dtype=torch.float64,    # dtype of the stored parameters
                ):
        super().__init__()
        D, g = _token_rows(d), _generator(seed)
        self.d, self.channels = D - 2, _channels(channels, D)
        self.A = _xavier(D, D, init_gain, g, dtype)
        self.V = _xavier(D, D + len(self.channels), init_gain, g, dtype)

    @classmethod
    def from_dual_head(cls, layer:DualHeadSoftmaxLayer,  # the dual-head layer to rewrite
                       channels=None,                     # rows to shift; the target head must read no other row
                      ):
        "The single-head layer with V = [V_cur | V_tgt[:, channels]] equal to `layer` (Theorem 2)."
        D = layer.d + 2
        idx = _channels(channels, D)
        rest = [k for k in range(D) if k not in idx]
        if rest and (layer.V_tgt[:, rest] != 0).any():
            raise ValueError(f"`channels` {idx} must include every row the target head reads: `layer.V_tgt` has non-zero columns among {rest}")
        out = cls(layer.d, idx, seed=0, dtype=layer.A.dtype)
        out.A = nn.Parameter(layer.A.detach().clone())
        out.V = nn.Parameter(torch.cat([layer.V_cur, layer.V_tgt[:, idx]], dim=1).detach().clone())
        return out

    def forward(self, Z,             # (..., d + 2, N) prompt
                n=None,              # number of context transitions; default `Z.n_context`
               )->torch.Tensor:      # (..., d + 2, N) next prompt
        "$Z + V\\,\\mathrm{TSM}_C(Z)\\, S$ with the attention S of `A` on `Z`."
        Z, n = check_prompt(Z, self.d, n)
        A, V = self.A.to(Z), self.V.to(Z)
        return _carry(Z + attend_context(Z, A, (V @ temporal_shift(Z, n, self.channels))[..., :n]), n)


# %%
show_doc(SingleHeadTSMLayer)

# %%
show_doc(SingleHeadTSMLayer.from_dual_head)

# %%
show_doc(SingleHeadTSMLayer.forward)


# %% [markdown]
# ## Theorem 2: two heads are one head on a shifted input
#
# ::: {.theorem}
# **Theorem 2 (our form of the paper's claim that the dual head is a single head plus a shift).**
# *For every $A$, $V^{\mathrm{cur}}$,
# $V^{\mathrm{tgt}}$ and every prompt $Z$ (any $n$, any number of query columns),*
#
# $$Z + V^{\mathrm{cur}} Z S + V^{\mathrm{tgt}} (Z\Pi) S = Z + V\, \mathrm{TSM}(Z)\, S,
# \qquad V = \big[\, V^{\mathrm{cur}} \;\big|\; V^{\mathrm{tgt}} \,\big],$$
#
# *with $S$ the attention of $A$ on $Z$ and $\mathrm{TSM}$ shifting all $d+2$ channels. If the target
# head reads only the channels $C$ (the columns of $V^{\mathrm{tgt}}$ outside $C$ are zero), then
# shifting those channels suffices: $V = [\,V^{\mathrm{cur}} \mid V^{\mathrm{tgt}}[:, C]\,]$ on
# $\mathrm{TSM}_C(Z)$. For $\theta^*$, $C = \{d+1\}$ and
# $V = [\,V^{\mathrm{cur}} \mid \gamma\alpha\, e_{d+1}\,]$: one extra input channel, one weight.*
# :::
#
# ::: {.proof}
# *Proof.* Both layers compute the same attention $S$, since their scores read the same rows of $Z$
# with the same $A$. Multiplying the block matrices,
# $$V\,\mathrm{TSM}(Z) = \big[\, V^{\mathrm{cur}} \;\big|\; V^{\mathrm{tgt}} \,\big]
# \begin{pmatrix} Z \\ Z\Pi \end{pmatrix} = V^{\mathrm{cur}} Z + V^{\mathrm{tgt}} Z \Pi ,$$
# and right-multiplying by $S$ gives the first claim. For the second, write $E_C$ for the
# $(d+2) \times |C|$ matrix of the unit vectors $e_k$, $k \in C$. If the columns of
# $V^{\mathrm{tgt}}$ outside $C$ vanish, then $V^{\mathrm{tgt}} = V^{\mathrm{tgt}} E_C E_C^\top$,
# and $E_C^\top Z \Pi = Z[C, :]\, \Pi$ because selecting rows commutes with multiplying on the
# right. So $V^{\mathrm{tgt}} Z\Pi = V^{\mathrm{tgt}}[:, C]\; Z[C, :]\,\Pi$, which is the block
# product with $\mathrm{TSM}_C(Z)$. For $\theta^*$ the only non-zero column of $V^{\mathrm{tgt}}$
# is column $d+1$, with entry $\gamma\alpha$ in row $d+1$.
# :::
#
# The theorem is an identity of linear algebra, so the checks use parameters that mean nothing:
# random $A$, $V^{\mathrm{cur}}$, $V^{\mathrm{tgt}}$ at full scale and random prompts, not built
# from any trajectory, in batches, for many shapes.

# %%
def theorem2_gap(seed:int)->float:
    "Max |dual-head - single head on TSM| over a batch of random prompts, for random parameters."
    rng = np.random.default_rng(seed)
    d, n, q = int(rng.integers(1, 8)), int(rng.integers(1, 30)), int(rng.integers(0, 4))
    dual = DualHeadSoftmaxLayer(d, init_gain=1., seed=seed)
    single = SingleHeadTSMLayer.from_dual_head(dual)
    Z = torch.from_numpy(rng.normal(size=(3, d + 2, n + 1 + q)))
    return (dual(Z, n) - single(Z, n)).abs().max().item()

gaps = [theorem2_gap(seed) for seed in range(50)]
assert max(gaps) < 1e-12, max(gaps)
max(gaps)

# %% [markdown]
# The gap is rounding error. Stacked, the two forms stay together: eight random dual-head layers
# and their single-head rewrites, each fed its own previous output. (Random layers at full scale
# make the attention logits grow with depth, and a softmax with huge logits amplifies any rounding
# difference, so this stack uses a smaller gain, 0.3; each single layer is checked at full scale
# above.)

# %%
rng = np.random.default_rng(0)
duals = [DualHeadSoftmaxLayer(5, init_gain=0.3, seed=100 + l) for l in range(8)]
Zd = Zs = torch.from_numpy(rng.normal(size=(4, 7, 23)))
for dual in duals: Zd, Zs = dual(Zd, n=20), SingleHeadTSMLayer.from_dual_head(dual)(Zs, n=20)
test_close(Zs, Zd, eps=1e-12)
(Zs - Zd).abs().max().item(), Zd.abs().max().item()

# %% [markdown]
# The one-channel form needs a target head that reads only the shifted channel. A random target
# head reads every channel, so asking for a one-channel rewrite of it is an error; a random target
# head restricted to column $d+1$ (the rest of the layer still random) is rewritten exactly:

# %%
d = 4
dual = DualHeadSoftmaxLayer(d, init_gain=1., seed=7)
test_fail(lambda: SingleHeadTSMLayer.from_dual_head(dual, channels=[d + 1]),
          contains="`layer.V_tgt` has non-zero columns")
V_tgt = torch.zeros(d + 2, d + 2, dtype=torch.float64)
V_tgt[:, d + 1] = torch.from_numpy(rng.normal(size=d + 2))
one = DualHeadSoftmaxLayer.from_params(dual.A, dual.V_cur, V_tgt)
single = SingleHeadTSMLayer.from_dual_head(one, channels=[d + 1])
test_eq(single.V.shape, (d + 2, d + 3))
Zr = torch.from_numpy(rng.normal(size=(5, d + 2, 30)))
test_close(single(Zr, n=26), one(Zr, n=26), eps=1e-12)

# %% [markdown]
# For the constructed parameters the single head's value matrix is $[\,V^{\mathrm{cur}} \mid
# \gamma\alpha e_{d+1}\,]$, and the whole constructed Transformer can be run as a stack of single
# heads on shifted prompts, with the same outputs as the model of [chapter 3](dual_head.html):

# %%
alpha, gamma = 0.4, 0.9
W = torch.from_numpy(rng.normal(size=(d, d)))
A, V_cur, V_tgt = theta_star(d, W, alpha, gamma)
dual_star = DualHeadSoftmaxLayer.from_params(A, V_cur, V_tgt)
single = SingleHeadTSMLayer.from_dual_head(dual_star, channels=[d + 1])
e = torch.zeros(d + 2, 1, dtype=torch.float64); e[d + 1] = 1.
test_eq(single.V.detach(), torch.cat([V_cur, gamma * alpha * e], dim=1))
test_eq(single.A.detach(), A)

mrp = random_boyan_chain(seed=2)
states, rewards = sample_trajectory(mrp, 40, seed=2)
Z0 = build_prompt(mrp.phi[states], rewards, mrp.phi)
model = SoftmaxICTD.from_theta_star(d, 30, W, alpha, gamma)
Zl = Z0
for _ in range(30): Zl = single(Zl, n=40)
test_close(Zl, model(Z0, n=40), eps=1e-12)

# %% [markdown]
# ## What the single head sees
#
# The figure shows the input of the fourth constructed layer on a short context, as the single head
# reads it: the prompt (features, reward, value memory filled by three layers) and, below it, the
# one shifted channel. Row $d+2$ at context column $j$ is the value memory of column $j + 1$: the
# current estimate of the successor state's value, ready to be combined with the reward and the
# current value into a TD error.

# %%
st12, rw12 = sample_trajectory(mrp, 12, seed=5)
model3 = SoftmaxICTD.from_theta_star(d, 3, W, alpha, gamma).requires_grad_(False)
T3 = temporal_shift(model3(build_prompt(mrp.phi[st12], rw12, mrp.phi[[0, 9]]), n=12), 12, channels=[d + 1])
fig, ax = plt.subplots(figsize=(8, 4.4))
lim = T3.abs().max().item()
im = ax.imshow(T3.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
row_names = [rf"$\phi_{i}$" for i in range(d)] + ["reward", "value memory", "shifted value\n(TSM channel)"]
ax.set_yticks(range(d + 3), row_names)
ax.set_xticks(range(15), [f"{j}" for j in range(15)], fontsize=9)
for x in (11.5, 12.5): ax.axvline(x, color="k", lw=1.5)
ax.axhline(d + 1.5, color="k", lw=2)
top = ax.secondary_xaxis("top")
top.set_xticks([5.5, 12, 13.5], ["context", "last\nstate", "queries"], fontsize=9); top.tick_params(length=0)
for j in range(12):
    ax.annotate("", xy=(j, d + 2), xytext=(j + 1, d + 1), arrowprops=dict(arrowstyle="->", color="k", lw=0.6))
ax.set(xlabel="token (column) $j$",
       title=r"$\mathrm{TSM}_{\{d+1\}}(Z_3)$: the input of layer 4 as one head reads it")
fig.colorbar(im, ax=ax, label="entry value", fraction=0.03)
test_fig_exists(ax)
test_eq(T3[d + 2, :12], T3[d + 1, 1:13])
test_eq(T3[d + 2, 12:], torch.zeros(3, dtype=torch.float64))

# %% [markdown]
# The arrows show where each entry of the shifted channel comes from. The dual-head layer and the
# single head with a shift are one layer written two ways; from here on the book uses whichever
# reads better. [The next chapter](convergence.html) asks when the iteration they both run converges.

# %%
#| hide
import nbdev; nbdev.nbdev_export()
