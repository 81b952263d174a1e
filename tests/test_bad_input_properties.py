"""Issue 33, item 5: a hypothesis-driven property test over the book's central public functions.

Each entry point below is called with valid arguments but one, which hypothesis replaces by a randomly drawn bad value:
- a tensor with one of its constrained dimensions resized (a shape that cannot be right whatever the batch dimensions);
- a tensor with one entry set to NaN, +inf or -inf, at a random position;
- a tensor of complex dtype (torch or numpy);
- a tensor of integer or boolean dtype (torch or numpy);
- for a number: NaN, +-inf, a complex number, a bool, a vector; for a discount: also a value outside [0, 1);
  for a count (>= 1) or an index (>= 0): also a negative or fractional value, and 0 for a count.

The property: a bad value is refused with a `ValueError` or `TypeError` whose message names one of the function's
arguments in backticks. Integer and boolean tensors are the one exception the book states (`as_tensor`: they are cast to
float64): such a call may be accepted, but then its answer must equal the answer for the tensor cast to float64 by hand,
so an integer input never changes the arithmetic (the way an integer prompt once cast a model's parameters to int).

`test_the_property_test_covers_these_functions` lists what is covered; `KNOWN_SILENT` lists (entry point, argument, kind)
that are still accepted silently, each a strict xfail with what happens, in a module this test's author does not own."""
import dataclasses, math
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from ictd.boyan import MRP, msve, weighted_error
from ictd.continuous import NoisyRotation, kernel_td, population_msve
from ictd.linear import LinearICTD, build_linear_prompt
from ictd.model import SoftmaxICTD, theta_star
from ictd.engine import PretrainConfig, held_out_tasks
from ictd.pretrain import evaluate
from ictd.prompt import build_prompt
from ictd.wstd import batch_linear_td, context_weights, two_head_linear_td, weighted_softmax_td

pytestmark = pytest.mark.unit

_g = torch.Generator().manual_seed(0)
CTX = torch.randn(6, 2, dtype=torch.float64, generator=_g)             # phi(S_0..S_5): n = 5, d = 2
REW = torch.randn(5, dtype=torch.float64, generator=_g)
QRY = torch.randn(3, 2, dtype=torch.float64, generator=_g)             # three queries
W2 = torch.tensor([[1., 0.2], [0.2, 0.5]], dtype=torch.float64)
P3 = torch.tensor([[0.5, 0.5, 0.], [0., 0.5, 0.5], [0.5, 0., 0.5]], dtype=torch.float64)
R3, PHI3 = torch.tensor([1., 0., -1.], dtype=torch.float64), torch.eye(3, 2, dtype=torch.float64) + 0.1
MRP3 = MRP(P3, R3, 0.9, PHI3)
SOFTMAX = SoftmaxICTD.from_theta_star(2, W2, n_layers=3, alpha=0.5, gamma=0.9)
LINEAR = LinearICTD.from_td(2, n_layers=3, alpha=0.5)
Z_SOFTMAX = torch.as_tensor(build_prompt(CTX, REW, QRY)).contiguous()  # (d + 2, n + 1 + q) = (4, 9)
Z_LINEAR = build_linear_prompt(CTX, REW, QRY, 0.9).contiguous()       # (2d + 1, n + q) = (5, 8), a plain tensor
ROTATION = NoisyRotation(reward="cos")
ANGLES = torch.linspace(0, 6, 6, dtype=torch.float64)
SMALL = PretrainConfig(n_states=4, d=2, n=5, n_layers=1, eval_tasks=2)              # evaluate: two held-out tasks, n = 5
TASKS, STATES = held_out_tasks(SMALL)                                                 # STATES: (2, 6) state indices
ONE_LAYER = SoftmaxICTD(2, n_layers=1, seed=0)
def _with(x, value, at=(0, 1)):
    "`x` with entry `at` set to `value`."
    x = x.clone(); x[at] = value; return x

