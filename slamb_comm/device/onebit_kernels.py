"""The device kernels of the 1-bit exchange and of 1-bit LAMB's step (docs/onebit_lamb.md section 5).

One source after :data:`slamb_comm.device.kernels.PRELUDE`, in its dialect (NVRTC compiles it on a GPU, the
tests' strict CuPy double the same text on the host), and the helpers of the launches, which live
with their callers: :class:`slamb_comm.exchange.onebit.DeviceWire` (the exchange) and 1-bit LAMB's step in
:mod:`slamb_comm.device.onebit_step`. Every pass reads the layout's tensors where they are (a fused buffer,
or a table of device addresses, one per tensor), so no launch count depends on the number of tensors:

* ``ob_encode_x`` / ``ob_encode_m``: a worker's ``c = x + e`` (x the exchange's input, or 1-bit
  LAMB's ``M = γ (β1 m + (1 - β1) g)`` computed on the fly), its signs packed straight into the
  all-to-all's blocks, ``||c||²``; the last block to finish writes the scale and status headers;
* ``ob_server``: the server's average of the P chunks plus its error, likewise for the allgather;
* ``ob_collect``: both phases' status words, for the one host read;
* ``ob_decode``: the result into the caller's tensors, both error buffers committed in place;
* ``ob_scan``, ``ob_warm`` / ``ob_comp``, ``ob_coeffs``, ``ob_update``, ``ob_gamma``: 1-bit LAMB's
  gradient check, moments (``ob_comp`` decodes M and commits the errors), per-tensor coefficients
  from per-tile float64 partials (as :mod:`slamb_comm.device.slamb_step`), update, and scaling factors.

**The scales are NumPy's bits.** ``||c||²`` is summed in float64 in exactly the tree of NumPy's
pairwise summation (``pairwise_sum``, numpy/_core/src/umath/loops_utils.h.src: a range of more than
128 elements is the sum of its halves, the first ``n/2`` rounded down to a multiple of 8; one of at
most 128 sums every 8th element in 8 accumulators): a thread sums a leaf, a block a subtree of 256
leaves, the last block the subtrees. So the exchange is bit for bit the NumPy path's, on the double
and on a GPU alike; 1-bit LAMB's per-tensor norms agree within float rounding.
"""

import numpy as np

from . import tables as _dev
from . import kernels as _k

__all__ = ["SOURCE", "KERNELS", "name", "launch"]

