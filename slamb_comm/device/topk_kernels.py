"""The top-k exchange on a device: an exact per-tensor radix select, no sort (issue 33).

:meth:`Communicator.sparse_allgather` (docs/algorithm.md section 2) sends, per tensor, the
``k_elems(k, n)`` entries of largest ``|c|``, ``c = x + e``, ties to the lower index, in index
order. A sort of the whole buffer (what this replaced) moves ~230 bytes per element. Here the key
of an element is ``|c|``'s bits as an integer (order-preserving for non-negative floats), and the
k-th largest key of every tensor is found digit by digit from the top, every tensor at once, by
the kernels of :data:`SOURCE` (the dialect of :data:`slamb_comm.device.kernels.PRELUDE`: NVRTC on a GPU,
the host's compiler in the tests):

* ``topk_first``: reads x and e once, writes ``c`` (the next error buffer). A tensor of at most
  :data:`SEG_BYTES` bytes is a segment: one block keeps its ``c`` in shared memory, selects every
  digit there and writes its entries. A larger tensor is cut into tiles of ``TILE``: each tile's
  histogram of the first digit (11 bits) is added to its tensor's row (integer atomics:
  deterministic), and the tensor's last tile to finish finds the bin of the k-th largest (the
  last-block pattern of :mod:`slamb_comm.device.slamb_step`).
* ``topk_pass``, per further digit (float32: 11 bits, then 9): the same among the keys whose
  higher digits are the k-th largest's. The last one keeps every tile's histogram and count of
  keys above, and the tensor's last tile, knowing the k-th key K and how many keys equal to it go
  (the lowest indices), gives every tile its first payload entry (a scan over its tiles).
* ``topk_write``: per tile, the keys above K and the first ties, in index order (a block scan),
  into the payload; ``e = c - sent`` there; the last block writes the status word (a non-finite
  ``c``, or a value the payload's dtype cannot hold).
* ``topk_decode``: the mean of every rank's payload, written once: per 4,096 elements, each
  rank's entries found by binary search (a tensor's are in index order), added rank after rank,
  scaled and cast as NumPy does, bit for bit.

**Costs** (float32, counted on the tests' strict double: tests/test_topk_device.py): 5 kernels
(float16 4, float64 8) whatever the number of tensors, no host read; per element of a segment 12
bytes (x, e, c) and 4 for the mean; a tiled tensor 4 more per further digit and for the write.
Memory: ``c``, and per tiled tensor 8 KB and per tile 1 KB of counts. The tables: one copy to the
device, at the first call; a list's addresses are copied with them, and again when they change.
"""

import numpy as np

from . import kernels as _k

__all__ = ["SEG_BYTES", "SOURCE", "CODES", "schedule"]

#: a tensor of at most this many bytes is selected by one block in shared memory
SEG_BYTES = 32768
_BINS = 11  # bits of every digit but the last (a 2,048-bin histogram in shared memory)
_LAST = 9  # bits of the last digit at most (its per-tile histograms are kept: 512 x uint16)

