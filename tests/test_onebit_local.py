"""Single-process tests of the 1-bit exchange (slamb_comm.exchange.onebit, docs/onebit_lamb.md section 1)
and of LocalTransport.alltoall: the float64 reference of the page, the "nothing is lost"
identity, failures that change nothing, the state_dict round trip, byte counts, and the CuPy
branch through the strict double (tests/support/strict_cupy.py) with its host reads counted."""

import math
import pickle

import numpy as np
import pytest

from tests.support import onebit_reference as ref
import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm.errors import ConfigError, LayoutError, LayoutMismatchError, NonFiniteError
from slamb_comm.exchange.onebit import OneBitExchange, pack_signs, padded_size, unpack_signs

SHAPES = [(30, 40), (7,), (3, 5, 2), (0,), (65,)]  # 1302 elements: padding 2 at P = 1
N = 1302


def make(seed, dtype=np.float64, xp=np, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [xp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]


def flat(arrays):
    return np.concatenate([np.asarray(sc.arrays.to_host(a)).ravel() for a in arrays])


def exchange_for(dtype=np.float64, value_dtype=None, xp=np):
    comm = sc.Communicator(None, make(0, dtype, xp), value_dtype=value_dtype, seed=1)
    return OneBitExchange(comm)


@pytest.fixture
def cp():
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        strict_cupy.reset_syncs()
        yield mod


# --------------------------------------------------------------------------- codec pieces
@pytest.mark.parametrize("n", [8, 16, 1208, 4096])
def test_pack_and_unpack_are_numpys(n, cp):
    bits = np.random.default_rng(n).random(n) < 0.5
    want = np.packbits(bits)
    assert np.array_equal(pack_signs(bits), want)
    assert np.array_equal(unpack_signs(want), np.unpackbits(want))
    dev = pack_signs(cp.asarray(bits))  # the double has no packbits: the arithmetic fallback
    assert isinstance(dev, cp.ndarray) and np.array_equal(dev.get(), want)
    back = unpack_signs(cp.asarray(want))
    assert np.array_equal(back.get(), np.unpackbits(want))


def test_pack_needs_whole_bytes():
    with pytest.raises(ValueError):
        pack_signs(np.ones(12, bool))


@pytest.mark.parametrize("P, n, want", [(1, 1302, 1304), (1, 0, 8), (2, 1302, 1312), (3, 100, 144),
                                        (4, 1302, 1312), (8, 1, 64), (16, 1302, 1536), (4, 32, 32)])
def test_padding_is_deepspeeds(P, n, want):
    assert padded_size(n, P) == want == ref.padded(n, P)
    assert (want // P) % 8 == 0


def test_local_transport_alltoall_copies():
    t = sc.LocalTransport()
    a = np.arange(10, dtype=np.float16)
    b = np.zeros(10, np.float16)
    t.alltoall(a, b)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError):
        t.alltoall(a, np.zeros(9, np.float16))
    with pytest.raises(ValueError):
        t.alltoall(a, np.zeros(10, np.float32))


def test_transport_protocol_has_alltoall():
    assert isinstance(sc.LocalTransport(), sc.Transport)
    assert "alltoall" in sc.exchange.transports.__doc__


def test_status_codes_are_defined_once():
    """Every exchange's status word takes its codes from slamb_comm.errors (no module has its own)."""
    import pathlib
    import re

    root = pathlib.Path(sc.__file__).parent
    own = [f.name for f in root.glob("*.py") if f.name != "errors.py"
           and re.search(r"^_?(OK|BAD_INPUT|NON_FINITE)\b.*=", f.read_text(), re.M)]
    assert own == [], own


def test_one_exchange_per_communicator():
    comm = sc.Communicator(None, make(0), seed=1)
    ex = comm.onebit
    assert comm.onebit is ex and ex.comm is comm
    assert OneBitExchange(comm) is not ex


def test_needs_a_transport_with_alltoall():
    class NoAllToAll(sc.LocalTransport):
        alltoall = None

    comm = sc.Communicator(NoAllToAll(), make(0), seed=1)
    with pytest.raises(ConfigError, match="alltoall"):
        OneBitExchange(comm)


# --------------------------------------------------------------------------- the reference
def test_matches_the_float64_reference_over_steps():
    ex = exchange_for()
    we = se = None
    for step in range(6):
        x = make(10 + step)
        want, we, se = ref.exchange([flat(x)], we, se)
        out = ex.allreduce(x)
        assert out is x
        np.testing.assert_allclose(flat(x), want, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(ex.worker_error, we[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(ex.server_error, se[0], rtol=1e-12, atol=1e-13)
        for o, n in ex.layout.segments():  # at P = 1 one chunk: at most two values
            assert np.unique(np.abs(flat(x))).size <= 1


def test_fused_buffer_input_is_written_in_place():
    ex = exchange_for()
    x = flat(make(3))
    want, _, _ = ref.exchange([x.copy()])
    assert ex.allreduce(x) is x
    np.testing.assert_allclose(x, want, rtol=1e-12)


def test_float32_first_step_and_float16_scales():
    x = make(5, np.float32)
    want, _, _ = ref.exchange([flat(x)], scale_dtype=np.float32)
    ex = exchange_for(np.float32)
    ex.allreduce(x)
    assert x[0].dtype == np.float32 and ex.worker_error.dtype == np.float32
    np.testing.assert_allclose(flat(x), want, rtol=2e-6)
    x = make(5, np.float32)
    want, _, _ = ref.exchange([flat(x)], scale_dtype=np.float16)
    ex = exchange_for(np.float32, "float16")
    ex.allreduce(x)
    np.testing.assert_allclose(flat(x), want, rtol=1e-6)  # the scale is rounded to fp16 on both sides


def test_float16_arrays_keep_float32_errors():
    x = make(5, np.float16)
    ex = exchange_for(np.float16)
    ex.allreduce(x)
    assert x[0].dtype == np.float16 and ex.worker_error.dtype == np.float32 == ex.server_error.dtype
    assert np.all(np.isfinite(flat(x)))


def test_nothing_is_lost():
    """sum of the outputs + server error + worker error == sum of the inputs (P = 1)."""
    ex = exchange_for()
    sum_in, sum_out = np.zeros(padded_size(N, 1)), np.zeros(padded_size(N, 1))
    for step in range(8):
        x = make(40 + step)
        sum_in[:N] += flat(x)
        ex.allreduce(x)
        sum_out[:N] += flat(x)
        # position by position; the padding's outputs are dropped, so the first N positions
        total = sum_out + ex.server_error + ex.worker_error
        np.testing.assert_allclose(total[:N], sum_in[:N], rtol=0, atol=1e-12)


def test_signs_of_equal_magnitudes_come_back_exactly():
    """N = N', one vector of +-s: the first call gives it back and leaves zero errors."""
    comm = sc.Communicator(None, [np.zeros(64)], seed=1)
    ex = OneBitExchange(comm)
    x = np.where(np.random.default_rng(1).random(64) < 0.5, -0.75, 0.75)
    want = x.copy()
    ex.allreduce(x)
    assert np.array_equal(x, want)
    assert not ex.worker_error.any() and not ex.server_error.any()


def test_zero_input_gives_zero():
    ex = exchange_for()
    x = [np.zeros(s) for s in SHAPES]
    ex.allreduce(x)
    assert not flat(x).any() and not ex.worker_error.any()


# --------------------------------------------------------------------------- failures change nothing
def _state(ex):
    return None if ex.worker_error is None else (ex.worker_error.copy(), ex.server_error.copy())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_and_changes_nothing(bad):
    ex = exchange_for()
    ex.allreduce(make(1))
    before = _state(ex)
    x = make(2)
    x[2][1, 2, 1] = bad
    keep = flat(x)
    with pytest.raises(NonFiniteError) as info:
        ex.allreduce(x)
    assert info.value.ranks == (0,)
    np.testing.assert_array_equal(flat(x), keep)
    assert all(np.array_equal(a, b) for a, b in zip(_state(ex), before))
    # the collectives ran, so their bytes count (a skipped step still used the network)
    assert ex.comm.stats.total.calls == 2 and ex.comm.stats.by_kind["onebit_allreduce"].calls == 2
    assert ex.comm.stats.last.payload_bytes == 2 * ex.block and ex.comm.stats.last.decode_s == 0.0
    ex.allreduce(make(2))  # and the exchange goes on


def test_norm_overflow_is_non_finite():
    ex = exchange_for(np.float32, "float16")
    x = make(2, np.float32)
    x[0][...] = 1e5  # scale 1e5 * sqrt(1200/1304) > 65504: Inf in float16
    with pytest.raises(NonFiniteError):
        ex.allreduce(x)
    assert ex.worker_error is None


def test_lazy_sequences_are_refused():
    class Seq:
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    ex = exchange_for()
    with pytest.raises(TypeError, match="in place"):
        ex.allreduce(Seq(make(1)))
    assert ex.worker_error is None


@pytest.mark.parametrize("mutate", ["shape", "count", "dtype", "strided"])
def test_bad_input_raises_and_changes_nothing(mutate):
    ex = exchange_for()
    ex.allreduce(make(1))
    before = _state(ex)
    x = make(2)
    if mutate == "shape":
        x[0] = x[0].reshape(40, 30)
    elif mutate == "count":
        x = x[:-1]
    elif mutate == "dtype":
        x[0] = x[0].astype(np.float32)
    else:
        x[0] = np.asfortranarray(x[0])
    with pytest.raises(LayoutError):
        ex.allreduce(x)
    assert all(np.array_equal(a, b) for a, b in zip(_state(ex), before))


# --------------------------------------------------------------------------- state
def test_state_dict_round_trip_continues_bitwise():
    a = exchange_for()
    for step in range(3):
        a.allreduce(make(step))
    saved = pickle.loads(pickle.dumps(a.state_dict()))
    b = exchange_for()
    b.load_state_dict(saved)
    assert isinstance(b.worker_error, np.ndarray)
    for step in range(3, 6):
        xa, xb = make(step), make(step)
        a.allreduce(xa)
        b.allreduce(xb)
        assert np.array_equal(flat(xa), flat(xb))
        assert np.array_equal(a.worker_error, b.worker_error) and np.array_equal(a.server_error, b.server_error)


def test_communicator_method_and_its_state_dict_carry_the_exchange():
    """``Communicator.onebit_allreduce`` is the exchange of the communicator (one pair of error
    buffers), and the communicator's state_dict saves and restores them bitwise."""
    a = sc.Communicator(None, make(0), seed=1)
    assert "onebit" not in a.state_dict()
    for step in range(3):
        a.onebit_allreduce(make(step))
    assert a.onebit.worker_error is not None
    saved = pickle.loads(pickle.dumps(a.state_dict()))
    b = sc.Communicator(None, make(0), seed=1)
    b.load_state_dict(saved)
    for step in range(3, 5):
        xa, xb = make(step), make(step)
        a.onebit_allreduce(xa)
        b.onebit_allreduce(xb)
        assert np.array_equal(flat(xa), flat(xb))
    b.load_state_dict(sc.Communicator(None, make(0), seed=1).state_dict())  # saved before any: zeros again
    c = exchange_for()
    xb, xc = make(9), make(9)
    b.onebit_allreduce(xb)
    c.allreduce(xc)
    assert np.array_equal(flat(xb), flat(xc))


def test_state_dict_before_any_exchange_and_mismatches():
    a = exchange_for()
    st = a.state_dict()
    assert st["worker_error"] is None and st["server_error"] is None and st["size"] == 1
    b = exchange_for()
    b.load_state_dict(st)
    assert b.worker_error is None
    with pytest.raises(LayoutMismatchError):
        exchange_for(np.float32).load_state_dict(st)
    with pytest.raises(LayoutMismatchError):
        b.load_state_dict(dict(st, rank=1))
    a.allreduce(make(0))
    st = a.state_dict()
    with pytest.raises(LayoutError):
        b.load_state_dict(dict(st, server_error=np.zeros(3)))
    with pytest.raises(LayoutError):
        b.load_state_dict(dict(st, server_error=None))


# --------------------------------------------------------------------------- statistics
def test_bytes_are_recorded():
    ex = exchange_for()
    ex.allreduce(make(0))
    last = ex.comm.stats.last
    Np = padded_size(N, 1)
    block = 16 + -(-(Np // 8) // 8) * 8
    assert ex.block == block
    assert (last.calls, last.payload_bytes, last.wire_bytes) == (1, 2 * block, 0.0)
    assert last.dense_payload_bytes == 8 * N and last.elements_sent == N
    assert "onebit_allreduce" in ex.comm.stats.by_kind
    # 1 bit per element plus the 16-byte headers: at this small size under 1/50 of dense float64
    assert last.payload_bytes / 2 < last.dense_payload_bytes / 50


# --------------------------------------------------------------------------- CuPy branch (strict double)
def test_cupy_branch_equals_numpy_with_one_host_read(cp):
    a, b = exchange_for(), exchange_for(xp=cp)
    for step in range(4):
        xa, xb = make(step), make(step, xp=cp)
        a.allreduce(xa)
        strict_cupy.reset_syncs()
        b.allreduce(xb)
        assert strict_cupy.total_syncs() == 1, dict(strict_cupy.syncs)
        assert np.array_equal(flat(xa), flat(xb))
    assert isinstance(b.worker_error, cp.ndarray)
    assert np.array_equal(a.worker_error, b.worker_error.get())
    # the state round trip goes through the host and back to the device
    c = exchange_for(xp=cp)
    c.load_state_dict(b.state_dict())
    xb, xc = make(9, xp=cp), make(9, xp=cp)
    b.allreduce(xb)
    c.allreduce(xc)
    assert isinstance(c.worker_error, cp.ndarray) and np.array_equal(flat(xb), flat(xc))


def test_cupy_branch_non_finite_and_mixed_libraries(cp):
    ex = exchange_for(xp=cp)
    ex.allreduce(make(0, xp=cp))
    before = ex.worker_error.get()
    x = make(1, xp=cp)
    x[0][3, 3] = math.nan
    with pytest.raises(NonFiniteError):
        ex.allreduce(x)
    assert np.array_equal(ex.worker_error.get(), before)
    with pytest.raises(TypeError):
        ex.allreduce(make(1))  # NumPy arrays for a state on the device
    assert np.array_equal(ex.worker_error.get(), before)


# --------------------------------------------------------------------------- fused copies in and out
# The caller's arrays go into the fused buffer with one copy (a fused input) or one concatenate
# (a list), and come back with one copy, or one per tensor for a list (they are the caller's own
# arrays): every other operation works on the whole buffer.
from tests.test_communicator_local import ThreadRanks, _count_calls  # noqa: E402


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_list_and_fused_inputs_give_the_same_bits_on_both_libraries(P, dtype):
    shapes = SHAPES + [(9, 11)] * 12
    runs = {}
    for lib in ("numpy", "strict"):
        for fused in (False, True):
            with strict_cupy.install() as cp:
                strict_cupy.Device.current = 0
                xp = np if lib == "numpy" else cp

                def rank(r, transport, xp=xp, fused=fused):
                    comm = sc.Communicator(transport, sc.Layout(shapes, np.dtype(dtype).name), seed=1)
                    got = []
                    for step in range(3):
                        x = make(100 * step + r, dtype, xp, shapes)
                        if fused:
                            x = xp.concatenate([a.reshape(-1) for a in x])
                        assert comm.onebit_allreduce(x) is x
                        ex = comm.onebit
                        got.append((flat(x) if not fused else np.array(sc.arrays.to_host(x)),
                                    np.array(sc.arrays.to_host(ex.worker_error)),
                                    np.array(sc.arrays.to_host(ex.server_error))))
                    return got

                runs[lib, fused] = ThreadRanks(P).run(rank)
    want = runs["numpy", False]
    for key, got in runs.items():
        for r in range(P):
            for step in range(3):
                for a, b in zip(got[r][step], want[r][step]):
                    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (key, r, step)
    # and the float64 reference of the page, at float64
    if dtype == np.float64:
        we = se = None
        for step in range(3):
            xs = [flat(make(100 * step + r, dtype, np, shapes)) for r in range(P)]
            y, we, se = ref.exchange(xs, we, se)
            for r in range(P):
                np.testing.assert_allclose(want[r][step][0], y, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_device_operations_are_constant_in_the_number_of_tensors(P, fused):
    """On the strict double: the exchange takes the same number of device operations at 10,
    100 and 1,000 tensors, fused or a list (its kernels read the tensors through a table of
    addresses: one host-to-device copy for a list of new arrays), and one host read."""
    with strict_cupy.install() as cp:
        strict_cupy.Device.current = 0
        counted = {t: _count_calls(cp, t, "onebit", "float32", P, fused)[1] for t in (10, 100, 1000)}
    extra = {t: counted[t].launches - counted[10].launches for t in (100, 1000)}
    assert extra == {100: 0, 1000: 0}, (extra, counted[10].by_op)
    assert counted[10].launches <= 6, counted[10].by_op
    assert all(c.h2d == (0 if fused else 1) and c.syncs == 1 for c in counted.values()), counted