# entry point -> (callable, valid keyword arguments, argument -> kind); a tensor's kind names its constrained dimensions
TENSOR = lambda *dims: ("tensor", dims)
COVERED = {
    "theta_star": (theta_star, dict(d=2, W=W2, alpha=0.5, gamma=0.9),
                   dict(d=("count",), W=TENSOR(-2, -1), alpha=("number",), gamma=("gamma",))),
    "weighted_softmax_td": (weighted_softmax_td, dict(phi_states=CTX, rewards=REW, W=W2, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=QRY),
                            dict(phi_states=TENSOR(-2, -1), rewards=TENSOR(-1), W=TENSOR(-2, -1), alpha=("number",), gamma=("gamma",),
                                 n_iters=("index",), phi_queries=TENSOR(-1))),
    "batch_linear_td": (batch_linear_td, dict(phi_states=CTX, rewards=REW, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=QRY),
                        dict(phi_states=TENSOR(-2, -1), rewards=TENSOR(-1), alpha=("number",), gamma=("gamma",), n_iters=("index",),
                             phi_queries=TENSOR(-1))),
    "build_prompt": (build_prompt, dict(phi_states=CTX, rewards=REW, phi_queries=QRY),
                     dict(phi_states=TENSOR(-2, -1), rewards=TENSOR(-1), phi_queries=TENSOR(-1))),
    "build_linear_prompt": (build_linear_prompt, dict(phi_states=CTX, rewards=REW, phi_queries=QRY, gamma=0.9),
                            dict(phi_states=TENSOR(-2, -1), rewards=TENSOR(-1), phi_queries=TENSOR(-1), gamma=("gamma",))),
    "SoftmaxICTD.predict": (SOFTMAX.predict, dict(Z=Z_SOFTMAX, n=5), dict(Z=TENSOR(-2), n=("count",))),
    "LinearICTD.predict": (LINEAR.predict, dict(Z=Z_LINEAR, n=5), dict(Z=TENSOR(-2), n=("count",))),
    "MRP": (MRP, dict(P=P3, r=R3, gamma=0.9, phi=PHI3), dict(P=TENSOR(-2, -1), r=TENSOR(-1), gamma=("gamma",), phi=TENSOR(-2))),
    "msve": (msve, dict(v_hat=R3, task=MRP3), dict(v_hat=TENSOR(-1))),
    "weighted_error": (weighted_error, dict(v_hat=R3, v=MRP3.v_pi, weights=MRP3.d_pi), dict(v_hat=TENSOR(-1), v=TENSOR(-1), weights=TENSOR(-1))),
    "two_head_linear_td": (two_head_linear_td, dict(phi_states=CTX, rewards=REW, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=QRY),
                           dict(phi_states=TENSOR(-2, -1), rewards=TENSOR(-1), alpha=("number",), gamma=("gamma",), n_iters=("index",),
                                phi_queries=TENSOR(-1))),
    "context_weights": (context_weights, dict(phi_states=CTX, W=W2, phi_queries=QRY), dict(phi_states=TENSOR(-1), W=TENSOR(-2, -1), phi_queries=TENSOR(-1))),
    "SoftmaxICTD.forward": (SOFTMAX, dict(Z=Z_SOFTMAX, n=5), dict(Z=TENSOR(-2), n=("count",))),
    "LinearICTD.forward": (LINEAR, dict(Z=Z_LINEAR, n=5), dict(Z=TENSOR(-2), n=("count",))),
    "evaluate": (evaluate, dict(model=ONE_LAYER, eval_tasks=TASKS, eval_states=STATES, config=SMALL, neu_seed=0),
                 dict(model=("one_of", {"string": "model", "None": None, "model of another d": SoftmaxICTD(3, n_layers=1, seed=0)}),
                      eval_tasks=("one_of", {"string": "tasks", "None": None, "tasks of another d": held_out_tasks(dataclasses.replace(SMALL, d=3))[0]}),
                      eval_states=("one_of", {"string": "abc", "float states": STATES.double(), "bool states": STATES.bool(),
                                              "negative state": _with(STATES, -1), "state >= n_states": _with(STATES, 4),
                                              "1-d states": STATES[0], "shorter context": STATES[:, :4], "more tasks": STATES.repeat(2, 1)}),
                      config=("one_of", {"string": "config", "config of another n": dataclasses.replace(SMALL, n=4),
                                         "config of another gamma": dataclasses.replace(SMALL, gamma=0.5)}),
                      neu_seed=("index",))),
    "population_msve": (population_msve, dict(process=ROTATION, alpha=0.5, beta=2., n_layers=3, m=64),
                        dict(alpha=("number",), beta=("number",), n_layers=("index",), m=("count",))),
    "kernel_td": (kernel_td, dict(process=ROTATION, states=ANGLES, rewards=ANGLES[:-1].cos(), alpha=0.5, beta=2., n_layers=3, queries=ANGLES[:3]),
                  dict(states=TENSOR(-1), rewards=TENSOR(-1), alpha=("number",), beta=("number",), n_layers=("index",), queries=TENSOR())),
}
CASES = [(name, arg) for name, (_, _, kinds) in COVERED.items() for arg in kinds]