_KERNELS = r"""
typedef unsigned long long u64;
typedef long long i64;
#define TOPK_TILE 4096
#define TOPK_BINS 2048
#define TOPK_SEG 32768
/* a tensor's record: offset, size, k, first payload entry, first tile, tiles, row; a tile's: tensor, lo, hi,
   index among the tiled tensors' tiles (-1: a whole tensor, a segment) */
#define TK(T, f) tens[8 * (T) + (f)]

#if defined(__CUDACC__)
SLAMB_DEV unsigned topk_add(unsigned* p, unsigned v) { return atomicAdd(p, v); }
SLAMB_DEV unsigned topk_take(unsigned* p) { return atomicExch(p, 0u); }
SLAMB_DEV u64 topk_bits(float x) { return (u64)__float_as_uint(x); }
SLAMB_DEV u64 topk_bits(double x) { return (u64)__double_as_longlong(x); }
#else
SLAMB_DEV unsigned topk_add(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
SLAMB_DEV unsigned topk_take(unsigned* p) { const unsigned o = *p; *p = 0u; return o; }
SLAMB_DEV u64 topk_bits(float x) { unsigned b; memcpy(&b, &x, 4); return (u64)b; }
SLAMB_DEV u64 topk_bits(double x) { u64 b; memcpy(&b, &x, 8); return b; }
#endif
/* what other blocks of this launch wrote, past this SM's L1 */
template <typename T> SLAMB_DEV T topk_read(const T* p) { return *(const volatile T*)p; }

/* |c|'s bits: the order of |c| (NaN above Inf); finite below the exponent's all-ones */
SLAMB_DEV u64 topk_key(unsigned short h) { return (u64)(h & 0x7fffu); }
SLAMB_DEV u64 topk_key(float x) { return topk_bits(x) & 0x7fffffffULL; }
SLAMB_DEV u64 topk_key(double x) { return topk_bits(x) & 0x7fffffffffffffffULL; }
SLAMB_DEV bool topk_finite(unsigned short h) { return topk_key(h) < 0x7c00ULL; }
SLAMB_DEV bool topk_finite(float x) { return topk_key(x) < 0x7f800000ULL; }
SLAMB_DEV bool topk_finite(double x) { return topk_key(x) < 0x7ff0000000000000ULL; }

/* arithmetic in the layout's dtype P (float16 travels as its bits: in float32, rounded once, as NumPy) */
SLAMB_DEV float topk_wide(unsigned short h) { return slamb_h2f(h); }
SLAMB_DEV float topk_wide(float x) { return x; }
SLAMB_DEV double topk_wide(double x) { return x; }
SLAMB_DEV unsigned short topk_narrow(unsigned short, float w) { return slamb_f2h(w); }
SLAMB_DEV float topk_narrow(float, float w) { return w; }
SLAMB_DEV double topk_narrow(double, double w) { return w; }
template <typename P> SLAMB_DEV P topk_plus(P a, P b) { return topk_narrow(a, topk_wide(a) + topk_wide(b)); }
template <typename P> SLAMB_DEV P topk_minus(P a, P b) { return topk_narrow(a, topk_wide(a) - topk_wide(b)); }
/* topk_to((V*)0, x): x cast to V, float16 (bits), float32 or float64, to nearest as NumPy's astype */
#define TOPK_TO(V, P, E) SLAMB_DEV V topk_to(V*, P x) { return E; }
TOPK_TO(unsigned short, unsigned short, x) TOPK_TO(unsigned short, float, slamb_f2h(x))
TOPK_TO(unsigned short, double, slamb_d2h(x))
TOPK_TO(float, unsigned short, slamb_h2f(x)) TOPK_TO(float, float, x) TOPK_TO(float, double, (float)x)
TOPK_TO(double, unsigned short, (double)slamb_h2f(x)) TOPK_TO(double, float, (double)x) TOPK_TO(double, double, x)

/* where x comes from: one fused buffer, or a table of the tensors' addresses */
template <typename P> struct TopkX { const i64* tens; int list; const P* fused; const u64* ptr; };
template <typename P> SLAMB_DEV P topk_x(const TopkX<P>& x, i64 T, i64 i) {
  return x.list ? ((const P*)x.ptr[T])[i - x.tens[8 * T]] : x.fused[i];
}

/* in-place scans of 256 values, one per thread (tmp: 256 more) */
SLAMB_DEV void topk_scan(i64* a, i64* tmp, bool suffix) {
  for (unsigned s = 1; s < 256; s <<= 1) {
    SLAMB_FOR_THREADS(t) {
      const bool in = suffix ? t + s < 256 : t >= s;
      tmp[t] = a[t] + (in ? a[suffix ? t + s : t - s] : 0);
    }
    SLAMB_SYNC();
    SLAMB_FOR_THREADS(t) { a[t] = tmp[t]; }
    SLAMB_SYNC();
  }
}

/* Of the counts hist[0, B) (B a power of two <= 2048), the bin holding the r-th largest (r >= 1, from the
   top bin down) into res[0], and r's rank within it into res[1]. The whole block calls it. */
SLAMB_DEV void topk_find(const unsigned* hist, int B, i64 r, i64* sa, i64* sb, i64* res) {
  const int per = B > 256 ? B / 256 : 1;
  SLAMB_FOR_THREADS(t) {
    i64 s = 0;
    for (int d = (int)t * per; d < (int)(t + 1) * per && d < B; ++d) s += hist[d];
    sa[t] = s;
  }
  SLAMB_SYNC();
  topk_scan(sa, sb, true);
  SLAMB_FOR_THREADS(t) {
    i64 cum = t + 1 < 256 ? sa[t + 1] : 0;
    if (cum < r && r <= sa[t]) {
      for (int d = (int)(t + 1) * per - 1; d >= (int)t * per; --d) {
        if (cum + hist[d] >= r) { res[0] = d; res[1] = r - cum; break; }
        cum += hist[d];
      }
    }
  }
  SLAMB_SYNC();
}

/* The k-th largest key of the n values cs (shared memory), digit by digit (sched: count, then shift and
   width per digit): the key into *kth, how many keys equal to it are taken into *need. */
template <typename P>
SLAMB_DEV void topk_select_block(const P* cs, i64 n, i64 k, const i64* sched, unsigned* hist, i64* sa, i64* sb,
                                 i64* res, u64* kth, i64* need) {
  u64 pre = 0;
  i64 r = k;
  for (int p = 0; p < (int)sched[0]; ++p) {
    const int shift = (int)sched[1 + 2 * p], width = (int)sched[2 + 2 * p], hs = shift + width, B = 1 << width;
    SLAMB_FOR_THREADS(t) { for (int d = (int)t; d < B; d += blockDim.x) hist[d] = 0; }
    SLAMB_SYNC();
    SLAMB_FOR_THREADS(t) {
      for (i64 j = t; j < n; j += blockDim.x) {
        const u64 key = topk_key(cs[j]);
        if ((key >> hs) == (pre >> hs)) topk_add(&hist[(key >> shift) & (u64)(B - 1)], 1u);
      }
    }
    SLAMB_SYNC();
    topk_find(hist, B, r, sa, sb, res);
    pre |= (u64)res[0] << shift;
    r = res[1];
  }
  *kth = pre;
  *need = r;
}

/* The entries of the n values cs (shared memory; fused positions lo ..): keys above kth, and keys equal
   to it while fewer than `need` ties (eqb of them before this tile) are taken, in index order from
   payload entry `at0` (a block scan of per-thread counts over contiguous runs). e = c - sent there. */
template <typename P, typename V>
SLAMB_DEV void topk_emit(const P* cs, i64 n, i64 lo, i64 off, i64 at0, i64 end, u64 kth, i64 need, i64 eqb,
                         int has_e, P* cbuf, int keep, int* idx, V* val, i64* pos, int want_pos,
                         unsigned* word, i64* sa, i64* sb) {
  const i64 q = (n + 255) / 256;
  SLAMB_FOR_THREADS(t) {
    i64 gt = 0, eq = 0;
    for (i64 j = t * q; j < (i64)(t + 1) * q && j < n; ++j) {
      const u64 key = topk_key(cs[j]);
      gt += key > kth;
      eq += key == kth;
    }
    sa[t] = gt | (eq << 32);
  }
  SLAMB_SYNC();
  topk_scan(sa, sb, false);
  SLAMB_FOR_THREADS(t) {
    const i64 before = t ? sa[t - 1] : 0, eq_here = before >> 32, room = need - eqb > 0 ? need - eqb : 0;
    i64 at = at0 + (before & 0xffffffffLL) + (eq_here < room ? eq_here : room), tie = eqb + eq_here;
    unsigned bad = 0;
    for (i64 j = t * q; j < (i64)(t + 1) * q && j < n; ++j) {
      const P c = cs[j];
      const u64 key = topk_key(c);
      bool take = key > kth;
      if (key == kth) take = tie++ < need;
      if (!take || at >= end) continue;
      const V v = topk_to((V*)0, c);
      idx[at] = (int)(lo + j - off);
      val[at] = v;
      if (want_pos) pos[at] = lo + j;
      if (keep) cbuf[lo + j] = topk_minus(has_e ? c : topk_plus(c, (P)0), topk_to((P*)0, v));
      if (!topk_finite(v)) bad = 1;
      ++at;
    }
    if (bad) slamb_atomic_or(word, 1u);
  }
  SLAMB_SYNC();
}

/* One tile's histogram (in hist) goes into its tensor's row; the tensor's last tile to finish takes the
   row back (zeroed for the next pass), finds the bin of the rank-th largest and sets the state. */
SLAMB_DEV bool topk_resolve(const i64* tens, i64 T, unsigned* hist, int B, int shift, u64 pre, i64 r, unsigned* row,
                            unsigned* done, u64* prefix, i64* rank, i64* sa, i64* sb, i64* res, int* last) {
  SLAMB_FOR_THREADS(t) {
    for (int d = (int)t; d < B; d += blockDim.x) if (hist[d]) topk_add(&row[d], hist[d]);
  }
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0) {
      SLAMB_FENCE();
      *last = slamb_atomic_inc(&done[T]) == (unsigned)TK(T, 5) - 1;
    }
  }
  SLAMB_SYNC();
  if (!*last) return false;
  SLAMB_FOR_THREADS(t) { for (int d = (int)t; d < B; d += blockDim.x) hist[d] = topk_take(&row[d]); }
  SLAMB_SYNC();
  topk_find(hist, B, r, sa, sb, res);
  SLAMB_FOR_THREADS(t) {
    if (t == 0) {
      prefix[T] = pre | ((u64)res[0] << shift);
      rank[T] = res[1];
      done[T] = 0;
    }
  }
  SLAMB_SYNC();
  return true;
}

/* ---- kernel 1: c = x + e once; segments selected and written; the tiles' first digit ---- */
template <typename P, typename V>
SLAMB_DEV void topk_first_impl(const i64* tens, const i64* tiles, i64 ntiles, const i64* sched, TopkX<P> x,
                               const P* e, int has_e, P* cbuf, int keep, u64* prefix, i64* rank, unsigned* done,
                               unsigned* rows, int* idx, V* val, i64* pos, int want_pos, unsigned* word) {
  SLAMB_SHARED P cs[TOPK_SEG / sizeof(P)];
  SLAMB_SHARED unsigned hist[TOPK_BINS];
  SLAMB_SHARED i64 sa[256], sb[256], res[2];
  SLAMB_SHARED u64 kth;
  SLAMB_SHARED i64 need;
  SLAMB_SHARED int last;
  const int shift = (int)sched[1], width = (int)sched[2], B = 1 << width;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const i64 T = tiles[4 * tile], lo = tiles[4 * tile + 1], hi = tiles[4 * tile + 2], seg = tiles[4 * tile + 3] < 0;
    SLAMB_FOR_THREADS(t) { for (int d = (int)t; d < B; d += blockDim.x) hist[d] = 0; }
    SLAMB_SYNC();
    SLAMB_FOR_THREADS(t) {
      unsigned bad = 0;
      for (i64 i = lo + t; i < hi; i += blockDim.x) {
        const P xi = topk_x(x, T, i);
        const P c = has_e ? topk_plus(xi, e[i]) : xi;
        if (keep) cbuf[i] = has_e ? c : topk_plus(c, (P)0); /* the first e: 0 + x */
        if (!topk_finite(c)) bad = 1;
        if (seg) cs[i - lo] = c;
        else topk_add(&hist[topk_key(c) >> shift], 1u);
      }
      if (bad) slamb_atomic_or(word, 1u);
    }
    SLAMB_SYNC();
    if (seg) {
      topk_select_block(cs, hi - lo, TK(T, 2), sched, hist, sa, sb, res, &kth, &need);
      topk_emit(cs, hi - lo, lo, TK(T, 0), TK(T, 3), TK(T, 3) + TK(T, 2), kth, need, (i64)0, has_e, cbuf, keep, idx,
                val, pos, want_pos, word, sa, sb);
    } else {
      topk_resolve(tens, T, hist, B, shift, 0, TK(T, 2), rows + TOPK_BINS * TK(T, 6), done, prefix, rank, sa, sb,
                   res, &last);
    }
  }
}

/* The last pass's last tile of tensor T: per tile, the keys above the k-th and equal to it; then every
   tile's first payload entry and ties before it (tstat: above, first entry, ties before; per tile) */
SLAMB_DEV void topk_scan_tiles(const i64* tens, const i64* tiles, i64 T, i64 b, i64 need, int lb,
                               const unsigned short* thist, i64* tstat, i64* sa, i64* sb, i64* sc, i64* sd) {
  const i64 m0 = tiles[4 * TK(T, 4) + 3], nt = TK(T, 5), q = (nt + 255) / 256;
  SLAMB_FOR_THREADS(t) {
    i64 g = 0, e = 0;
    for (i64 m = m0 + t * q; m < m0 + (i64)(t + 1) * q && m < m0 + nt; ++m) {
      i64 gt = topk_read(&tstat[3 * m]);
      for (int d = (int)b + 1; d < lb; ++d) gt += topk_read(&thist[m * lb + d]);
      const i64 eq = topk_read(&thist[m * lb + b]);
      tstat[3 * m + 1] = gt;
      tstat[3 * m + 2] = eq;
      g += gt;
      e += eq;
    }
    sa[t] = g;
    sb[t] = e;
  }
  SLAMB_SYNC();
  topk_scan(sa, sc, false);
  topk_scan(sb, sd, false);
  SLAMB_FOR_THREADS(t) {
    i64 g = t ? sa[t - 1] : 0, e = t ? sb[t - 1] : 0;
    for (i64 m = m0 + t * q; m < m0 + (i64)(t + 1) * q && m < m0 + nt; ++m) {
      const i64 gt = tstat[3 * m + 1], eq = tstat[3 * m + 2];
      tstat[3 * m + 1] = TK(T, 3) + g + (e < need ? e : need);
      tstat[3 * m + 2] = e;
      g += gt;
      e += eq;
    }
  }
  SLAMB_SYNC();
}

/* ---- kernel 2 (once per further digit): the tiles' histograms of the digit below the known ones ---- */
template <typename P>
SLAMB_DEV void topk_pass_impl(const i64* tens, const i64* tiles, i64 ntiles, TopkX<P> x, const P* cbuf, int has_e,
                              u64* prefix, i64* rank, unsigned* done, unsigned* rows, unsigned short* thist,
                              i64* tstat, int shift, int width, int final) {
  SLAMB_SHARED unsigned hist[TOPK_BINS];
  SLAMB_SHARED i64 sa[256], sb[256], sc[256], sd[256], res[2];
  SLAMB_SHARED int last;
  const int hs = shift + width, B = 1 << width;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const i64 m = tiles[4 * tile + 3];
    if (m < 0) continue;
    const i64 T = tiles[4 * tile], lo = tiles[4 * tile + 1], hi = tiles[4 * tile + 2];
    const u64 pre = prefix[T];
    SLAMB_FOR_THREADS(t) { for (int d = (int)t; d < B; d += blockDim.x) hist[d] = 0; }
    SLAMB_SYNC();
    SLAMB_FOR_THREADS(t) {
      i64 above = 0;
      for (i64 i = lo + t; i < hi; i += blockDim.x) {
        const u64 key = topk_key(has_e ? cbuf[i] : topk_x(x, T, i));
        if ((key >> hs) == (pre >> hs)) topk_add(&hist[(key >> shift) & (u64)(B - 1)], 1u);
        above += (key >> hs) > (pre >> hs);
      }
      sa[t] = above;
    }
    SLAMB_SYNC();
    if (final) {
      SLAMB_FOR_THREADS(t) {
        for (int d = (int)t; d < B; d += blockDim.x) thist[m * B + d] = (unsigned short)hist[d];
        if (t == 0) {
          i64 above = 0;
          for (int u = 0; u < 256; ++u) above += sa[u];
          tstat[3 * m] = above;
        }
        SLAMB_FENCE(); /* before the tile counts as done: the tensor's last tile reads them */
      }
      SLAMB_SYNC();
    }
    if (topk_resolve(tens, T, hist, B, shift, pre, rank[T], rows + TOPK_BINS * TK(T, 6), done, prefix, rank, sa, sb,
                     res, &last) && final)
      topk_scan_tiles(tens, tiles, T, res[0], res[1], B, thist, tstat, sa, sb, sc, sd);
  }
}

/* ---- kernel 3: the tiles' entries in index order, e = c - sent there; the status word ---- */
template <typename P, typename V>
SLAMB_DEV void topk_write_impl(const i64* tens, const i64* tiles, i64 ntiles, TopkX<P> x, P* cbuf, int has_e, int keep,
                               const u64* prefix, const i64* rank, const i64* tstat, int* idx, V* val, i64* pos,
                               int want_pos, unsigned* word, int* status, int bad_code) {
  SLAMB_SHARED P cs[TOPK_TILE];
  SLAMB_SHARED i64 sa[256], sb[256];
  SLAMB_SHARED int last;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const i64 m = tiles[4 * tile + 3];
    if (m < 0) continue;
    const i64 T = tiles[4 * tile], lo = tiles[4 * tile + 1], hi = tiles[4 * tile + 2];
    SLAMB_FOR_THREADS(t) {
      for (i64 i = lo + t; i < hi; i += blockDim.x) cs[i - lo] = has_e ? cbuf[i] : topk_x(x, T, i);
    }
    SLAMB_SYNC();
    topk_emit(cs, hi - lo, lo, TK(T, 0), tstat[3 * m + 1], TK(T, 3) + TK(T, 2), prefix[T], rank[T], tstat[3 * m + 2],
              has_e, cbuf, keep, idx, val, pos, want_pos, word, sa, sb);
  }
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0) {
      SLAMB_FENCE();
      last = slamb_atomic_inc(word + 1) == gridDim.x - 1;
    }
  }
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0 && last) {
      *status = slamb_atomic_or(word, 0u) ? bad_code : 0;
      word[0] = 0;
      word[1] = 0;
    }
  }
}

/* ---- kernel 4: out = (sum over ranks of their entries, in W, rank after rank) * scale, cast ---- */
template <typename O> struct TopkAcc { typedef float W; };
template <> struct TopkAcc<double> { typedef double W; };
SLAMB_DEV i64 topk_lower(const int* a, i64 n, i64 v) {
  i64 lo = 0;
  while (n > 0) {
    const i64 h = n / 2;
    if (a[lo + h] < v) { lo += h + 1; n -= h + 1; } else n = h;
  }
  return lo;
}

template <typename V, typename O>
SLAMB_DEV void topk_decode_impl(const i64* tens, const i64* tiles, i64 ntiles, const unsigned char* recv, i64 ranks,
                                i64 nbytes, i64 idx_at, i64 val_at, double scale, int scaled, O* out) {
  typedef typename TopkAcc<O>::W W;
  SLAMB_SHARED W acc[TOPK_TILE];
  SLAMB_SHARED i64 ra[256], rb[256];
  const W s = (W)scale;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const i64 T = tiles[4 * tile], off = TK(T, 0), k = TK(T, 2), a0 = TK(T, 3);
    for (i64 lo = tiles[4 * tile + 1]; lo < tiles[4 * tile + 2]; lo += TOPK_TILE) {
      const i64 n = tiles[4 * tile + 2] - lo < TOPK_TILE ? tiles[4 * tile + 2] - lo : TOPK_TILE;
      SLAMB_FOR_THREADS(t) { for (i64 j = t; j < n; j += blockDim.x) acc[j] = (W)0; }
      for (i64 r0 = 0; r0 < ranks; r0 += 256) {
        SLAMB_SYNC();
        SLAMB_FOR_THREADS(t) {
          if (r0 + t < ranks) {
            const int* li = (const int*)(recv + (r0 + t) * nbytes + idx_at) + a0;
            ra[t] = topk_lower(li, k, lo - off);
            rb[t] = topk_lower(li, k, lo + n - off);
          }
        }
        for (i64 r = r0; r < ranks && r < r0 + 256; ++r) {
          SLAMB_SYNC();
          SLAMB_FOR_THREADS(t) {
            const int* li = (const int*)(recv + r * nbytes + idx_at) + a0;
            const V* lv = (const V*)(recv + r * nbytes + val_at) + a0;
            for (i64 j = ra[r - r0] + t; j < rb[r - r0]; j += blockDim.x) {
              const i64 at = li[j] - (lo - off);
              acc[at] = acc[at] + (W)topk_to((W*)0, lv[j]);
            }
          }
        }
      }
      SLAMB_SYNC();
      SLAMB_FOR_THREADS(t) {
        for (i64 j = t; j < n; j += blockDim.x) out[lo + j] = topk_to((O*)0, scaled ? acc[j] * s : acc[j]);
      }
      SLAMB_SYNC();
    }
  }
}

/* ---- the instances: layout dtype P and payload dtype V in float16 (h2), float32 (f4), float64 (f8) ---- */
#define TOPK_P(P, NAME) \
  SLAMB_KERNEL topk_pass_##NAME(const i64* a0, const i64* a1, i64 a2, int a3, const P* a4, const u64* a5, \
      const P* a6, int a7, u64* a8, i64* a9, unsigned* a10, unsigned* a11, unsigned short* a12, i64* a13, int a14, \
      int a15, int a16) { \
    const TopkX<P> x = {a0, a3, a4, a5}; \
    topk_pass_impl<P>(a0, a1, a2, x, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16); }
#define TOPK_PV(P, V, NAME) \
  SLAMB_KERNEL topk_first_##NAME(const i64* a0, const i64* a1, i64 a2, const i64* a3, int a4, const P* a5, \
      const u64* a6, const P* a7, int a8, P* a9, int a10, u64* a11, i64* a12, unsigned* a13, unsigned* a14, \
      int* a15, V* a16, i64* a17, int a18, unsigned* a19) { \
    const TopkX<P> x = {a0, a4, a5, a6}; \
    topk_first_impl<P, V>(a0, a1, a2, a3, x, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19); } \
  SLAMB_KERNEL topk_write_##NAME(const i64* a0, const i64* a1, i64 a2, int a3, const P* a4, const u64* a5, P* a6, \
      int a7, int a8, const u64* a9, const i64* a10, const i64* a11, int* a12, V* a13, i64* a14, int a15, \
      unsigned* a16, int* a17, int a18) { \
    const TopkX<P> x = {a0, a3, a4, a5}; \
    topk_write_impl<P, V>(a0, a1, a2, x, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18); } \
  SLAMB_KERNEL topk_decode_##NAME(const i64* a0, const i64* a1, i64 a2, const unsigned char* a3, i64 a4, i64 a5, \
      i64 a6, i64 a7, double a8, int a9, P* a10) { \
    topk_decode_impl<V, P>(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10); }
"""

