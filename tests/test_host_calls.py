"""The host's work in ``SLAMB(fused=True)``'s step (issue 43), counted, never timed.

On a GPU the step's kernels do not depend on the number of tensors; the Python around them must
not either. On the strict CuPy double (the adapter takes its CUDA path on CPU tensors) cProfile
counts the step's calls (``ncalls``: Python functions, and builtins and C methods called from
Python; what C code calls itself, as ``map`` does, is not a call) at 50 and 500 tensors, and the
slope -- calls per added tensor -- is compared:

* with ``torch.optim.AdamW(fused=True)``'s on the same tensors (11 per tensor in torch 2.13): SLAMB's
  may not be larger, with gradients written in place and with new gradient tensors every step;
* where nothing about the parameters changed, neither the adapter's own code (``adapters/``) nor the
  core's (``slamb_comm/``) makes a call per tensor at all: the core checks ``lr`` and ``weight_decay``
  in one call each and keeps the cyclic mask's per-tensor counts per chunk.

The checks that make this possible (what was seen is recorded and compared at C level) must
still see what changed: a parameter of another shape or dtype (``.data`` replaced, ``set_``) or a
gradient resized in place raises before any bucket steps; new gradient tensors at new addresses
are read there; no gradient tensor is kept past the step; the state shows the step count and live
views.
"""

import cProfile
import gc
import os
import pstats
import weakref

import pytest
import torch

import slamb_comm
import slamb_comm.adapters
from tests.support import strict_cupy
from slamb_comm.adapters.torch import SLAMB
from slamb_comm.errors import LayoutError

CORE = os.path.dirname(os.path.realpath(slamb_comm.__file__)) + os.sep
ADAPTERS = os.path.dirname(os.path.realpath(slamb_comm.adapters.__file__)) + os.sep
SIZES = (50, 500)


@pytest.fixture
def on_the_double():
    with strict_cupy.install(), strict_cupy.torch_bridge():
        strict_cupy.Device.current = 0
        yield


