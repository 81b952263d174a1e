// The front page's interactive figure: weighted softmax TD (js/wstd.js) on the chains and trajectories that
// tools/explorable_data.py exports from ictd (js/wstd-data.js), drawn with Observable Plot (js/plot.umd.min.js on d3).
(function () {
  'use strict';
  const D = window.ICTD_DATA, root = document.getElementById('wstd-explorable');
  if (!root) return;
  if (!D || !window.Plot || !window.ictd) { root.textContent = 'The interactive figure needs js/wstd-data.js, js/plot.umd.min.js and js/wstd.js.'; return; }

  const KIND_NAMES = {onehot: 'one-hot', unit: 'unit norm', random: 'random U(−1, 1)'};
  const CONTROLS = [
    {key: 'seed', label: 'chain seed', options: D.seeds, value: 0},
    {key: 'kind', label: 'features', options: D.kinds, names: KIND_NAMES, value: 'onehot'},
    {key: 'beta', label: 'β (W = βI)', min: 0, max: 20, step: 0.5, value: 5},
    {key: 'alpha', label: 'α (step size)', min: 0.05, max: 1, step: 0.05, value: 0.5},
    {key: 'depth', label: 'depth L', min: 0, max: 100, step: 1, value: 30},
    {key: 'n', label: 'context length n', min: 10, max: D.n_max, step: 10, value: 200},
  ];
  const fmt = (x, p = 3) => (Math.abs(x) >= 1e-3 && Math.abs(x) < 1e4) || x === 0 ? x.toFixed(p) : x.toExponential(p - 1);

  // Controls: a select or a slider per parameter, with its value shown beside it.
  const form = document.createElement('form');
  form.className = 'wstd-controls';
  form.addEventListener('submit', e => e.preventDefault());
  for (const c of CONTROLS) {
    const label = document.createElement('label'), out = document.createElement('output');
    const input = document.createElement(c.options ? 'select' : 'input');
    input.name = c.key;
    if (c.options) for (const o of c.options) input.add(new Option(c.names?.[o] ?? String(o), String(o)));
    else Object.assign(input, {type: 'range', min: c.min, max: c.max, step: c.step});
    input.value = String(c.value);
    out.name = c.key + '-value';
    label.append(c.label + ' ', input, out);
    form.append(label);
  }
  const figs = document.createElement('div'), readout = document.createElement('p');
  figs.className = 'wstd-figures';
  readout.className = 'wstd-readout';
  root.replaceChildren(form, figs, readout);

  function params() {
    const p = {};
    for (const c of CONTROLS) {
      const v = form.elements[c.key].value;
      p[c.key] = c.key === 'kind' ? v : Number(v);
      form.elements[c.key + '-value'].value = c.options ? '' : String(p[c.key]);
    }
    return p;
  }

  // Everything the figure shows, for one setting of the controls.
  function compute({seed, kind, beta, alpha, depth, n}) {
    const c = D.chains[`${kind}/${seed}`], s = c.phi.length, d = c.phi[0].length;
    const states = c.states.slice(0, n + 1), phiStates = states.map(i => c.phi[i]), rewards = states.slice(0, n).map(i => c.r[i]);
    const W = c.phi[0].map((_, i) => c.phi[0].map((_, j) => (i === j ? beta : 0)));
    const vs = ictd.weightedSoftmaxTDIterates(phiStates, rewards, W, alpha, c.gamma, depth, c.phi).map(v => v.slice(n + 1));
    const msve = vs.map(v => v.reduce((e, vx, x) => e + c.d_pi[x] * (vx - c.v_pi[x]) ** 2, 0));
    const M = ictd.empiricalAttention(c.phi, W, states);
    const visits = new Array(s).fill(0);
    for (const i of states.slice(0, n)) visits[i]++;
    return {c, s, d, vL: vs[depth], msve, M, visits, minDiag: Math.min(...M.map((row, x) => row[x]))};
  }

  function valuesPlot({c, s, vL, visits}, p) {
    const rows = [];
    for (let x = 0; x < s; x++) rows.push({x, v: c.v_pi[x], series: 'v_π (true values)', N: visits[x]}, {x, v: vL[x], series: `v_L, L = ${p.depth}`, N: visits[x]});
    return Plot.plot({
      width: 330, height: 250, marginLeft: 40,
      x: {label: 'state x', ticks: s, tickFormat: 'd'}, y: {label: 'value', grid: true},
      color: {legend: true, domain: rows.slice(0, 2).map(r => r.series), range: ['#222', '#d62728']},
      marks: [Plot.ruleY([0], {stroke: '#bbb'}),
              Plot.line(rows, {x: 'x', y: 'v', stroke: 'series', strokeWidth: 1.5}),
              Plot.dot(rows, {x: 'x', y: 'v', fill: 'series', r: 3.5, title: r => `${r.series}\nstate ${r.x}: ${fmt(r.v)}\nkeys in this state: ${r.N}`})],
    });
  }

  // Labelled ticks for a log axis: the powers of ten in range, or a few round values when it spans less than a decade.
  function logTicks([lo, hi]) {
    const decades = d3.range(Math.ceil(Math.log10(lo)), Math.floor(Math.log10(hi)) + 1).map(k => 10 ** k);
    return decades.length >= 2 ? decades : d3.ticks(lo, hi, 4).filter(t => t > 0);
  }

  function errorPlot({msve}) {
    const rows = msve.map((e, l) => ({l, e})), [min, max] = d3.extent(msve);
    const [lo, hi] = min === max ? [min / 2, max * 2] : [min, max];  // depth 0: one point, in the middle of a wider axis
    return Plot.plot({
      width: 330, height: 250, marginLeft: 48,
      x: {label: 'layer l', tickFormat: 'd'}, y: {type: 'log', label: 'MSVE (d_π-weighted)', grid: true, domain: [lo, hi], ticks: logTicks([lo, hi]), tickFormat: d3.format('.3~g')},
      marks: [Plot.line(rows, {x: 'l', y: 'e', stroke: '#1f77b4'}),
              Plot.dot(rows.slice(-1), {x: 'l', y: 'e', fill: '#1f77b4', r: 3.5, title: r => `l = ${r.l}: MSVE ${fmt(r.e)}`})],
    });
  }

  function kernelPlot({M, s}) {
    const rows = M.flatMap((row, x) => row.map((m, y) => ({x, y, m})));
    return Plot.plot({
      width: 330, height: 320, marginLeft: 40, padding: 0.04,
      x: {label: 'key state y', type: 'band', domain: d3.range(s)}, y: {label: 'query state x', type: 'band', domain: d3.range(s)},
      color: {scheme: 'blues', domain: [0, 1], legend: true, label: 'M̂(x, y)'},
      marks: [Plot.cell(rows, {x: 'y', y: 'x', fill: 'm', title: r => `M̂(${r.x}, ${r.y}) = ${fmt(r.m)}`}),
              Plot.text(rows.filter(r => r.x === r.y), {x: 'y', y: 'x', text: r => r.m.toFixed(2), fontSize: 9, fill: r => (r.m > 0.55 ? 'white' : 'black')})],
    });
  }

  // A plot under a one-line title (a div, not a heading, so that the page's table of contents ignores it).
  function panel(title, plot, name) {
    const div = document.createElement('div'), head = document.createElement('div');
    div.className = 'wstd-panel';
    div.dataset.panel = name;
    head.className = 'wstd-panel-title';
    head.textContent = title;
    div.append(head, plot);
    return div;
  }

  function update() {
    const p = params(), r = compute(p), bound = (1 + r.c.gamma) / 2;
    figs.replaceChildren(panel('Values by state', valuesPlot(r, p), 'values'), panel('Error against depth', errorPlot(r), 'error'),
                         panel('Attention M̂(x, y) of a query in state x on the keys in state y', kernelPlot(r), 'attention'));
    const unvisited = r.visits.filter(v => v === 0).length;
    readout.textContent = `After L = ${p.depth} layers on n = ${p.n} transitions: MSVE ${fmt(r.msve[p.depth])} ` +
      `(${fmt(r.msve[0])} at v = 0). Kernel diagonality: min over x of M̂(x, x) = ${fmt(r.minDiag, 2)}, ` +
      `${r.minDiag > bound ? 'above' : 'below'} (1 + γ)/2 = ${fmt(bound, 2)}` +
      (unvisited ? `; ${unvisited} of ${r.s} states never appear among the keys.` : '.');
    Object.assign(root.dataset, {msve: String(r.msve[p.depth]), params: JSON.stringify(p)});
  }

  form.addEventListener('input', update);
  update();
})();