_KERNELS = r"""
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned char u8;

/* ---- values: float16 as its bits, computed in float ---- */
SLAMB_DEV float ob_get(const unsigned short* a, i64 i) { return slamb_h2f(a[i]); }
SLAMB_DEV float ob_get(const float* a, i64 i) { return a[i]; }
SLAMB_DEV double ob_get(const double* a, i64 i) { return a[i]; }
SLAMB_DEV void ob_put(unsigned short* a, i64 i, float x) { a[i] = slamb_f2h(x); }
SLAMB_DEV void ob_put(float* a, i64 i, float x) { a[i] = x; }
SLAMB_DEV void ob_put(double* a, i64 i, double x) { a[i] = x; }
SLAMB_DEV unsigned short ob_narrow(double s, unsigned short) { return slamb_d2h(s); }
SLAMB_DEV float ob_narrow(double s, float) { return (float)s; }
SLAMB_DEV double ob_narrow(double s, double) { return s; }
SLAMB_DEV float ob_widen(unsigned short h) { return slamb_h2f(h); }
SLAMB_DEV float ob_widen(float v) { return v; }
SLAMB_DEV double ob_widen(double v) { return v; }
SLAMB_DEV bool ob_finite(float x) { return x - x == 0.0f; }
SLAMB_DEV bool ob_finite(double x) { return x - x == 0.0; }
SLAMB_DEV bool ob_finite(unsigned short h) { return (h & 0x7c00) != 0x7c00; }
SLAMB_DEV double ob_max(double a, double b) { return (b > a || b != b) ? b : a; } /* NaN wins, as NumPy's max */

/* ---- the wire: a block is an int32 status, 4 zero bytes, the scale as V, zeros to 16 bytes, then the signs ---- */
template <typename A, typename V> SLAMB_DEV A ob_scale_of(const u8* blk) { return (A)ob_widen(*(const V*)(blk + 8)); }
SLAMB_DEV unsigned ob_bit(const u8* signs, i64 l) { return (signs[l >> 3] >> (7 - (l & 7))) & 1u; }
template <typename V> SLAMB_DEV void ob_header(u8* h, int status, V s) {
  for (int b = 4; b < 16; ++b) h[b] = 0;
  *(int*)h = status;
  *(V*)(h + 8) = s;
}
/* element i of the padded vector after phase 2: sigma_k sgn(u_k) of server k = i / nc, as the NumPy path decodes it */
template <typename A, typename V> SLAMB_DEV A ob_decoded(const u8* recv2, i64 B, i64 nc, i64 i) {
  const i64 k = i / nc;
  const A b = (A)ob_bit(recv2 + k * B + 16, i - k * nc);
  return (b * (A)2 - (A)1) * ob_scale_of<A, V>(recv2 + k * B);
}

/* ---- a layout's tensors: a fused buffer, or a table of addresses, one per tensor ---- */
template <typename X> SLAMB_DEV X* ob_base(const u64* tab, X* flat, const i64* toff, int fused, int T) {
  return fused ? flat + toff[T] : (X*)tab[T];
}
SLAMB_DEV int ob_tensor_of(const i64* toff, int ntensors, i64 i) { /* the last tensor that starts at or before i */
  int lo = 0, hi = ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (toff[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}
template <typename X> SLAMB_DEV X ob_momentum(X m, X g, double b1, double c1b1, double gam) {
  const X a = m * (X)b1;
  const X b = (X)c1b1 * g;
  return (a + b) * (X)gam; /* M = gamma (b1 m + (1 - b1) g), rounded as the NumPy path's three operations */
}
template <typename X> SLAMB_DEV X ob_direction(X m, X v, X x, double c1, double cv, double eps, double wd) {
  const X d = slamb_sqrt(cv != 1.0 ? v / (X)cv : v) + (X)eps;
  X u = (c1 != 1.0 ? m / (X)c1 : m) / d;
  if (wd > 0.0) u = u + (X)wd * x;
  return u;
}

/* ---- the values a tree pass compresses ---- */
template <typename X, typename A> struct ObSrcX { /* c = x + e, 0 on the padding (and for a rank that rejected x) */
  const u64* tab; const X* flat; int fused; const i64* toff; int ntensors; i64 N; const A* e; int has_e; int zero;
};
template <typename X, typename A> SLAMB_DEV A ob_value(const ObSrcX<X, A>& s, int* T, i64 i) {
  A c = (A)0;
  if (!s.zero && i < s.N) {
    while (*T + 1 < s.ntensors && s.toff[*T + 1] <= i) ++*T;
    c = (A)ob_get(ob_base(s.tab, s.flat, s.toff, s.fused, *T), i - s.toff[*T]);
  }
  if (s.has_e) c = c + s.e[i];
  return c;
}
template <typename X> struct ObSrcM { /* c = M + e: 1-bit LAMB's scaled momentum from m and this rank's g */
  const u64* tab; const X* flat; int fused; const i64* toff; int ntensors; i64 N; const X* m; const double* gamma;
  double b1, c1b1; const X* e; int has_e;
};
template <typename X> SLAMB_DEV X ob_value(const ObSrcM<X>& s, int* T, i64 i) {
  X c = (X)0;
  if (i < s.N) {
    while (*T + 1 < s.ntensors && s.toff[*T + 1] <= i) ++*T;
    const X g = ob_base(s.tab, s.flat, s.toff, s.fused, *T)[i - s.toff[*T]];
    c = ob_momentum(s.m[i], g, s.b1, s.c1b1, s.gamma[*T]);
  }
  if (s.has_e) c = c + s.e[i];
  return c;
}
template <typename A, typename V> struct ObSrcS {
  const u8* recv; i64 B; int P; double inv_p; const A* es; int has_es;
};
template <typename A, typename V> SLAMB_DEV A ob_value(const ObSrcS<A, V>& s, int*, i64 i) {
  A u = (A)0; /* u = sum_j (s_j / P) sgn(c_j) + server error, summed over j in order from zeros */
  for (int j = 0; j < s.P; ++j) {
    const u8* blk = s.recv + j * s.B;
    const A b = (A)ob_bit(blk + 16, i);
    u = u + (b * (A)2 - (A)1) * (ob_scale_of<A, V>(blk) * (A)s.inv_p);
  }
  if (s.has_es) u = u + s.es[i];
  return u;
}
template <typename S> SLAMB_DEV int ob_start(const S& s, i64 i) {
  return i < s.N ? ob_tensor_of(s.toff, s.ntensors, i) : 0;
}
template <typename A, typename V> SLAMB_DEV int ob_start(const ObSrcS<A, V>&, i64) { return 0; }

/* whether this block is the grid's last to get here: every block's writes before it are then visible */
SLAMB_DEV bool ob_last(unsigned* counter) {
  SLAMB_SHARED int last;
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0) {
      SLAMB_FENCE();
      last = slamb_atomic_inc(counter) == gridDim.x - 1;
    }
  }
  SLAMB_SYNC();
  return last;
}

/* ---- NumPy's pairwise tree. Slot k of depth H: the node reached from the root by the H bits of k, most significant
   first, where a leaf's left child is itself and its right one empty: every leaf is one slot, and the sum is a perfect
   binary tree of 2^H slots. n is a multiple of 8, so every node is. ---- */
SLAMB_DEV i64 ob_slot(i64 n, int H, i64 k, i64* size) {
  i64 start = 0, m = n;
  for (int d = H - 1; d >= 0; --d) {
    const bool right = (k >> d) & 1;
    if (m > 128) {
      i64 h = m / 2;
      h -= h % 8;
      if (right) { start += h; m -= h; } else { m = h; }
    } else if (right) {
      m = 0;
    }
  }
  *size = m;
  return start;
}

/* c of each of the n elements into keep, its signs into out (byte q at (q / cb) B + 16 + q % cb), ||c||^2 in NumPy's
   tree; the last block writes the scale ||c|| / sqrt(n) as V and the status into the nblk headers of out */
template <typename A, typename V, typename Src>
SLAMB_DEV void ob_tree(const Src& src, i64 n, int H, A* __restrict__ keep, u8* __restrict__ out, i64 cb, i64 B,
                       int nblk, int problem, double sqrt_n, double* __restrict__ partials,
                       unsigned* __restrict__ word) {
  SLAMB_SHARED double sh[256];
  const i64 S = H < 8 ? ((i64)1 << H) : 256, nsub = ((i64)1 << H) / S;
  for (i64 sub = blockIdx.x; sub < nsub; sub += gridDim.x) {
    SLAMB_FOR_THREADS(t) {
      i64 m = 0;
      const i64 start = t < S ? ob_slot(n, H, sub * S + t, &m) : 0;
      int cur = ob_start(src, start);
      double r[8];
      for (i64 row = 0; row < m / 8; ++row) {
        unsigned byte = 0;
        for (int j = 0; j < 8; ++j) {
          const i64 i = start + 8 * row + j;
          const A c = ob_value(src, &cur, i);
          keep[i] = c;
          const double sq = (double)c * (double)c;
          r[j] = row ? r[j] + sq : sq;
          if (c >= (A)0) byte |= 0x80u >> j;
        }
        const i64 q = (start >> 3) + row;
        out[(q / cb) * B + 16 + q % cb] = (u8)byte;
      }
      sh[t] = m ? ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])) : 0.0;
    }
    SLAMB_SYNC();
    for (i64 s = 1; s < S; s <<= 1) {
      SLAMB_FOR_THREADS(t) { if (t % (2 * s) == 0) sh[t] += sh[t + s]; }
      SLAMB_SYNC();
    }
    SLAMB_FOR_THREADS(t) { if (t == 0) partials[sub] = sh[0]; }
    SLAMB_SYNC();
  }
  if (ob_last(word + 1)) { /* the subtrees' sums, in the same tree */
    volatile double* p = partials;
    for (i64 s = 1; s < nsub; s <<= 1) {
      SLAMB_FOR_THREADS(t) {
        for (i64 k = (i64)t * 2 * s; k < nsub; k += (i64)blockDim.x * 2 * s) p[k] = p[k] + p[k + s];
      }
      SLAMB_SYNC();
    }
    SLAMB_FOR_THREADS(t) {
      if (t == 0) {
        const V s = ob_narrow(slamb_sqrt((double)p[0]) / sqrt_n, (V)0);
        const int status = problem ? 1 : (ob_finite(s) ? 0 : 2);
        for (int k = 0; k < nblk; ++k) ob_header(out + k * B, status, s);
        word[1] = 0;
      }
    }
  }
}

/* ---- the error buffers committed in place: e = c - s sgn(c), server error = u - sigma sgn(u) (grid-stride) ---- */
template <typename A, typename V>
SLAMB_DEV void ob_commit(const A* __restrict__ c, A* __restrict__ e, i64 Np, const u8* __restrict__ send,
                         const A* __restrict__ u, A* __restrict__ es, i64 nc, const u8* __restrict__ send2) {
  if (Np == 0) return;
  const A s = ob_scale_of<A, V>(send), sg = ob_scale_of<A, V>(send2);
  SLAMB_FOR_THREADS(t) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + t; i < Np; i += (i64)gridDim.x * blockDim.x) {
      e[i] = c[i] - (c[i] >= (A)0 ? s : -s);
      if (i < nc) es[i] = u[i] - (u[i] >= (A)0 ? sg : -sg);
    }
  }
}

/* ---- the exchange's result into the tensors (tile by tile), then the commit ---- */
template <typename X, typename A, typename V>
SLAMB_DEV void ob_decode_impl(const int* tile_tensor, const i64* tile_lo, const i64* tile_hi, i64 ntiles,
    const u64* tab, X* flat, int fused, const i64* toff, const u8* recv2, i64 B, i64 nc, const A* c, A* e, i64 Np,
    const u8* send, const A* u, A* es, const u8* send2) {
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], hi = tile_hi[tile], off = toff[T];
    X* x = ob_base(tab, flat, toff, fused, T);
    SLAMB_FOR_THREADS(t) {
      for (i64 i = lo + t; i < hi; i += blockDim.x) ob_put(x, i - off, ob_decoded<A, V>(recv2, B, nc, i));
    }
  }
  ob_commit<A, V>(c, e, Np, send, u, es, nc, send2);
}

/* mode 0: the gradient copied into out and checked (warm-up); mode 1: M checked (the compression stage at P = 1).
   word[0] |= bad in every block; the last block to finish sets word[2], the verdict, and clears 0 and 1 */
template <typename X>
SLAMB_DEV void ob_scan_impl(const int* tile_tensor, const i64* tile_lo, const i64* tile_hi, i64 ntiles,
    const u64* tab, const X* flat, int fused, const i64* toff, const X* m, const double* gamma, double b1,
    double c1b1, X* out, int mode, unsigned* word) {
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], hi = tile_hi[tile], off = toff[T];
    const X* g = ob_base(tab, flat, toff, fused, T);
    SLAMB_FOR_THREADS(t) {
      unsigned bad = 0;
      for (i64 i = lo + t; i < hi; i += blockDim.x) {
        const X gi = g[i - off];
        if (mode == 0) out[i] = gi;
        if (!ob_finite(mode == 0 ? gi : ob_momentum(m[i], gi, b1, c1b1, gamma[T]))) bad = 1;
      }
      if (bad) slamb_atomic_or(word, 1u);
    }
  }
  const bool last = ob_last(word + 1);
  SLAMB_FOR_THREADS(t) {
    if (t == 0 && last) {
      word[2] = slamb_atomic_or(word, 0u) ? 1u : 0u;
      word[0] = word[1] = 0;
    }
  }
}

/* the block's per-thread values sh[k][t] reduced into out[k], k < 3: sums, or for k = 0 with max0 a maximum */
SLAMB_DEV void ob_partials(double (*sh)[256], int max0, double* out) {
  SLAMB_SYNC();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    SLAMB_FOR_THREADS(t) {
      if (t < s) {
        sh[0][t] = max0 ? ob_max(sh[0][t], sh[0][t + s]) : sh[0][t] + sh[0][t + s];
        sh[1][t] += sh[1][t + s];
        sh[2][t] += sh[2][t + s];
      }
    }
    SLAMB_SYNC();
  }
  SLAMB_FOR_THREADS(t) { if (t == 0) for (int k = 0; k < 3; ++k) out[k] = sh[k][0]; }
  SLAMB_SYNC();
}

/* ---- the warm-up's moments on the mean gradient, f = v at the freeze step, ||x||^2 and ||u||^2 per tile ---- */
template <typename X>
SLAMB_DEV void ob_warm_impl(const int* tile_tensor, const i64* tile_lo, const i64* tile_hi, i64 ntiles, const u64* tab,
    const X* flat, int fused, const i64* toff, const X* gbar, X* m, X* v, X* f, int copy_f, double b1, double c1b1,
    double b2, double c1b2, double c1, double c2, double eps, double wd, double* partials) {
  SLAMB_SHARED double sh[3][256];
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], hi = tile_hi[tile], off = toff[T];
    const X* x = ob_base(tab, flat, toff, fused, T);
    SLAMB_FOR_THREADS(t) {
      double xx = 0.0, uu = 0.0;
      for (i64 i = lo + t; i < hi; i += blockDim.x) {
        const X xi = x[i - off], gi = gbar[i];
        X mi = m[i] * (X)b1;
        mi = mi + (X)c1b1 * gi;
        X vi = v[i] * (X)b2;
        vi = vi + (X)c1b2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        if (copy_f) f[i] = vi;
        const X u = ob_direction(mi, vi, xi, c1, c2, eps, wd);
        xx += (double)xi * (double)xi;
        uu += (double)u * (double)u;
      }
      sh[0][t] = xx; sh[1][t] = uu; sh[2][t] = 0.0;
    }
    ob_partials(sh, 0, partials + 3 * tile);
  }
}

/* ---- the compression stage's moments: M (exchanged, or computed at P = 1), m, f, per tile the largest
   (sqrt(v) + eps) / (sqrt(f) + eps) and ||u0||^2, ||u||^2; then the error buffers' commit ---- */
template <typename X, typename V>
SLAMB_DEV void ob_comp_impl(const int* tile_tensor, const i64* tile_lo, const i64* tile_hi, i64 ntiles, const u64* xtab,
    const X* xflat, int xfused, const u64* gtab, const X* gflat, int gfused, const i64* toff, X* m, const X* v, X* f,
    const double* gamma, int exchanged, const u8* recv2, i64 B, i64 nc, double b1, double c1b1, double b2,
    double c1b2, double c1, double cv, double cf, double eps, double wd, double* partials, const X* c, X* e, i64 Np,
    const u8* send, const X* u, X* es, const u8* send2) {
  SLAMB_SHARED double sh[3][256];
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], hi = tile_hi[tile], off = toff[T];
    const X* x = ob_base(xtab, xflat, toff, xfused, T);
    const X* g = ob_base(gtab, gflat, toff, gfused, T);
    const double gam = gamma[T];
    SLAMB_FOR_THREADS(t) {
      double mx = -1.0, s0 = 0.0, s1 = 0.0; /* every ratio is >= 0 or NaN, and every tile has one */
      for (i64 i = lo + t; i < hi; i += blockDim.x) {
        const X mo = m[i];
        const X M = exchanged ? ob_decoded<X, V>(recv2, B, nc, i) : ob_momentum(mo, g[i - off], b1, c1b1, gam);
        const X mn = M / (X)gam;
        X gh = mn - (X)b1 * mo;
        gh = gh / (X)c1b1;
        X fi = f[i] * (X)b2;
        fi = fi + (X)c1b2 * (gh * gh);
        m[i] = mn;
        f[i] = fi;
        const X d = slamb_sqrt(cv != 1.0 ? v[i] / (X)cv : v[i]) + (X)eps;
        const X df = slamb_sqrt(cf != 1.0 ? fi / (X)cf : fi) + (X)eps;
        mx = ob_max(mx, (double)(d / df));
        if (wd > 0.0) {
          const X u0 = (c1 != 1.0 ? mn / (X)c1 : mn) / d;
          const X uw = u0 + (X)wd * x[i - off];
          s0 += (double)u0 * (double)u0;
          s1 += (double)uw * (double)uw;
        }
      }
      sh[0][t] = mx; sh[1][t] = s0; sh[2][t] = s1;
    }
    ob_partials(sh, 1, partials + 3 * tile);
  }
  ob_commit<X, V>(c, e, Np, send, u, es, nc, send2);
}

/* ---- per tensor (stat: rows kappa, phi, coefficient, gamma, rate): the warm-up's LAMB coefficient and kappa, or the
   compression stage's factor phi (docs/onebit_lamb.md sections 2.2 and 2.3), as the NumPy path, in
   float64 ---- */
SLAMB_DEV double ob_clamp(double v, double lo, double hi) {
  const double r = lo > v ? lo : v;
  return hi < r ? hi : r;
}
SLAMB_KERNEL ob_coeffs(const double* __restrict__ partials, const i64* __restrict__ tt0, const i64* __restrict__ ntt,
    i64 ntensors, int compressed, int wd_on, double lr, double c_min, double c_max, double cbeta, double fmin,
    double fmax, double fth, double* __restrict__ stat) {
  SLAMB_SHARED double sh[3][256];
  SLAMB_SHARED double r[3];
  for (i64 k = blockIdx.x; k < ntensors; k += gridDim.x) {
    const i64 first = tt0[k], count = ntt[k];
    SLAMB_FOR_THREADS(t) {
      double a[3] = {compressed ? -1.0 : 0.0, 0.0, 0.0};
      for (i64 q = t; q < count; q += blockDim.x) {
        const double* p = partials + 3 * (first + q);
        a[0] = compressed ? ob_max(a[0], p[0]) : a[0] + p[0];
        a[1] += p[1];
        a[2] += p[2];
      }
      for (int c = 0; c < 3; ++c) sh[c][t] = a[c];
    }
    ob_partials(sh, compressed, r);
    SLAMB_FOR_THREADS(t) {
      if (t == 0 && count > 0) {
        double* kappa = stat + k;
        double* phi = stat + ntensors + k;
        double coeff;
        if (!compressed) {
          const double xn = slamb_sqrt(r[0]), un = slamb_sqrt(r[1]);
          coeff = slamb_trust_ratio(xn, un, c_min, c_max);
          if (coeff != 1.0) *kappa = cbeta * *kappa + (1.0 - cbeta) * coeff;
        } else {
          double factor = r[0];
          if (wd_on) {
            const double u0n = slamb_sqrt(r[1]), un = slamb_sqrt(r[2]), q = u0n / un;
            const double w = un > 0.0 ? (q < 1.0 ? q : 1.0) : 1.0;
            factor = factor * w + (1.0 - w);
          }
          factor = ob_clamp(factor, fmin, fmax);
          factor = ob_clamp(factor, *phi * (1.0 - fth), *phi * (1.0 + fth));
          *phi = factor;
          coeff = *kappa * factor;
        }
        stat[2 * ntensors + k] = coeff;
        stat[4 * ntensors + k] = lr * coeff;
      }
      if (t == 0 && count == 0 && !compressed) stat[2 * ntensors + k] = 1.0;
    }
    SLAMB_SYNC();
  }
}

/* ---- x -= rate u, the direction recomputed as in the moments pass (the same bits) ---- */
template <typename X>
SLAMB_DEV void ob_update_impl(const int* tile_tensor, const i64* tile_lo, const i64* tile_hi, i64 ntiles,
    const u64* tab, X* flat, int fused, const i64* toff, const X* m, const X* v, double c1, double cv, double eps,
    double wd, const double* rate) {
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], hi = tile_hi[tile], off = toff[T];
    X* x = ob_base(tab, flat, toff, fused, T);
    const X r = (X)rate[T];
    SLAMB_FOR_THREADS(t) {
      for (i64 i = lo + t; i < hi; i += blockDim.x) {
        const X xi = x[i - off];
        x[i - off] = xi - r * ob_direction(m[i], v[i], xi, c1, cv, eps, wd);
      }
    }
  }
}

/* ---- the momentum scaling factors: rho = ||m|| / sqrt(n) per tensor, gamma = mean rho / rho (2.3 step 1) ---- */
template <typename X>
SLAMB_DEV void ob_gamma_impl(const int* tile_tensor, const i64* tile_lo, const i64* tile_hi, i64 ntiles, const X* m,
    const i64* tt0, const i64* ntt, i64 ntensors, double* partials, double* stat, unsigned* word) {
  SLAMB_SHARED double sh[3][256];
  SLAMB_SHARED double rbar;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    SLAMB_FOR_THREADS(t) {
      double a = 0.0;
      for (i64 i = tile_lo[tile] + t; i < tile_hi[tile]; i += blockDim.x) a += (double)m[i] * (double)m[i];
      sh[0][t] = a;
      sh[1][t] = sh[2][t] = 0.0;
    }
    ob_partials(sh, 0, partials + 3 * tile);
  }
  if (!ob_last(word + 4)) return;
  double* rho = stat + 3 * ntensors;
  SLAMB_FOR_THREADS(t) {
    for (i64 k = t; k < ntensors; k += blockDim.x) {
      double s = 0.0;
      for (i64 q = 0; q < ntt[k]; ++q) s += ((volatile double*)partials)[3 * (tt0[k] + q)];
      const i64 n = ntt[k] ? tile_hi[tt0[k] + ntt[k] - 1] - tile_lo[tt0[k]] : 0;
      rho[k] = n ? slamb_sqrt(s) / slamb_sqrt((double)n) : 0.0;
    }
  }
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0) {
      double sum = 0.0;
      i64 count = 0;
      for (i64 k = 0; k < ntensors; ++k) {
        if (ntt[k]) { sum += rho[k]; ++count; }
      }
      rbar = count ? sum / (double)count : 0.0;
      word[4] = 0;
    }
  }
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    for (i64 k = t; k < ntensors; k += blockDim.x) rho[k] = (rho[k] > 0.0 && rbar > 0.0) ? rbar / rho[k] : 1.0;
  }
}

/* ---- both phases' status words into out[0 .. 2P) (the one host read) ---- */
SLAMB_KERNEL ob_collect(const u8* __restrict__ recv, const u8* __restrict__ recv2, i64 B, int P,
                        int* __restrict__ out) {
  SLAMB_FOR_THREADS(t) {
    for (int j = t; j < P; j += blockDim.x) {
      out[j] = *(const int*)(recv + j * B);
      out[P + j] = *(const int*)(recv2 + j * B);
    }
  }
}

/* ---- the instances: tensors h2/f4/f8 (X), accumulation f4/f8 (A = promote(X, float32)), scales h2/f4/f8 (V) ---- */
#define OB_TILES const int* a0, const i64* a1, const i64* a2, i64 a3
#define OB_PER_XV(X, A, V, N) \
  SLAMB_KERNEL ob_encode_x_##N(const u64* tab, const X* flat, int fused, const i64* toff, int nt, i64 N_, const A* e, \
      int has_e, int problem, i64 n, int H, A* keep, u8* out, i64 cb, i64 B, int nblk, double sqrt_n, \
      double* partials, unsigned* word) { \
    const ObSrcX<X, A> src = {tab, flat, fused, toff, nt, N_, e, has_e, problem}; \
    ob_tree<A, V>(src, n, H, keep, out, cb, B, nblk, problem, sqrt_n, partials, word); } \
  SLAMB_KERNEL ob_decode_##N(OB_TILES, const u64* tab, X* flat, int fused, const i64* toff, const u8* recv2, i64 B, \
      i64 nc, const A* c, A* e, i64 Np, const u8* send, const A* u, A* es, const u8* send2) { \
    ob_decode_impl<X, A, V>(a0, a1, a2, a3, tab, flat, fused, toff, recv2, B, nc, c, e, Np, send, u, es, send2); }
#define OB_PER_AV(A, V, N) \
  SLAMB_KERNEL ob_server_##N(const u8* recv, i64 B, int P, double inv_p, const A* es, int has_es, i64 n, int H, \
      A* keep, u8* out, double sqrt_n, double* partials, unsigned* word) { \
    const ObSrcS<A, V> src = {recv, B, P, inv_p, es, has_es}; \
    ob_tree<A, V>(src, n, H, keep, out, n / 8, B, 1, 0, sqrt_n, partials, word); }
#define OB_PER_PV(X, V, N) \
  SLAMB_KERNEL ob_encode_m_##N(const u64* tab, const X* flat, int fused, const i64* toff, int nt, i64 N_, const X* m, \
      const double* gamma, double b1, double c1b1, const X* e, int has_e, i64 n, int H, X* keep, u8* out, i64 cb, \
      i64 B, int nblk, double sqrt_n, double* partials, unsigned* word) { \
    const ObSrcM<X> src = {tab, flat, fused, toff, nt, N_, m, gamma, b1, c1b1, e, has_e}; \
    ob_tree<X, V>(src, n, H, keep, out, cb, B, nblk, 0, sqrt_n, partials, word); } \
  SLAMB_KERNEL ob_comp_##N(OB_TILES, const u64* xtab, const X* xflat, int xfused, const u64* gtab, const X* gflat, \
      int gfused, const i64* toff, X* m, const X* v, X* f, const double* gamma, int exchanged, const u8* recv2, i64 B, \
      i64 nc, double b1, double c1b1, double b2, double c1b2, double c1, double cv, double cf, double eps, double wd, \
      double* partials, const X* c, X* e, i64 Np, const u8* send, const X* u, X* es, const u8* send2) { \
    ob_comp_impl<X, V>(a0, a1, a2, a3, xtab, xflat, xfused, gtab, gflat, gfused, toff, m, v, f, gamma, exchanged, \
        recv2, B, nc, b1, c1b1, b2, c1b2, c1, cv, cf, eps, wd, partials, c, e, Np, send, u, es, send2); }
#define OB_PER_P(X, N) \
  SLAMB_KERNEL ob_scan_##N(OB_TILES, const u64* tab, const X* flat, int fused, const i64* toff, const X* m, \
      const double* gamma, double b1, double c1b1, X* out, int mode, unsigned* word) { \
    ob_scan_impl<X>(a0, a1, a2, a3, tab, flat, fused, toff, m, gamma, b1, c1b1, out, mode, word); } \
  SLAMB_KERNEL ob_warm_##N(OB_TILES, const u64* tab, const X* flat, int fused, const i64* toff, const X* gbar, X* m, \
      X* v, X* f, int copy_f, double b1, double c1b1, double b2, double c1b2, double c1, double c2, double eps, \
      double wd, double* partials) { \
    ob_warm_impl<X>(a0, a1, a2, a3, tab, flat, fused, toff, gbar, m, v, f, copy_f, b1, c1b1, b2, c1b2, c1, c2, eps, \
        wd, partials); } \
  SLAMB_KERNEL ob_update_##N(OB_TILES, const u64* tab, X* flat, int fused, const i64* toff, const X* m, const X* v, \
      double c1, double cv, double eps, double wd, const double* rate) { \
    ob_update_impl<X>(a0, a1, a2, a3, tab, flat, fused, toff, m, v, c1, cv, eps, wd, rate); } \
  SLAMB_KERNEL ob_gamma_##N(OB_TILES, const X* m, const i64* tt0, const i64* ntt, i64 nt, double* partials, \
      double* stat, unsigned* word) { \
    ob_gamma_impl<X>(a0, a1, a2, a3, m, tt0, ntt, nt, partials, stat, word); }
"""

