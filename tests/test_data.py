"""The examples' data loaders: real loading code, deterministic, on small slices."""

import numpy as np
import pytest

from tests.support.launch import script_module

common = script_module("examples/common.py")


def test_stdlib_corpus_is_deterministic_text():
    files = common.stdlib_files(12)
    assert len(files) == 12 and len(set(files)) == 12
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    tr1, va1 = common.stdlib_corpus(12)
    tr2, va2 = common.stdlib_corpus(12)
    assert np.array_equal(tr1, tr2) and np.array_equal(va1, va2)
    assert tr1.dtype == np.uint8 and tr1.size > 9 * va1.size * 0.9  # 90 / 10 split
    text = bytes(tr1[:5000]).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_lm_batches_are_shifted_windows():
    tr, va = common.stdlib_corpus(5)
    x, y = common.lm_batch(tr, 4, 16, np.random.default_rng(0))
    assert x.shape == y.shape == (4, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    ev1 = common.lm_eval_batches(va, 2, 16, 3)
    ev2 = common.lm_eval_batches(va, 2, 16, 3)
    assert len(ev1) == 3 and all(np.array_equal(a[0], b[0]) for a, b in zip(ev1, ev2))


def test_digits_split():
    pytest.importorskip("sklearn")
    (xtr, ytr), (xva, yva) = common.digits_split(0)
    assert xtr.shape == (1500, 64) and xva.shape == (297, 64)
    assert 0.0 <= xtr.min() and xtr.max() <= 1.0 and set(np.unique(ytr)) == set(range(10))
    (xtr2, _), _ = common.digits_split(0)
    np.testing.assert_array_equal(xtr, xtr2)
