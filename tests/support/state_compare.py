"""Checks of a resized state against docs/algorithm.md section 10, shared by the tests and the
Lightning and Trainer jobs: floating-point tensors that differ between the old ranks are their
float64 mean, cast back; everything else is as saved."""

import torch


def leaves(x, path=()):
    """``(path, leaf)`` for every leaf of nested dicts, lists and tuples."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, path + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from leaves(v, path + (i,))
    else:
        yield path, x


def averaged_from_two(got, a, b):
    """Assert that ``got`` is section 10's state of the two old ranks' states ``a`` and ``b``;
    returns how many tensors differed between them (and were averaged)."""
    got, a, b = dict(leaves(got)), dict(leaves(a)), dict(leaves(b))
    assert got.keys() == a.keys(), sorted(set(got) ^ set(a))
    averaged = 0
    for k, v in got.items():
        if torch.is_tensor(v) and v.is_floating_point() and not torch.equal(a[k], b[k]):
            assert torch.equal(v, ((a[k].double() + b[k].double()) / 2).to(v.dtype)), k
            averaged += 1
        else:
            assert torch.equal(v, a[k]) if torch.is_tensor(v) else v == a[k], k
    return averaged