#: a dtype's code in the kernels' names
CODES = {"float16": "h2", "float32": "f4", "float64": "f8"}
_C_TYPES = {"float16": "unsigned short", "float32": "float", "float64": "double"}

#: the kernels, after the dialect's prelude (compiled by :func:`slamb_comm.device.kernels.module`): the
#: instances for every layout dtype P and payload dtype V
SOURCE = _k.PRELUDE + _KERNELS + "".join(
    [f"TOPK_P({_C_TYPES[p]}, {CODES[p]})\n" for p in CODES]
    + [f"TOPK_PV({_C_TYPES[p]}, {_C_TYPES[v]}, {CODES[p]}{CODES[v]})\n" for p in CODES for v in CODES])


def schedule(dtype):
    """The digits of the keys of a layout of ``dtype`` (15, 31 or 63 bits), from the top, as
    ``[(shift, width), ...]``: 11 bits, then as many of at most 11 as needed, the last of at most 9
    (float16: 11, 4; float32: 11, 11, 9; float64: 11, 11, 11, 11, 10, 9)."""
    bits = {2: 15, 4: 31, 8: 63}[np.dtype(dtype).itemsize]
    last = min(_LAST, bits - _BINS)
    mid = bits - _BINS - last
    n = -(-mid // _BINS)
    out, shift = [], bits
    for w in [_BINS] + [mid // n + (j < mid % n) for j in range(n)] + [last]:
        shift -= w
        out.append((shift, w))
    return out