# (entry point, argument, kind of bad value) accepted silently today, in modules owned by other sessions: strict xfails
# (entry point, argument, kind of bad value) that is accepted by design, with the reason: not refused, but passed on
BY_DESIGN = {("weighted_error", "v_hat", "non-finite"): "a diverged run's NaN or inf estimates give a NaN or inf error, which "
                                                      "the engine records as the run's metric (chapter 6 marks the run diverged)"}
KNOWN_SILENT = {}

INT_DTYPES = [torch.int64, torch.int32, torch.bool]
COMPLEX_DTYPES = [torch.complex64, torch.complex128]


def resized(good:torch.Tensor, dim:int, size:int)->torch.Tensor:
    "`good` with dimension `dim` of size `size` (its entries repeated or cut)."
    idx = torch.arange(size) % good.shape[dim]
    return good.index_select(dim % good.ndim, idx).clone()


@st.composite
def bad_values(draw, good, kind):
    "(kind of bad value, the value) for an argument whose valid value is `good`."
    if kind[0] == "tensor":
        dims = [d for d in kind[1] if -good.ndim <= d < 0]
        options = ["non-finite", "complex", "integer"] + (["shape"] if dims else [])
        what = draw(st.sampled_from(options))
        if what == "shape":
            dim = draw(st.sampled_from(dims))
            size = draw(st.integers(1, 7).filter(lambda k: k != good.shape[dim]))
            return what, resized(good, dim, size)
        if what == "non-finite":
            x = good.contiguous().clone()
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
            return what, (x.numpy() if draw(st.booleans()) else x)
        x = good.to(draw(st.sampled_from(COMPLEX_DTYPES if what == "complex" else INT_DTYPES)))
        return what, (x.numpy() if draw(st.booleans()) else x)
    if kind[0] == "one_of": return draw(st.sampled_from(sorted(kind[1].items())))
    return kind[0], draw(st.sampled_from(bad_numbers(kind[0])))


def bad_numbers(kind:str)->list:
    "Bad values for a number ('number'), a discount ('gamma'), a count >= 1 ('count') or an index >= 0 ('index')."
    bad = [math.nan, math.inf, -math.inf, complex(0.5, 1.), True, torch.tensor([0.5, 0.5])]
    if kind == "gamma": bad += [1., -0.1, 1.5]
    if kind in ("count", "index"): bad += [-1, 2.5]
    if kind == "count": bad += [0]
    return bad


def call(name:str, arg:str, value):
    "The entry point's answer with `arg` set to `value`, or the exception it raised."
    f, good, _ = COVERED[name]
    try: return f(**dict(good, **{arg: value}))
    except Exception as e: return e


def answer(out):
    "The numbers an answer carries (an MRP's values and weights, a prompt's matrix)."
    if isinstance(out, MRP): return torch.cat([out.v_pi, out.d_pi])
    if isinstance(out, tuple): return torch.cat([torch.as_tensor(t).flatten() for t in out])
    return torch.as_tensor(getattr(out, "Z", out))


