"""Issue 32: the `Prompt` type keeps a prompt's n through moves, casts and stacking, and every prompt model's
`predict` gives the same values from a `Prompt` as from (Z, n); devices and dtypes on the data types and models;
the documented history schema of a pretraining run."""
import warnings
import pytest
import torch
from ictd import Prompt, SoftmaxICTD, build_prompt, random_boyan_chain, sample_trajectory
from ictd.boyan import MRP
from ictd.causal import CausalSoftmaxICTD, build_causal_prompt
from ictd.model import ShiftAfterAttentionICTD
from ictd.tasks import TaskBatch, random_tasks

pytestmark = pytest.mark.unit


def _context(seed=11, n=17, q=4):
    mrp = random_boyan_chain(seed=seed)
    states, rewards = sample_trajectory(mrp, n=n, seed=seed)
    return mrp.phi[states], rewards, mrp.phi[:q]


def test_prompt_survives_to_double_and_stack():
    "A Prompt keeps its n through `.to`, `.float`, `.double`, `.clone`, `torch.stack`, `torch.cat` and batch indexing."
    phi, r, phi_q = _context()
    p = Prompt.build(phi, r, phi_q)
    assert (p.n, p.q) == (17, 4)
    for moved, want in ((p.to("cpu"), p.Z), (p.to(torch.float32), p.Z.float()), (p.float().double(), p.Z.float().double()),
                        (p.clone(), p.Z), (p.detach(), p.Z)):
        assert isinstance(moved, Prompt) and moved.n == 17 and torch.equal(moved.Z, want)
    assert p.float().dtype == torch.float32 and p.float().double().dtype == torch.float64
    stacked = torch.stack([p, p.clone()])
    assert isinstance(stacked, Prompt) and stacked.n == 17 and stacked.shape == (2, *p.shape)
    assert torch.equal(stacked[1].Z, p.Z) and stacked[1].n == 17
    assert torch.cat([stacked, stacked]).shape == (4, *p.shape)
    assert Prompt.stack([p, p], dim=-1).shape == (2, *p.shape)   # the only batch axis
    with pytest.raises(ValueError, match="`prompts` must share one n"): torch.stack([p, Prompt(p.Z, 16)])
    with pytest.raises(ValueError, match="`dim` must be a batch axis"): Prompt.stack([p, p], dim=2)
    with pytest.raises(IndexError, match="batch axes only"): stacked[..., 0]
    with pytest.raises(ValueError, match="`n` must be an integer in 1..21"): Prompt(p.Z, 22)
    with pytest.raises(TypeError, match="`Z` must be a real floating tensor"): Prompt(p.Z.long(), 3)


def _models():
    g = torch.Generator().manual_seed(5)
    W = torch.randn(4, 4, generator=g, dtype=torch.float64)
    yield "softmax", SoftmaxICTD(4, n_layers=3, seed=1), build_prompt
    yield "theta*", SoftmaxICTD.from_theta_star(4, W, n_layers=5, alpha=0.7, gamma=0.9), build_prompt
    yield "shift-after", ShiftAfterAttentionICTD(4, n_layers=2, seed=2), build_prompt
    yield "causal", CausalSoftmaxICTD(4, n_layers=3, seed=3), build_causal_prompt


@pytest.mark.parametrize("name,model,build", list(_models()), ids=[m[0] for m in _models()])
def test_predict_from_prompt_equals_predict_from_tensor_and_n(name, model, build):
    "Every prompt model's `predict` and `forward` give bit-identical float64 values from a Prompt and from (Z, n), batched too."
    phi, r, phi_q = _context()
    Z = build(phi, r, phi_q).clone()                                # a plain tensor: no n attached
    p = Prompt(Z, 17)
    assert torch.equal(model.predict(p), model.predict(Z, n=17))
    out = model(p)
    assert isinstance(out, Prompt) and out.n == 17 and torch.equal(out.Z, model(Z, n=17))
    batch = torch.stack([p, Prompt(build(*_context(seed=12)).clone(), 17)])
    assert torch.allclose(model.predict(batch)[0], model.predict(p), rtol=0, atol=1e-12)   # a batch rounds its own way
    with pytest.raises(ValueError, match="contradicts the prompt"): model.predict(p, n=16)
    assert model.predict(p, grad=False).grad_fn is None and model.predict(p, grad=True).grad_fn is not None


