# %% [markdown]
# # Notation and glossary
# > Every symbol of the book once, with its one meaning and where it is defined, and the book's technical terms.

# %% [markdown]
# Each symbol in the tables below has the meaning given there. A few letters take a subscript that makes them a different
# quantity (for example $b_{\mathrm{TD}}$, $b_k$ and $b_0, \dots, b_2$; $a_r$ and the AR(1) coefficient $a$); the subscript is part
# of the symbol, and each is listed. A letter used only inside one proof is defined there and is not listed. Numbered boxes carry the chapter's number
# (Proposition 1.4 is the fourth proposition of chapter 1). Vectors indexed by states are columns;
# **tokens are columns** of the prompt (the [bridge box of chapter 2](prompt.html#from-row-token-attention-to-the-books-columns)
# translates from the row-token convention of most code).
#
# ## The Markov reward process
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $s$ | number of states of the chain (only this) | [chapter 0](boyan.html) |
# | $x, y$ | generic states (a target state is usually $x$, a key's state $y$) | [chapter 1](weighted_softmax_td.html) |
# | $P$ | the $s \times s$ transition matrix of the policy; $\hat P$ its empirical version in a context | [chapter 0](boyan.html), [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
# | $r$ | expected reward per state; $\hat r$ the context's mean reward per state | [chapter 0](boyan.html), [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
# | $\gamma$ | discount factor in $[0, 1)$ | [chapter 0](boyan.html) |
# | $v_\pi$ | true values, $v_\pi = r + \gamma P v_\pi$ | [chapter 0](boyan.html) |
# | $\phi(x) \in \mathbb R^d$, $d$ | feature vector of state $x$ and its dimension | [chapter 0](boyan.html) |
#
# ## A context
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $n$ | number of transitions in the context | [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
# | $S_0, \dots, S_n$; $R_1, \dots, R_n$ | the trajectory's states and rewards; transition $k$ is $(S_{k-1}, R_k, S_k)$ | [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
# | $q$ | number of query states; they are $x_{n+1}, \dots, x_{n+q}$ | [chapter 2](prompt.html) |
# | $m = n + 1 + q$ | number of targets (trajectory states and queries), the columns of the prompt | [chapter 1](weighted_softmax_td.html#the-kernel-view), [chapter 2](prompt.html) |
# | $x_j$ | the state of column (target) $j$: $S_j$ for $j \le n$, a query state after | [chapter 3](dual_head.html) |
# | $N(x)$ | number of transitions of the context that leave $x$ | [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
# | $s'$ | number of distinct target states | [chapter 1](weighted_softmax_td.html#tabular-td-is-a-limit) |
# | $\hat v$ | certainty-equivalence value: $\hat v = \hat r + \gamma \hat P \hat v$ | [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
#
# ## The algorithm (chapter 1)
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $t$, $T$ | iteration index and number of iterations (iteration $t$ = layer $l$) | [chapter 1](weighted_softmax_td.html) |
# | $\delta_k^{(t)}$ | TD error of transition $k$ at iteration $t$ (only this); $\bar\delta_x$ the mean TD error of the transitions leaving $x$ | [chapter 1](weighted_softmax_td.html#td-learning-in-one-page) |
# | $\alpha$ | step size | [chapter 1](weighted_softmax_td.html) |
# | $g(x, y)$ | score of key state $x$ for target state $y$ (key first) | Definition 1.1 |
# | $W$ | $d \times d$ score matrix, $g(x, y) = \phi(x)^\top W \phi(y)$ | Definition 1.1 |
# | $K_k(x)$ | softmax weight of transition $k$ for target $x$; the weights form the $n \times m$ matrix $K$, columns summing to 1 | Definition 1.1 |
# | $\rho(x)$ | per-target weight of weighted softmax TD (only this) | Definition 1.1 |
# | $\beta$ | scale of a tabular score matrix $W = \beta I$ | [chapter 1](weighted_softmax_td.html#from-uniform-to-tabular) |
# | $\varepsilon$ | small scale of the score, $\varepsilon W$ | Proposition 1.4 |
# | $c_k^{(t)}$ | kernel coefficient of transition $k$: $\alpha$ times its accumulated TD errors | Lemma 1.1 |
# | $w_t$, $w^\star$ | linear TD weights and their fixed point $A_{\mathrm{TD}}^{-1} b_{\mathrm{TD}}$ | [chapter 1](weighted_softmax_td.html#linear-td-is-a-special-case-exactly) |
# | $C$ | preconditioner of linear TD (only this) | Proposition 1.4 |
# | $\zeta(x)$ | shift that makes the linear kernel positive | Proposition 1.3 |
# | $\hat M$ | row-stochastic matrix of attention grouped by state | Proposition 1.7, [chapter 5](convergence.html) |
# | $\kappa$ | contraction constant of an error recursion (only this); $\hat\kappa$ for a context | Proposition 1.7, Proposition 5.1 |
# | $F$ | the map of one iteration, $v \mapsto F v + f$ | [chapter 1](weighted_softmax_td.html#tabular-td-is-a-limit) |
# | $J$, $\chi$, $\xi$ | grouped update matrix of Proposition 1.8, its centring indicator, the constant its limit is shifted by | Proposition 1.8 |
#
# ## The Transformer (chapters 2 to 4a)
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $Z_l$, $z_j$ | the prompt entering layer $l$, $(d + 2) \times m$, and its column $j$ | Definition 2.1 |
# | $l$, $L$ | layer index and number of layers | [chapter 3](dual_head.html) |
# | $A$ | $(d+2) \times (d+2)$ score matrix of a layer, scores $z_i^\top A z_j$ (key $i$ first) | [chapter 3](dual_head.html#the-layer) |
# | $S_l$ | attention matrix, $S_l[i, j]$ for key $i$ and column $j$, column-stochastic | [chapter 3](dual_head.html#the-layer) |
# | $\omega_i$ | attention mask: $0$ for the $n$ keys, $-\infty$ for the last state and the queries | [chapter 3](dual_head.html#the-layer) |
# | $\Pi$ | successor shift: column $j < n$ of $Z\Pi$ is column $j + 1$ of $Z$ | [chapter 3](dual_head.html#the-layer) |
# | $V^{\mathrm{cur}}, V^{\mathrm{tgt}}$ | value matrices of the current-value and target-value heads | [chapter 3](dual_head.html#the-layer) |
# | $V$ | value matrix of a single head | [chapter 4](tsm.html) |
# | $\mathcal C$ | set of channels (rows) a temporal shift appends | Definition 4.1 |
# | $\theta^*$ | the constructed parameters of the dual-head layer | Definition 3.1 |
# | $\theta^{\delta}$ | the TD-memory parameters of the shift-after-attention layer | Definition 4.2 |
# | $\mathrm{TF}_L(Z_0)$ | the model's readout: the value row of $Z_L$ at the query columns | [chapter 3](dual_head.html#the-model) |
# | $\lambda$ | positional (recency) bias of a causal layer: the logit of key $i$ gains $\lambda \log i$ | [chapter 4a](causal.html#the-causal-layer) |
# | $D = d + 2$; $\tilde Z_l$ | token length of the causal model; the shifted tokens a causal layer's keys read | [chapter 4a](causal.html#the-causal-layer) |
# | $\mathcal I(j)$ | the keys column $j$ of a causal layer attends to, $\{1, \dots, \min(j, n)\}$ | [chapter 4a](causal.html#the-causal-layer) |
# | $U$ | per-token map of a causal layer (the code's `U`) | [chapter 4a](causal.html#the-causal-layer) |
# | $\sigma_j$ | number of keys' weights a causal target receives, $\sum_k K_{kj} \in \{0, 1\}$ (chapter 4a's proofs only) | Proposition 4a.2 |
# | $\mathsf Q, \mathsf K, \mathsf V$ | row-token query, key and value matrices (the bridge box only) | [chapter 2](prompt.html#from-row-token-attention-to-the-books-columns) |
#
# ## Convergence (chapters 5 and 5a)
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $d_\pi$ | stationary distribution of $P$ | [chapter 0](boyan.html) |
# | $h = e^g$; $\mathcal H$, $\mathcal Z$ | exponentiated score, $h(y, x) = e^{g(y, x)}$; the matrix of $h$ and the diagonal of softmax normalisers | [chapter 5](convergence.html), Proposition 5.6 |
# | $M_\pi$, $M$ | population attention grouped by state, row-stochastic; $M$ any such matrix | [chapter 5](convergence.html) |
# | $B$, $\hat B$ | error matrix of the recursion, $B = I - \alpha M (I - \gamma P)$, and its context version | Proposition 5.1 |
# | $e_l$ | error after $l$ layers, $v_l - v_\pi$ | Proposition 5.1 |
# | $\kappa_{\mathrm{tab}}$ | tabular rate $1 - \alpha(1 - \gamma)$: the rate of the constant direction, and $\kappa$ at $M = I$ | Proposition 5.2 |
# | $\operatorname{sp}(v)$ | span seminorm $\max_x v(x) - \min_x v(x)$ | Proposition 5.2 |
# | $\operatorname{sc}(H)$ | span coefficient of a matrix $H$ with constant row sums (how much it contracts $\operatorname{sp}$) | Proposition 5.2 |
# | $\operatorname{spr}(B)$ | spectral radius of $B$ | [chapter 5](convergence.html#how-diagonal-is-diagonal-enough-the-true-threshold) |
# | $\hat v_\infty$; $\mathcal K$, $\hat M_{\mathcal K}$, $E$ | empirical fixed point of the recursion; the key states, the key columns $\hat M_{:, \mathcal K}$ and $(I - \gamma \hat P)_{\mathcal K, :}$ | [chapter 5](convergence.html#the-fixed-point-and-the-statistical-floor) |
# | $\Delta_y$, $\bar\Delta_x$ | deviation of key state $y$'s visit count from its expectation, relative; their attention-weighted mean for target $x$ | Lemma 5.1 |
# | $t_x$, $\tau_x$; $p_{\mathrm{fail}}$ | worst expected hitting time of $x$ and the hitting time; the failure probability of a high-probability bound | Proposition 5.4 |
# | $w$, $\nu_y$ | positive state weights; convex weights of a state's features in the hull of the others | Proposition 5.5 |
# | $\eta$, $P_\eta$ | laziness and the lazy chain | Proposition 5.6 |
# | $\mu$; $\mu_{\min}$, $\mu_2(P)$; $\mu_k$ | an eigenvalue (of $M$ unless said); the smallest eigenvalue of $M$, the second largest eigenvalue of $P$ in modulus; the eigenvalue of the smoother $M$ on harmonic $k$ of the circle | Proposition 5.6, [chapter 8](continuous.html) |
# | $m^*$, $m_c$, $m_\infty$ | diagonality threshold; its circulant lower bound and that bound's limit as $s \to \infty$ | Proposition 5.7 |
#
# ## Pretraining and what it finds (chapters 6 to 6c)
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $\theta$; $\mathrm{TF}(Z_0; \theta)$ | all parameters of a model; its prediction at the query | [chapter 6](pretrain.html) |
# | $x_q$, $x_q'$; $\delta_q$ | the query state and its successor; the TD error at the query | [chapter 6](pretrain.html) |
# | $\mathrm{lr}$ | Adam's learning rate | [chapter 6](pretrain.html) |
# | $a_r$, $a_{v'}$, $a_v$ | a layer's value weights: on the reward, on the successor's value, on the current value ($\theta^*$: $\alpha(1, \gamma, -1)$) | [chapter 6](pretrain.html), [chapter 6b](mechanism.html) |
# | $G(\theta)$; $G_i$; $N_b$ | the expected semi-gradient update, $\mathbb E[\delta_q \nabla_\theta \mathrm{TF}]$; a batch mean of it; the number of batch means | [chapter 6](pretrain.html), [chapter 6b](mechanism.html) |
# | $J_G$; $D_\pi$ | the Jacobian of $G$ at a rest point; $\mathrm{diag}(d_\pi)$ | [chapter 6b](mechanism.html) |
# | MSVE, cMSVE | $d_\pi$-weighted squared value error; the same after centring both value vectors | [chapter 6](pretrain.html), [chapter 6b](mechanism.html) |
# | $\bar R$; $\tilde r_\beta$, $\tilde r^+_\beta$; $b_0, b_R, b_1, b_2$ | the context's mean reward; the smoothed reward and next reward; the learned estimator's constants | [chapter 6b](mechanism.html) |
# | $a_0(y)$; $\Delta a$ | the rest of a layer's value-row write; weight moved between the two value heads | [chapter 6b](mechanism.html) |
# | $N_{\mathrm{seeds}}$; $p_0$, $k_{p_0}$ | number of seeds; the success probability a seed-count claim rules out, and the count it needs | [chapter 6a](emergence.html) |
# | $Y$, $T_{\mathrm{win}}$, $\mathrm{tol}_Y$ | a training metric, the window and the tolerance of the stopping rule | [chapter 6b](mechanism.html) |
#
# ## Linear attention and continuous states (chapters 7 to 8b)
#
# | symbol | meaning | defined in |
# |---|---|---|
# | $V_l$, $A_l$ | a linear-attention layer's value projection and score matrix, $(2d+1) \times (2d+1)$ | [chapter 7](linear.html) |
# | $G_l$; $\Sigma_l$ | the multiplier of a linear layer in one-matrix form; the context's second moments | [chapter 7](linear.html) |
# | $\hat A_{\mathrm{TD}}$, $\hat b_{\mathrm{TD}}$ | batch TD's matrix and vector on a context | [chapter 7](linear.html) |
# | $d_0$; $n_{\mathrm{mb}}$ | a trajectory's start distribution; the mini-batch size of the sliding-window protocol | [appendix C, the sliding protocol](sliding.html) |
# | $\psi(\alpha)$ | the expected semi-gradient in the step size | Proposition 7.3 |
# | $v_{TD}$, $v_{TF}$; $w_{TD}$, $w_{TF}$ | values and weights of batch TD and of the Transformer | [chapter 7](linear.html) |
# | $x, y$ | states of a continuous process (real numbers or angles) | [chapter 8](continuous.html) |
# | $\vartheta$, $\sigma$ | drift and noise of the rotation process; $\sigma$ also the AR(1) noise | [chapter 8](continuous.html) |
# | $a$; $\sigma_\infty$ | AR(1) coefficient; its stationary standard deviation | [chapter 8](continuous.html) |
# | $p_k$; $b_k$ | Fourier multiplier of the rotation's transition on harmonic $k$; the rate (eigenvalue of $B$) of harmonic $k$ | [chapter 8](continuous.html) |
# | $r_k$, $r_0$; $\mathbf r$, $\mathbf v_\pi$ | reward coefficients and level; coefficient vectors of the reward and the values | [chapter 8](continuous.html) |
# | $\mathcal T_{a,\sigma}$ | the AR(1) transition operator on polynomials | [chapter 8](continuous.html) |
# | $W_\beta$; $\hat\beta$ | the Gaussian-kernel score matrix on features $(x, 1, x^2)$; a fitted score scale | [chapter 8](continuous.html), [chapter 8b](continuous_pretraining.html) |
#
# ## Glossary
#
# **Certainty equivalence.** Solving the empirical Markov reward process of the context, $\hat v = \hat r + \gamma \hat P \hat v$,
# as if it were the true one. Batch tabular TD converges to it; a state the context never leaves is made absorbing
# ([chapter 1](weighted_softmax_td.html#tabular-td-is-a-limit)).
#
# **Kernel diagonality.** The condition $\min_x M(x, x) > (1 + \gamma)/2$ on the attention grouped by state: each state
# puts more than $(1+\gamma)/2$ of its attention on transitions leaving itself. It makes the layer recursion a contraction
# (Proposition 1.7 for a context; Proposition 5.1 of [chapter 5](convergence.html) in the population).
#
# **NEU.** The norm of the expected update, $\|\mathbb E[\delta\, \nabla_\theta \mathrm{TF}(Z_0; \theta)]\|^2$: zero at a rest
# point of multi-task TD pretraining ([chapter 6](pretrain.html)).
#
# **Population recursion.** The layer recursion in the limit of an infinite context, $v_{l+1} = v_l + \alpha M_\pi (r + \gamma P v_l - v_l)$,
# with $M_\pi$ the population attention matrix ([chapter 5](convergence.html)).
#
# **Span condition.** A contraction condition weaker than kernel diagonality: some power of the error recursion's matrix
# contracts the spread $\operatorname{sp}(v) = \max_x v(x) - \min_x v(x)$ of a vector: $\operatorname{sc}(B^k) < 1$ for some $k$
# (Proposition 5.2 of [chapter 5](convergence.html)).
#
# **State tokens.** A context column's token is a function of its state, so the $n$ keys collapse to $s$ tokens, one per
# state, weighted by their visit counts; a forward pass then costs $s + 1 + q$ columns whatever $n$ is ([chapter 6](pretrain.html)).
#
# **Statistical floor.** The part of a deep model's error that depth cannot remove: the distance between the iteration's
# fixed point for a finite context and $v_\pi$; it falls with $n$ ([chapter 5](convergence.html)).
#
# **$\theta^*$.** The constructed parameters under which each dual-head layer is exactly one iteration of weighted softmax TD
# (Definition 3.1, Theorem 3.1).
#
# **$\theta^{\delta}$.** The parameters under which a single head followed by a shift of its output runs the same iteration,
# keeping the TD errors in a memory row (Definition 4.2, Theorem 4.2).
#
# **Weighted softmax TD.** TD learning in which the value of any target state moves by a softmax-weighted average of the
# context's TD errors (Definition 1.1).
