"""InContextTD's training step, re-implemented for timing: the same operations at the same sizes, written for this bench.

The predecessor's public code (repository `Sequential-Intelligence-Lab/InContextTD`, folder `experiment/`: its `train`
loop, `model.py`, `prompt.py`, and `MRP/boyan.py`) trains one Transformer per process. What this file matches, one step
being one optimiser step on one mini-batch:

- data: one random Boyan chain with random features per 5 mini-batches (`n_batch_per_mrp = 5`): features uniform on
  [-1, 1] (float32), transition probabilities, start distribution and a true weight vector drawn with numpy, rewards
  (I - gamma P) X w, the stationary distribution from scipy's `null_space` of I - P^T;
- a mini-batch: the prompt is reset (a start state drawn with `np.random.choice`, then n + 1 transitions, each one
  `np.random.choice` over a row of P), then slid 64 times (`mini_batch_size = 64`), one transition per slide; every
  slide rebuilds the window from Python deques with `np.array(..., float32)` and `torch.from_numpy`, concatenates the
  context (phi, gamma phi', r: 2d + 1 rows, n columns) and a query column into Z (2d + 1, n + 1);
- the model: the softmax `Transformer` in mode 'auto' (one attention layer's P and Q, (2d + 1) x (2d + 1), applied
  l times), Z + (1/n) P Z M softmax(Z^T Q Z, dim=1), M the identity with its last entry 0, Xavier-normal initialisation
  with gain 0.1, float32; the value is -Z[-1, -1];
- a step: 65 forward passes (the reset prompt and 64 slides), the mean squared TD error of the 64 transitions with the
  successor's value detached, one backward pass through all 65 graphs, one Adam step (lr 1e-3, weight decay 1e-6);
- alongside, as the predecessor's loop does at every step, the hard-coded linear Transformer (batch TD with a trainable
  step size alpha) on the same prompts, with its own backward pass and Adam step (`hard=False` leaves it out).

Not matched: the logging every `log_interval` chains (evaluations are timed apart in the engine's rows too) and the
saving of logs. Sizes are the book's: d = 4, s = 10 states, n = 30, l = 3, gamma = 0.9, batch 64.
"""
from collections import deque
import numpy as np
import scipy.linalg
import torch
from torch import nn

def _chain(s, d, gamma, rng):
    "A random Boyan chain with random features and a sampled true weight: (phi (s, d) float32, P, mu, r (s,))."
    phi = rng.uniform(-1, 1, size=(s, d)).astype(np.float32)
    w = rng.standard_normal((d, 1))
    P = np.zeros((s, s))
    for i in range(s - 2):
        p = rng.uniform(0.01, 0.99)
        P[i, i + 1], P[i, i + 2] = p, 1 - p
    P[-2, -1] = 1.0
    P[-1] = rng.uniform(0.01, 0.99, size=s)
    P[-1] /= P[-1].sum()
    null = scipy.linalg.null_space(np.eye(s) - P.T)
    steady = (null / null.sum()).ravel()
    mu = rng.uniform(0.01, 0.99, size=s)
    mu /= mu.sum()
    r = (np.eye(s) - gamma * P) @ (phi @ w)
    return phi, P, mu, r[:, 0], steady

class _SlidingPrompt:
    "The predecessor's prompt: windows of n + 2 features and n + 1 rewards in deques, Z rebuilt at every slide."
    def __init__(self, phi, P, mu, r, n, gamma, rng):
        self.phi, self.P, self.mu, self.r, self.n, self.gamma, self.rng = phi, P, mu, r, n, gamma, rng
        self.s_count, self.d = P.shape[0], phi.shape[1]

    def _move(self, state):
        return self.rng.choice(self.s_count, p=self.P[state]), self.r[state]

    def reset(self):
        self.features, self.rewards = deque(maxlen=self.n + 2), deque(maxlen=self.n + 1)
        self.state = self.rng.choice(self.s_count, p=self.mu)
        self.features.append(self.phi[self.state])
        for _ in range(self.n + 1):
            nxt, rew = self._move(self.state)
            self.features.append(self.phi[nxt]); self.rewards.append(rew)
            self.state = nxt
        return self._z()

    def slide(self):
        nxt, rew = self._move(self.state)
        self.features.append(self.phi[nxt]); self.rewards.append(rew)
        self.state = nxt
        return self._z(), rew

    def _z(self):
        f, rw = np.array(self.features, dtype=np.float32), np.array(self.rewards, dtype=np.float32)
        n, d = self.n, self.d
        context = torch.concat([torch.from_numpy(f[:n]).T, self.gamma * torch.from_numpy(f[1:n + 1]).T, torch.from_numpy(rw[:n]).unsqueeze(0)], 0)
        query = torch.concat([torch.from_numpy(f[n + 1]).reshape(d, 1), torch.zeros((d + 1, 1))], 0)
        return torch.concat([context, query], 1)