def test_mrp_and_taskbatch_devices_dtypes():
    "MRP(dtype=), MRP.to, TaskBatch.to and TaskBatch[...] give the same process in another dtype; a swapped gamma is named."
    mrp = random_boyan_chain(seed=3)
    m32 = MRP(mrp.P, mrp.r, mrp.gamma, mrp.phi, dtype=torch.float32, device="cpu")
    assert all(getattr(m32, k).dtype == torch.float32 for k in ("P", "r", "phi", "d_pi", "v_pi"))
    assert torch.allclose(m32.v_pi.double(), mrp.v_pi, rtol=1e-6, atol=1e-6)
    assert mrp.to(dtype=torch.float32).P.dtype == torch.float32 and mrp.P.dtype == torch.float64   # a copy
    with pytest.raises(ValueError, match=r"`gamma` must be a number in \[0, 1\), got an array of shape \(10, 4\)"):
        MRP(mrp.P, mrp.r, mrp.phi, 0.9)
    flipped = MRP(mrp.P.numpy()[::-1, ::-1], mrp.r.numpy()[::-1], 0.9, mrp.phi.numpy()[::-1])   # negatively strided views
    assert torch.allclose(flipped.v_pi, mrp.v_pi.flip(0), atol=1e-12)
    tasks = random_tasks(6, seed=4)
    t32 = tasks.to(dtype=torch.float32)
    assert isinstance(t32, TaskBatch) and t32.P.dtype == torch.float32 and tasks.P.dtype == torch.float64
    one, some = tasks[2], tasks[1:4]
    assert isinstance(one, MRP) and torch.allclose(one.v_pi, tasks.v_pi[2], atol=1e-12) and torch.equal(one.P, tasks.P[2])
    assert isinstance(some, TaskBatch) and len(some) == 3 and torch.equal(some.phi, tasks.phi[1:4])
    with pytest.raises(IndexError): tasks[6]