def same_answer(a, b)->bool:
    a, b = answer(a), answer(b)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_the_property_test_covers_these_functions():
    "The central public functions the property test feeds random bad values."
    assert sorted(COVERED) == sorted(["theta_star", "weighted_softmax_td", "batch_linear_td", "build_prompt", "build_linear_prompt",
                                      "SoftmaxICTD.predict", "LinearICTD.predict", "MRP", "msve", "kernel_td", "weighted_error",
                                      "two_head_linear_td", "context_weights", "SoftmaxICTD.forward", "LinearICTD.forward", "population_msve",
                                      "evaluate"])
    for name, (f, good, _) in COVERED.items(): assert not isinstance(call(name, next(iter(good)), next(iter(good.values()))), Exception), name


def check_refused(name:str, arg:str, what:str, value):
    "The property for one bad value: refused naming an argument, or (integer or boolean tensors) the answer of its float64 cast."
    out = call(name, arg, value)
    if what == "integer" and not isinstance(out, Exception):
        cast = call(name, arg, torch.as_tensor(value).double())
        assert not isinstance(cast, Exception) and same_answer(out, cast), \
            f"{name}({arg}=<{torch.as_tensor(value).dtype} tensor>) was accepted with an answer that is not that of its float64 cast"
        return
    assert isinstance(out, (ValueError, TypeError)), f"{name}({arg}=<{what}: {value!r}>) " + \
        (f"raised {type(out).__name__}: {out}" if isinstance(out, Exception) else "was accepted")
    params = COVERED[name][1]
    assert any(f"`{p}`" in str(out) for p in params), f"{name}({arg}=<{what}>): {type(out).__name__} naming no argument: {out}"


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=st.sampled_from(CASES), data=st.data())
def test_random_bad_values_are_refused_naming_an_argument(case, data):
    "A random entry point and argument, and a random bad value for it: a ValueError or TypeError naming an argument."
    name, arg = case
    _, good, kinds = COVERED[name]
    what, value = data.draw(bad_values(good[arg], kinds[arg]), label=arg)
    if (name, arg, what) in KNOWN_SILENT: return   # its own strict xfail below
    if (name, arg, what) in BY_DESIGN:
        out = call(name, arg, value)
        assert not torch.isfinite(torch.as_tensor(out)).all(), f"{name}({arg}=<{what}>) should pass the NaN or inf on: {out}"
        return
    check_refused(name, arg, what, value)


def representative_bad_values(good, kind)->list:
    "A fixed few (kind of bad value, value) of every kind `bad_values` draws from, for the strict xfails."
    if kind[0] == "one_of": return sorted(kind[1].items())
    if kind[0] != "tensor": return [(kind[0], b) for b in bad_numbers(kind[0])]
    out = [("shape", resized(good, d, good.shape[d] + 1)) for d in kind[1] if -good.ndim <= d < 0]
    out += [("non-finite", _flat_set(good, i, v)) for i, v in ((0, math.nan), (-1, math.inf))]
    out += [("complex", good.to(torch.complex128)), ("complex", good.to(torch.complex64).numpy())]
    return out + [("integer", good.to(torch.int64)), ("integer", good.to(torch.bool)), ("integer", good.to(torch.int64).numpy())]


def _flat_set(good, i, value):
    x = good.contiguous().clone(); x.view(-1)[i] = value; return x


@pytest.mark.parametrize("name,arg,what", [pytest.param(*k, marks=pytest.mark.xfail(strict=True, reason=v)) for k, v in KNOWN_SILENT.items()])
def test_known_silent_answers(name, arg, what):
    "Each known silent answer, on the representative values of its kind (fails, as a strict xfail, until each is refused)."
    _, good, kinds = COVERED[name]
    values = [v for w, v in representative_bad_values(good[arg], kinds[arg]) if w == what]
    assert values, (name, arg, what)
    for v in values: check_refused(name, arg, what, v)


def test_representative_values_are_what_the_property_test_draws():
    "Every (entry point, argument, kind) has representative values, and those of a case not in `KNOWN_SILENT` are refused."
    for name, (_, good, kinds) in COVERED.items():
        for arg, kind in kinds.items():
            for what, v in representative_bad_values(good[arg], kind):
                if (name, arg, what) not in KNOWN_SILENT and (name, arg, what) not in BY_DESIGN: check_refused(name, arg, what, v)