_C_TYPES = {"h2": "unsigned short", "f4": "float", "f8": "double"}
_ACC = {"h2": "f4", "f4": "f4", "f8": "f8"}  # promote(X, float32)
_XS, _PS = ("h2", "f4", "f8"), ("f4", "f8")
_INSTANCES = [*(f"OB_PER_XV({_C_TYPES[x]}, {_C_TYPES[_ACC[x]]}, {_C_TYPES[v]}, {x}{v})" for x in _XS for v in _XS),
              *(f"OB_PER_AV({_C_TYPES[a]}, {_C_TYPES[v]}, {a}{v})" for a in _PS for v in _XS),
              *(f"OB_PER_PV({_C_TYPES[p]}, {_C_TYPES[v]}, {p}{v})" for p in _PS for v in _XS),
              *(f"OB_PER_P({_C_TYPES[p]}, {p})" for p in _PS)]
SOURCE = _k.PRELUDE + _KERNELS + "\n".join(_INSTANCES) + "\n"
#: every kernel of SOURCE (the NVRTC check compiles them all)
KERNELS = ("ob_coeffs", "ob_collect", *(f"ob_{k}_{x}{v}" for k in ("encode_x", "decode") for x in _XS for v in _XS),
           *(f"ob_{k}_{p}{v}" for k in ("server", "encode_m", "comp") for p in _PS for v in _XS),
           *(f"ob_{k}_{p}" for k in ("scan", "warm", "update", "gamma") for p in _PS))
_CODES = {"float16": "h2", "float32": "f4", "float64": "f8"}


def name(kind, *dtypes):
    """The instance of kernel ``kind`` ('encode_x', 'comp', ...) for these dtypes (tensors first, then scales)."""
    return f"ob_{kind}_" + "".join(_CODES[np.dtype(d).name] for d in dtypes)


def launch(xp, kernel, grid, args, reads, writes):
    """One launch of ``kernel`` (at most :data:`slamb_comm.device.tables.GRID` blocks; ``reads``/``writes`` as in
    :func:`slamb_comm.device.kernels.launch`)."""
    _k.launch(xp, kernel, min(max(1, int(grid)), _dev.GRID), args, reads, writes, source=SOURCE)
