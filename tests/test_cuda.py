"""The engine on a GPU: every family and protocol trains on CUDA to the same numbers as on the CPU (float64), because every
random draw is made on the CPU and moved. Skipped where no CUDA device is present (CI); run on a GPU machine with
`pytest tests/test_cuda.py`."""
import dataclasses
import pytest
import torch
from ictd.engine import EMERGENCE
from ictd.pretrain import pretrain_many

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]

def assert_same_runs(config, seeds=(0, 1), tol=1e-8):
    "`config` trained on CUDA and on the CPU, both in float64 (asked for: CUDA's default is float32): same final parameters and same recorded metrics, to `tol` relative."
    config = dataclasses.replace(config, dtype="float64")
    gpu, cpu = pretrain_many(config, list(seeds), progress=False, device="cuda"), pretrain_many(config, list(seeds), progress=False, device="cpu")
    for g, c in zip(gpu, cpu):
        for k, v in c.params.items():
            w = g.params[k].detach().cpu()
            assert (w - v).abs().max() <= tol * (1 + v.abs().max()), (config.attention, config.protocol, k)
        for k, v in c.history.items():
            if k == "step" or not isinstance(v, (list, torch.Tensor)): continue
            a, b = torch.as_tensor(g.history[k], dtype=torch.float64).cpu(), torch.as_tensor(v, dtype=torch.float64)
            assert torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True), (config.attention, config.protocol, k)
    return gpu

@pytest.mark.parametrize("objective", ["td", "mc", "supervised", "td-independent"])
def test_stationary_softmax_on_cuda_equals_cpu(objective):
    assert_same_runs(dataclasses.replace(EMERGENCE, n_steps=30, eval_every=10, n_tasks=64, eval_tasks=16, objective=objective))

def test_shared_theta_star_init_on_cuda_equals_cpu():
    assert_same_runs(dataclasses.replace(EMERGENCE, n_steps=30, eval_every=10, n_tasks=64, eval_tasks=16, shared=True, init="theta_star", init_scale=0.01))

def test_sliding_linear_on_cuda_equals_cpu():
    from ictd.linear import ICLR_LINEAR
    assert_same_runs(dataclasses.replace(ICLR_LINEAR, n_steps=30, eval_every=10, n_tasks=10, eval_tasks=16))

def test_float32_on_cuda_trains():
    "float32 on the GPU: the loss falls and the parameters stay within 1e-3 of the float64 CPU run after 30 steps."
    config = dataclasses.replace(EMERGENCE, n_steps=30, eval_every=10, n_tasks=64, eval_tasks=16)
    g = pretrain_many(dataclasses.replace(config, dtype="float32"), [0], progress=False, device="cuda")[0]
    c = pretrain_many(config, [0], progress=False, device="cpu")[0]
    for k, v in c.params.items(): assert (g.params[k].detach().cpu().double() - v).abs().max() < 1e-3, k

def test_causal_decoder_on_cuda_equals_cpu():
    import ictd.causal  # registers the "causal" family
    assert_same_runs(dataclasses.replace(EMERGENCE, n_steps=30, eval_every=10, n_tasks=64, eval_tasks=16, attention="causal"))

def test_continuous_family_on_cuda_equals_cpu():
    from ictd.continuous import RotationFamily, family_config
    assert_same_runs(family_config(RotationFamily(), n_steps=30, eval_every=10, eval_tasks=16, dtype="float64"))

def test_cuda_defaults_to_float32_and_keeps_float64_on_request():
    "No dtype asked: float32 on CUDA, for the engine and the constructors; float64 when asked; the CPU keeps float64."
    from ictd.linear import LinearICTD
    from ictd.model import SoftmaxICTD
    config = dataclasses.replace(EMERGENCE, n_steps=4, eval_every=2, n_tasks=16, eval_tasks=8)
    run = pretrain_many(config, [0], progress=False, device="cuda")[0]
    assert run.config.dtype == "float32" and {p.dtype for p in run.params.values()} == {torch.float32}
    asked = pretrain_many(dataclasses.replace(config, dtype="float64"), [0], progress=False, device="cuda")[0]
    assert asked.config.dtype == "float64" and {p.dtype for p in asked.params.values()} == {torch.float64}
    for cls in (SoftmaxICTD, LinearICTD):
        assert {p.dtype for p in cls(4, n_layers=2, seed=0, device="cuda").parameters()} == {torch.float32}
        assert {p.dtype for p in cls(4, n_layers=2, seed=0, device="cuda", dtype=torch.float64).parameters()} == {torch.float64}
        assert {p.dtype for p in cls(4, n_layers=2, seed=0).parameters()} == {torch.float64}

def test_captured_step_on_cuda_equals_eager():
    "The step compiled in 'reduce-overhead' mode (CUDA graphs) trains the same float64 runs as the eager step on the GPU."
    config = dataclasses.replace(EMERGENCE, n_steps=20, eval_every=10, n_tasks=64, eval_tasks=16, dtype="float64")
    eager = pretrain_many(config, [0, 1], progress=False, device="cuda")
    captured = pretrain_many(config, [0, 1], progress=False, device="cuda", compile=True)
    for e, c in zip(eager, captured):
        for k, v in e.params.items(): assert (v - c.params[k]).abs().max() <= 1e-8 * (1 + v.abs().max()), k
