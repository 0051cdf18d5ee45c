"""SAdamW alone (P = 1) is torch.optim.AdamW (docs/algorithm.md section 11): float64 parameters
and a float64 payload, at ratio 1 and 0.1, tensor by tensor and on flat buffers, with two
parameter groups of their own lr and weight decay and an lr schedule; agreement to float64
rounding. The distributed reference at 1, 2 and 4 ranks is in mpi_tests/test_torch_dist.py."""

import pytest
import torch

from slamb_comm.adapters.torch import SAdamW
from slamb_comm.errors import ConfigError


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 120), torch.nn.Tanh(), torch.nn.Linear(120, 8)).double()


def groups(m, **extra):
    ps = list(m.parameters())
    return [{"params": ps[:2], "lr": 2e-2, "weight_decay": 0.1, **extra}, {"params": ps[2:], "lr": 5e-3, **extra}]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ratio", [1.0, 0.1])
def test_sadamw_alone_is_torch_adamw(ratio, fused):
    a, b = model(), model()
    oa = torch.optim.AdamW(groups(a), lr=1e-3, weight_decay=0.01)
    ob = SAdamW(groups(b), ratio=ratio, dense_threshold=100, fused=fused, value_dtype="float64")
    sa = torch.optim.lr_scheduler.StepLR(oa, 5, 0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, 5, 0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(15):
        x, y = torch.randn(16, 40, generator=g, dtype=torch.float64), torch.randn(16, 8, generator=g,
                                                                                 dtype=torch.float64)
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            s.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), (p - q).abs().max()


def test_sadamw_has_no_trust_ratio_to_set():
    with pytest.raises(ConfigError, match="SAdamW has no trust ratio"):
        SAdamW(model().parameters(), c_max=10.0)