def test_model_and_prompt_dtypes_and_devices():
    "SoftmaxICTD(device=, dtype=) and build_prompt(device=, dtype=) place their tensors; the output follows the input."
    model = SoftmaxICTD(4, n_layers=2, seed=0, dtype=torch.float32, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32} and {p.device.type for p in model.parameters()} == {"cpu"}
    phi, r, phi_q = _context()
    Z32 = build_prompt(phi, r, phi_q, dtype=torch.float32, device="cpu")
    assert Z32.dtype == torch.float32 and model.predict(Z32).dtype == torch.float32
    assert SoftmaxICTD(4, n_layers=2, seed=0).predict(Z32).dtype == torch.float32     # float64 parameters follow the prompt
    from ictd import weighted_softmax_td
    W = torch.eye(4)
    v32 = weighted_softmax_td(phi.float(), r.float(), W, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=phi_q.float())
    v64 = weighted_softmax_td(phi, r, W.double(), alpha=0.5, gamma=0.9, n_iters=3, phi_queries=phi_q)
    assert v32.dtype == torch.float32 and v64.dtype == torch.float64 and torch.allclose(v32.double(), v64, atol=1e-5)
    meta = SoftmaxICTD(4, n_layers=2, seed=0, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    from ictd.core import check_device
    assert check_device(None) == torch.device("cpu")                          # CUDA only when asked


def test_history_schema_documents_every_recorded_entry():
    "Every entry that tiny softmax, causal and linear runs record is in HISTORY_SCHEMA with its documented shape."
    from ictd.engine import HISTORY_SCHEMA, PretrainConfig, history_schema, load_plugins
    from ictd.pretrain import pretrain_many
    load_plugins()
    for attention in ("softmax", "causal", "linear"):
        c = PretrainConfig(n_states=5, d=3, n=6, n_layers=2, n_tasks=16, batch_size=8, n_steps=4, eval_every=2, eval_tasks=8,
                           attention=attention, record_params=attention == "causal")
        result = pretrain_many(c, [0], progress=False)[0]
        E, L = c.n_steps // c.eval_every + 1, c.n_layers
        for name, value in result.history.items():
            shape, what = history_schema(name)
            assert what and value.shape[0] == E, (attention, name, tuple(value.shape))
            if "..." in shape: continue
            assert len(value.shape) == len(shape), (attention, name, tuple(value.shape), shape)
            for got, want in zip(value.shape, shape):
                assert want == "k" or got == {"E": E, "L": L}.get(want, want), (attention, name, tuple(value.shape), shape)
            assert name in (result.__class__.__doc__ or "") or name.startswith("param.")
        if attention != "linear":
            mrp = result.held_out[0]
            states, rewards = sample_trajectory(mrp, n=c.n, seed=1)
            build = build_causal_prompt if attention == "causal" else build_prompt
            p = Prompt(build(mrp.phi[states], rewards, mrp.phi).clone(), c.n)
            v = result.predict(p)
            assert v.grad_fn is None and v.shape == (5,) and result.predict(p, grad=True).grad_fn is not None
            with torch.no_grad(): assert torch.equal(v, result.model.predict(p))
    assert set(HISTORY_SCHEMA) >= {"step", "loss", "msve", "neu"}
    with pytest.raises(ValueError, match="`name` must be one of"): history_schema("accuracy")


def test_linear_model_takes_a_prompt_and_control_prompts_move():
    "LinearICTD's `predict`/`forward` give the same values from a Prompt (n = its context columns) as from (Z, n); a"
    " ControlPrompt keeps its layout through `.to`, `.float`, `.double` and `ControlPrompt.stack`."
    from ictd.linear import LinearICTD, build_linear_prompt
    from ictd.control_model import ControlICTD, ControlPrompt
    phi, r, phi_q = _context()
    Z = build_linear_prompt(phi, r, phi_q, gamma=0.9).clone()               # a plain tensor: no n attached
    model = LinearICTD(4, n_layers=3, seed=2)
    p = Prompt(Z, 17)
    assert torch.equal(model.predict(p), model.predict(Z, n=17)) and model.predict(p).shape == (4,)
    out = model(p)
    assert isinstance(out, Prompt) and out.n == 17 and torch.equal(out.Z, model(Z, n=17))
    with pytest.raises(ValueError, match="contradicts the prompt"): model.predict(p, n=16)
    assert model.predict(p, grad=False).grad_fn is None and model.predict(p, grad=True).grad_fn is not None
    g = torch.Generator().manual_seed(4)
    x = ControlPrompt(torch.randn(8, 5 + 6 * 2, generator=g, dtype=torch.float64), n=5, n_actions=2, q=1)
    for moved, dtype in ((x.to(torch.float32), torch.float32), (x.float().double(), torch.float64), (x.to("cpu"), torch.float64)):
        assert isinstance(moved, ControlPrompt) and (moved.n, moved.n_actions, moved.q) == (5, 2, 1) and moved.Z.dtype == dtype
    both = ControlPrompt.stack([x, x.to("cpu")])
    assert both.Z.shape == (2, 8, 17) and (both.n, both.n_actions, both.q) == (5, 2, 1)
    cm = ControlICTD(4, n_layers=1, seed=0)
    assert torch.equal(cm.predict(both)[1], cm.predict(x))
    with pytest.raises(ValueError, match="share one layout"): ControlPrompt.stack([x, ControlPrompt(x.Z[..., :15], n=5, n_actions=2, q=0)])
