"""Claims that survive another CPU (issue 29): saved results say what machine made them, and the rounding nudge
`ICTD_PERTURB` reaches every training run's initial parameters without changing anything when unset."""
import dataclasses, json, os
from pathlib import Path
import pytest
import torch
from conftest import ROOT
from ictd.core import NUDGE_VAR, provenance
from ictd.engine import PretrainConfig
from ictd.pretrain import pretrain_many

MACHINE_FIELDS = ("command", "commit", "date", "torch", "cpu", "torch_cpu_capability")

@pytest.mark.unit
@pytest.mark.parametrize("path", sorted((ROOT / "nbs" / "data").glob("*.json")), ids=lambda p: p.name)
def test_every_saved_result_names_its_machine(path):
    "Every file under nbs/data/ records the command, commit, date, torch build, CPU model and kernel set that made it."
    d = json.loads(path.read_text())
    prov = d.get("provenance", d)
    missing = [k for k in MACHINE_FIELDS if not prov.get(k)]
    assert not missing, f"{path.name} records no {missing}"

@pytest.mark.unit
def test_provenance_names_this_machine():
    prov = provenance("x")
    assert prov["cpu"] and prov["torch"] == torch.__version__ and prov["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()

TINY = PretrainConfig(n_tasks=32, eval_tasks=4, n_steps=4, eval_every=2)

def _initial(monkeypatch, value):
    "The parameters a run starts from (0 steps), with ICTD_PERTURB set to `value` (None: unset)."
    if value is None: monkeypatch.delenv(NUDGE_VAR, raising=False)
    else: monkeypatch.setenv(NUDGE_VAR, value)
    return [r.params for r in pretrain_many(dataclasses.replace(TINY, n_steps=0), [0, 3], progress=False)]

@pytest.mark.unit
def test_the_nudge_is_relative_small_fixed_and_off_by_default(monkeypatch):
    "Unset, a run starts where it always did; with ICTD_PERTURB=1e-9 every parameter moves by a relative 1e-9 (zeros stay zero), the same way each time."
    plain, empty = _initial(monkeypatch, None), _initial(monkeypatch, "")
    nudged, again = _initial(monkeypatch, "1e-9"), _initial(monkeypatch, "1e-9")
    for p, e, n, a in zip(plain, empty, nudged, again):
        for k in p:
            assert torch.equal(p[k], e[k]) and torch.equal(n[k], a[k])
            nz = p[k] != 0
            assert torch.equal(n[k][~nz], p[k][~nz])
            rel = ((n[k] - p[k])[nz] / p[k][nz]).abs()
            assert 1e-12 < rel.max() < 1e-8, (k, rel.max())

@pytest.mark.unit
def test_a_nudged_run_is_cached_apart(monkeypatch):
    "A nudged run never reads or overwrites the unnudged cache: its configuration key differs only while the nudge is set."
    monkeypatch.delenv(NUDGE_VAR, raising=False)
    plain = TINY.key()
    monkeypatch.setenv(NUDGE_VAR, "1e-9")
    assert TINY.key() != plain
    monkeypatch.setenv(NUDGE_VAR, "not a number")
    with pytest.raises(ValueError, match=NUDGE_VAR): TINY.key()