def _mask(n):
    M = torch.eye(n + 1)
    M[-1, -1] = 0
    return M

class SoftmaxLayer(nn.Module):
    "Z + (1/n) P Z M softmax(Z^T Q Z, dim=1), with P and Q (2d + 1) x (2d + 1)."
    def __init__(self, d, n):
        super().__init__()
        self.n, self.M = n, _mask(n)
        self.P, self.Q = nn.Parameter(torch.empty(2 * d + 1, 2 * d + 1)), nn.Parameter(torch.empty(2 * d + 1, 2 * d + 1))
        nn.init.xavier_normal_(self.P, gain=0.1); nn.init.xavier_normal_(self.Q, gain=0.1)
        self.act = nn.Softmax(dim=1)
    def forward(self, Z): return Z + 1.0 / self.n * self.P @ Z @ self.M @ self.act(Z.T @ self.Q @ Z)

class HardLinearLayer(nn.Module):
    "Batch TD as a linear attention layer with fixed P and Q and a trainable step size alpha."
    def __init__(self, d, n):
        super().__init__()
        self.n, self.M, self.alpha = n, _mask(n), nn.Parameter(torch.ones(1))
        self.P = torch.zeros(2 * d + 1, 2 * d + 1); self.P[-1, -1] = 1.0
        self.Q = torch.zeros(2 * d + 1, 2 * d + 1)
        self.Q[:d, :d], self.Q[:d, d:2 * d] = -torch.eye(d), torch.eye(d)
    def forward(self, Z): return Z + self.alpha / self.n * self.P @ Z @ self.M @ Z.T @ self.Q @ Z

class Looped(nn.Module):
    "One layer applied `l` times (the predecessor's mode 'auto'); the value is -Z[-1, -1]."
    def __init__(self, layer, l):
        super().__init__()
        self.layer, self.l = layer, l
    def pred_v(self, Z):
        for _ in range(self.l): Z = self.layer(Z)
        return -Z[-1, -1]

def incontexttd_train(n_steps, d=4, s=10, n=30, l=3, gamma=0.9, batch=64, per_chain=5, lr=1e-3, weight_decay=1e-6,
                      hard=True, seed=0, callback=None):
    "`n_steps` optimiser steps of the predecessor's training loop; `callback(step)` after each. Returns the model."
    torch.manual_seed(seed)
    rng = np.random.RandomState(seed)
    tf, tf_hard = Looped(SoftmaxLayer(d, n), l), Looped(HardLinearLayer(d, n), l)
    opt = torch.optim.Adam(tf.parameters(), lr=lr, weight_decay=weight_decay)
    opt_hard = torch.optim.Adam(tf_hard.parameters(), lr=lr, weight_decay=weight_decay)
    models = [(tf, opt)] + ([(tf_hard, opt_hard)] if hard else [])
    for step in range(n_steps):
        if step % per_chain == 0: prompt = _SlidingPrompt(*_chain(s, d, gamma, rng)[:4], n, gamma, rng)
        Z = prompt.reset()
        current = [m.pred_v(Z) for m, _ in models]
        errors = [0.0 for _ in models]
        for _ in range(batch):
            Z, reward = prompt.slide()
            nxt = [m.pred_v(Z) for m, _ in models]
            for i in range(len(models)):
                errors[i] = errors[i] + (reward + gamma * nxt[i].detach() - current[i]) ** 2
            current = nxt
        for (m, o), e in zip(models, errors):
            o.zero_grad(); (e / batch).backward(); o.step()
        if callback is not None: callback(step + 1)
    return tf
