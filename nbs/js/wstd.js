// Weighted softmax TD in the browser: a port of ictd.wstd.weighted_softmax_td (rho = 1, scores phi(x)^T W phi(y)),
// in float64 like the library, checked against it by tests/test_site.py. Arrays are plain nested JS arrays.
(function (root) {
  'use strict';

  function fail(msg) { throw new RangeError(msg); }

  function matrix(a, name, cols) {
    if (!Array.isArray(a) || !a.every(r => Array.isArray(r) && r.length === (cols ?? a[0]?.length) && r.every(Number.isFinite)))
      fail(`\`${name}\` must be a list of rows of ${cols ?? 'equal'} finite numbers`);
    return a;
  }

  function scalar(x, name) {
    if (typeof x !== 'number' || !Number.isFinite(x)) fail(`\`${name}\` must be a finite number, got ${x}`);
    return x;
  }

  // Softmax weights K[k][j] of the n transitions (keys S_0..S_{n-1}) for each of the m = n+1+q targets (S_0..S_n, then
  // the queries), from scores keys[k]^T W targets[j]; each column sums to 1 (shifted by its maximum, as torch.softmax).
  function contextWeights(phiStates, W, phiQueries = []) {
    matrix(phiStates, 'phiStates');
    const n = phiStates.length - 1, d = phiStates[0]?.length ?? 0;
    if (n < 1 || d < 1) fail('`phiStates` must have n+1 >= 2 rows of d >= 1 features');
    matrix(W, 'W', d);
    if (W.length !== d) fail(`\`W\` must be ${d} x ${d}`);
    if (phiQueries.length) matrix(phiQueries, 'phiQueries', d);
    const keys = phiStates.slice(0, n), targets = phiStates.concat(phiQueries), m = targets.length;
    const kW = keys.map(k => W[0].map((_, c) => k.reduce((s, kv, r) => s + kv * W[r][c], 0)));
    const K = kW.map(row => targets.map(x => row.reduce((s, v, c) => s + v * x[c], 0)));
    for (let j = 0; j < m; j++) {
      let mx = -Infinity, sum = 0;
      for (let k = 0; k < n; k++) mx = Math.max(mx, K[k][j]);
      for (let k = 0; k < n; k++) { K[k][j] = Math.exp(K[k][j] - mx); sum += K[k][j]; }
      for (let k = 0; k < n; k++) K[k][j] /= sum;
    }
    return K;
  }

  // Every iterate v_0 = 0, v_1, ..., v_nIters of v_{t+1}(x) = v_t(x) + alpha sum_k K_k(x) delta_k^(t), with
  // delta_k = R_k + gamma v_t(S_k) - v_t(S_{k-1}); each iterate holds the values at S_0..S_n, then the queries.
  function weightedSoftmaxTDIterates(phiStates, rewards, W, alpha, gamma, nIters, phiQueries = []) {
    const K = contextWeights(phiStates, W, phiQueries), n = K.length, m = K[0].length;
    if (!Array.isArray(rewards) || rewards.length !== n || !rewards.every(Number.isFinite)) fail(`\`rewards\` must hold ${n} finite numbers`);
    scalar(alpha, 'alpha');
    if (!(scalar(gamma, 'gamma') >= 0 && gamma < 1)) fail(`\`gamma\` must lie in [0, 1), got ${gamma}`);
    if (!Number.isInteger(nIters) || nIters < 0) fail(`\`nIters\` must be a non-negative integer, got ${nIters}`);
    for (const row of K) for (let j = 0; j < m; j++) row[j] *= alpha;
    let v = new Array(m).fill(0);
    const vs = [v], delta = new Array(n);
    for (let t = 0; t < nIters; t++) {
      for (let k = 0; k < n; k++) delta[k] = rewards[k] + gamma * v[k + 1] - v[k];
      const next = v.slice();
      for (let j = 0; j < m; j++) {
        let s = 0;
        for (let k = 0; k < n; k++) s += delta[k] * K[k][j];
        next[j] += s;
      }
      vs.push(v = next);
    }
    return vs;
  }

  // The values after nIters iterations, at S_0..S_n then the queries, as ictd.wstd.weighted_softmax_td returns them.
  function weightedSoftmaxTD(phiStates, rewards, W, alpha, gamma, nIters, phiQueries = []) {
    const vs = weightedSoftmaxTDIterates(phiStates, rewards, W, alpha, gamma, nIters, phiQueries);
    return vs[vs.length - 1];
  }

  // The attention of a query in each state x on the keys in each state y, M_hat[x][y] = sum_{k: S_{k-1} = y} K_k(x),
  // as ictd.convergence.empirical_attention computes it.
  function empiricalAttention(phi, W, states) {
    const s = phi.length, n = states.length - 1;
    const K = contextWeights(states.map(i => phi[i]), W, phi);
    return phi.map((_, x) => {
      const row = new Array(s).fill(0);
      for (let k = 0; k < n; k++) row[states[k]] += K[k][n + 1 + x];
      return row;
    });
  }

  root.ictd = Object.assign(root.ictd || {}, {contextWeights, weightedSoftmaxTD, weightedSoftmaxTDIterates, empiricalAttention});
})(typeof window !== 'undefined' ? window : globalThis);