def make_params(n, elements=16):
    g = torch.Generator().manual_seed(n)
    ps = [torch.nn.Parameter(torch.randn(elements, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(elements, generator=g) * 1e-3
    return ps


def make_slamb(ps):
    return SLAMB(ps, lr=1e-2, ratio=0.1, beta3=0.9, dense_threshold=0, fused=True)


def make_adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3, fused=True)


def next_gradients(ps, new):
    for p in ps:
        if new:  # a new tensor, as after zero_grad() (set_to_none=True) and backward()
            p.grad = p.grad * 0.999
        else:  # in place, as backward() accumulates into .grad
            p.grad.mul_(0.999)


def where(path):
    """``adapters``, ``core`` or None (elsewhere) for a code object's file; ``~`` for a builtin."""
    if path == "~":
        return "~"
    real = os.path.realpath(path)
    return "adapters" if real.startswith(ADAPTERS) else "core" if real.startswith(CORE) else None


def calls_per_step(make, n, new, steps=10):
    """(all calls, calls into or made by the adapter's code, by the core's) per step, the mean of
    ``steps`` steps (one cycle of the mask at ratio 0.1) after 12 warm-up steps. A builtin counts
    where its caller is."""
    ps = make_params(n)
    opt = make(ps)
    prof = cProfile.Profile()
    for t in range(12 + steps):
        next_gradients(ps, new)
        if t >= 12:
            prof.enable()
        opt.step()
        prof.disable()
    got = {"all": 0, "adapters": 0, "core": 0}
    for key, (_, nc, _, _, callers) in pstats.Stats(prof).stats.items():
        got["all"] += nc
        mine = where(key[0])
        if mine in ("adapters", "core"):
            got[mine] += nc
        elif mine == "~":
            for caller, edge in (callers or {}).items():
                by = where(caller[0])
                if by in ("adapters", "core"):
                    got[by] += edge[1]
    return {k: v / steps for k, v in got.items()}


def slope(make, new):
    """Calls per added tensor (:func:`calls_per_step`) from 50 to 500 tensors."""
    a, b = (calls_per_step(make, n, new) for n in SIZES)
    return {k: (b[k] - a[k]) / (SIZES[1] - SIZES[0]) for k in a}


@pytest.mark.parametrize("new", [False, True], ids=["gradients_in_place", "new_gradients"])
def test_slamb_makes_no_more_calls_per_tensor_than_fused_adamw(on_the_double, new):
    slamb, adamw = slope(make_slamb, new), slope(make_adamw, new)
    assert slamb["all"] <= adamw["all"], (slamb, adamw)
    # below one call per 20 tensors (a count is a mean over 10 steps): none per tensor, C-level passes only
    assert slamb["adapters"] < 0.05, slamb
    assert slamb["core"] < 0.05, slamb


def two_buckets():
    """Parameters in two buckets (float32 and float64), stepped a few times on flat buffers."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5)),
          torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64)),
          torch.nn.Parameter(torch.randn(7, dtype=torch.float64))]
    opt = make_slamb(ps)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("how", ["data_replaced", "set_in_place", "dtype", "gradient_resized"])
def test_a_changed_parameter_raises_before_any_bucket_steps(on_the_double, how):
    """``p.data = ...`` and ``p.set_(...)`` are how a parameter changes shape or dtype (torch refuses
    to resize a parameter that requires grad in place, and ``p.data.resize_`` resizes another
    tensor); a gradient can be resized in place."""
    ps, opt = two_buckets()
    p = ps[3]  # the second bucket's: the first must not step either
    if how == "data_replaced":
        p.data = torch.zeros(8, dtype=torch.float64)
    elif how == "set_in_place":
        with torch.no_grad():
            p.set_(torch.zeros(8, dtype=torch.float64))
    elif how == "dtype":
        p.data = p.data.float()  # its bucket computes in float64
    for q in ps:
        q.grad = torch.randn_like(q)
    if how == "gradient_resized":
        p.grad.resize_(3)
    before = [q.detach().clone() for q in ps[:2]]
    with pytest.raises(LayoutError, match="'group0.3' changed (shape|dtype)"):
        opt.step()
    assert all(torch.equal(a, q) for a, q in zip(before, ps[:2]))
    assert int(opt.state[ps[0]]["step"]) == 3


def test_new_gradient_tensors_at_new_addresses_are_read_there(on_the_double):
    """The steps of gradients handed in as new tensors (kept alive by the test, so that no address
    repeats) are the steps of the same values written in place."""
    out = []
    for new in (False, True):
        ps = make_params(20)
        opt = make_slamb(ps)
        keep = []
        for t in range(6):
            for i, p in enumerate(ps):
                values = torch.full_like(p, 0.01 * (i % 5 - 2) + 0.001 * t)
                if new:
                    keep.append(p.grad)
                    p.grad = values
                else:
                    p.grad.copy_(values)
            opt.step()
        out.append([p.detach().clone() for p in ps])
        assert all(int(opt.state[p]["step"]) == 6 for p in ps)
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_no_gradient_is_kept_past_the_step(on_the_double):
    """zero_grad() frees the gradients (no reference of the optimizer's keeps them alive through the
    next forward and backward pass: a whole model's gradients)."""
    ps = make_params(10)
    opt = make_slamb(ps)
    opt.step()
    gone = [weakref.ref(p.grad) for p in ps]
    opt.step()
    opt.zero_grad()
    gc.collect()
    assert all(r() is None for r in gone)


def test_the_state_shows_every_step_and_live_views(on_the_double):
    """Each parameter's state holds the bucket's step count and views of its moments after settled
    steps, also where a parameter's exp_avg was replaced in between (it is pointed back)."""
    ps, opt = two_buckets()
    st = opt.state[ps[1]]
    st["exp_avg"] = st["exp_avg"].clone()
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert [float(s["step"]) for s in sd["state"].values()] == [4.0] * 4
    m = opt.state[ps[0]]["exp_avg"]
    assert opt.state[ps[1]]["exp_avg"].data_ptr() == m.data_ptr() + m.numel() * m.element_size()
