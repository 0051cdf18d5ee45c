"""Property-based tests (hypothesis) of the wire layout and the masks over random layouts:
edge sizes (empty and 1-element tensors, k = n, sizes not divisible by the chunk count),
every data dtype and payload dtype."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slamb_comm.wire.codecs import TopKWire, k_elems, topk_indices_reference
from slamb_comm.wire.layout import Layout
from slamb_comm.wire.masks import CyclicMask

shapes_st = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=5)
DATA = ["float16", "float32", "float64"]


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, ratio=st.floats(0.01, 1.0), data_dtype=st.sampled_from(DATA),
       value_dtype=st.sampled_from(DATA), seed=st.integers(0, 2**31))
def test_wire_roundtrip_keeps_exactly_each_tensors_topk(shapes, ratio, data_dtype, value_dtype, seed):
    lay = Layout(shapes, data_dtype, dense_threshold=0)
    wire = TopKWire(lay, ratio, value_dtype)
    x = np.random.default_rng(seed).standard_normal(lay.total).astype(data_dtype)
    buf = wire.empty(np)
    assert buf.nbytes == wire.nbytes
    wire.encode(x, buf)
    out = np.zeros(lay.total, data_dtype)
    wire.decode_add(buf, out)
    expected = np.zeros(lay.total, data_dtype)
    for (o, n) in lay.segments():
        k = k_elems(ratio, n)
        assert k == (0 if n == 0 else max(1, min(n, round(ratio * n))))
        keep = topk_indices_reference(x[o:o + n], k) + o
        expected[keep] = x[keep].astype(value_dtype).astype(data_dtype)
    np.testing.assert_array_equal(out, expected)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, ratio=st.floats(0.05, 1.0), threshold=st.integers(0, 600), seed=st.integers(0, 2**31),
       block=st.sampled_from([1, 1, 2, 7, 64]))
def test_cyclic_mask_covers_each_compressible_element_once_per_cycle(shapes, ratio, threshold, seed, block):
    lay = Layout(shapes, "float32", dense_threshold=threshold)
    mask = CyclicMask(lay, ratio, seed, block)
    C = math.ceil(1 / ratio - 1e-9)
    assert mask.num_chunks == C
    seen = np.zeros(lay.total, int)
    sizes = []
    x = np.random.default_rng(seed).standard_normal(lay.total).astype(np.float32)
    for t in range(1, C + 1):
        sel = mask.select(t)
        idx = sel.index
        assert np.unique(idx).size == idx.size  # no duplicates
        assert set(lay.dense_index.tolist()) <= set(idx.tolist())  # always-dense elements every step
        seen[idx] += 1
        comp = np.isin(idx, lay.compressible_index)
        sizes.append(np.unique(idx[comp] // block).size)  # runs in the chunk
        # the gather and scatter equal plain indexing, whatever the run structure
        np.testing.assert_array_equal(sel.take(x), x[idx])
        np.testing.assert_array_equal(sel.take(x, out=np.empty(sel.size, np.float16)), x[idx].astype(np.float16))
        y, z, vals = x.copy(), x.copy(), -np.arange(sel.size, dtype=np.float32)
        sel.put(y, vals)
        z[idx] = vals
        np.testing.assert_array_equal(y, z)
    assert (seen[lay.dense_index] == C).all()
    assert (seen[lay.compressible_index] == 1).all()  # exactly once per cycle
    assert max(sizes) - min(sizes) <= 1  # near-equal chunks (of runs), also when C does not divide the count
    np.testing.assert_array_equal(mask.select(C + 1).index, mask.select(1).index)  # and the cycle repeats
