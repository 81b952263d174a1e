"""Chapter 6's Figure 6.2 (review of the regenerated runs): the ratio panel shows every ratio it computes, wherever the
ratio lies, and the -gamma line beside them; a fixed y-range once hid every point of seed 0's run (ratios +1..+5, then -5)."""
import numpy as np
import pytest
import torch


@pytest.mark.unit
def test_ratio_panel_shows_every_computed_ratio_and_minus_gamma():
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from ictd.engine import PretrainConfig, PretrainResult
    from ictd.pretrain import plot_value_weights
    current = torch.tensor([0.003, 0.26, 0.18, 0.08, 0.02, -0.09, -0.125], dtype=torch.float64)
    successor = torch.tensor([-0.01, 0.30, 0.29, 0.32, 0.41, 0.46, 0.525], dtype=torch.float64)
    vw = torch.zeros(len(current), 3, 3, dtype=torch.float64)
    vw[:, -1] = torch.stack([torch.full_like(current, 0.3), successor, current], -1)
    steps = torch.arange(len(current))[:, None] * 200
    r = PretrainResult(PretrainConfig(), None, dict(value_weights=vw, step=steps))
    ax = plot_value_weights(r)[1]
    lo, hi = ax.get_ylim()
    ratio = ax.get_lines()[0].get_ydata()
    shown = ratio[np.isfinite(ratio)]
    assert len(shown) == int((current.abs() > 0.05).sum()) and shown.max() > 1 and shown.min() < -3   # the case a fixed (-3, 1) hid
    assert lo <= shown.min() and shown.max() <= hi and lo <= -r.config.gamma <= hi, (lo, hi, shown)
    plt.close('all')
