"""The device kernels of SLAMB's step: one CUDA C source that also compiles for the host.

:mod:`slamb_comm.device.slamb_step` runs SLAMB's step (docs/algorithm.md section 1) as these kernels
over a table of tiles, in the manner of apex's FusedLAMB and torch's ``multi_tensor_apply``:
``slamb_pack`` (the gradient read once, its finiteness into the status word, this rank's new momentum
on M_t into the payload, per group of tensors); ``slamb_verdict`` (the summed payload's finiteness, on
the device); ``slamb_moments`` (m and v committed, M_t's means put into m, w formed, each tile's four
squared norms); ``slamb_trust`` (per tensor the norms in tile order, the trust ratios, the rates;
with ``sums_only`` a sharded piece's sums); ``slamb_update`` (w again, each element's freshness from
the cyclic mask's formula, x updated; ``slamb_update_levels`` in the first cycle after a ratio change).
A skipped step's kernels change nothing. Per tile, a group of C units is hashed once; nothing of the
model's size besides m and v is kept, and parameters and gradients are read through tables of device
addresses, so a fused buffer, a list of arrays and a framework's own tensors are read where they are.

**One source, two compilers.** The kernels are written in a small dialect (the ``SLAMB_*``
macros of :data:`PRELUDE`): on a GPU NVRTC compiles them (``cupy.RawModule``); without one, the
tests' strict CuPy double compiles the *same text* with the host's C++ compiler, where a block's
threads run one after another in each ``SLAMB_FOR_THREADS`` phase and ``SLAMB_SYNC`` separates
phases. So CI executes every line of the kernels' arithmetic. The rules of the dialect: per-thread
values that must outlive a phase live in ``SLAMB_SHARED`` arrays indexed by the thread; every
``SLAMB_SYNC`` is reached by the whole block; blocks talk only through atomics on global words.
Floating-point contraction is off on both sides (``--fmad=false``, ``-ffp-contract=off``) and
division and square roots are IEEE on both, so the host and the device compute the same bits.
"""

import numpy as np

__all__ = ["SOURCE", "PRELUDE", "OPTIONS", "THREADS", "TILE", "kernel_name", "module", "launch"]

#: threads per block; a tile is ``TILE`` consecutive elements of one tensor
THREADS = 256
TILE = 16 * THREADS
#: NVRTC options: IEEE arithmetic, as the host build of the tests computes it
OPTIONS = ("--std=c++14", "--fmad=false")

PRELUDE = (f"#define SLAMB_THREADS {THREADS} /* threads per block: the size of every shared array */\n"
           f"#define SLAMB_TILE {TILE} /* elements per tile: the kernels' unit of work */\n") + r"""
#if defined(__CUDACC__)
/* ---- the device: NVRTC ---- */
#define SLAMB_KERNEL extern "C" __global__ void __launch_bounds__(SLAMB_THREADS)
#define SLAMB_DEV static __device__ __forceinline__
#define SLAMB_SHARED __shared__
#define SLAMB_FOR_THREADS(t) for (unsigned t = threadIdx.x, slamb_once_ = 1; slamb_once_; slamb_once_ = 0)
#define SLAMB_SYNC() __syncthreads()
#define SLAMB_FENCE() __threadfence()
#define SLAMB_UNROLL _Pragma("unroll")
SLAMB_DEV unsigned slamb_atomic_or(unsigned* p, unsigned v) { return atomicOr(p, v); }
SLAMB_DEV unsigned slamb_atomic_inc(unsigned* p) { return atomicAdd(p, 1u); }
SLAMB_DEV unsigned short slamb_f2h(float x) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h; }
SLAMB_DEV unsigned short slamb_d2h(double x) { unsigned short h; asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(x)); return h; }
SLAMB_DEV float slamb_h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
SLAMB_DEV float slamb_sqrt(float x) { return sqrtf(x); }
SLAMB_DEV double slamb_sqrt(double x) { return sqrt(x); }
#define SLAMB_NAN __longlong_as_double(0x7ff8000000000000LL)
#else
/* ---- the host: the same text through a C++ compiler (the tests' double) ---- */
#include <math.h>
#include <string.h>
struct slamb_dim3 { unsigned x, y, z; };
extern "C" { slamb_dim3 blockIdx = {0, 0, 0}, blockDim = {SLAMB_THREADS, 1, 1}, gridDim = {1, 1, 1}; }
#define SLAMB_KERNEL extern "C" void
#define SLAMB_DEV static inline
#define SLAMB_SHARED static
#define SLAMB_FOR_THREADS(t) for (unsigned t = 0; t < blockDim.x; ++t)
#define SLAMB_SYNC()
#define SLAMB_FENCE()
#define SLAMB_UNROLL
#define __restrict__
SLAMB_DEV unsigned slamb_atomic_or(unsigned* p, unsigned v) { unsigned o = *p; *p = o | v; return o; }
SLAMB_DEV unsigned slamb_atomic_inc(unsigned* p) { return (*p)++; }
SLAMB_DEV unsigned short slamb_f2h(float x) { _Float16 h = (_Float16)x; unsigned short b; memcpy(&b, &h, 2); return b; }
SLAMB_DEV unsigned short slamb_d2h(double x) { _Float16 h = (_Float16)x; unsigned short b; memcpy(&b, &h, 2); return b; }
SLAMB_DEV float slamb_h2f(unsigned short b) { _Float16 h; memcpy(&h, &b, 2); return (float)h; }
SLAMB_DEV float slamb_sqrt(float x) { return sqrtf(x); }
SLAMB_DEV double slamb_sqrt(double x) { return sqrt(x); }
#define SLAMB_NAN ((double)NAN)
#endif

/* a trust ratio: clamp(||x|| / ||u||, c_min, c_max), 1 where either norm is 0 (SLAMB and 1-bit LAMB;
   slamb_comm.methods.tensorwise.trust_ratio on the host) */
SLAMB_DEV double slamb_trust_ratio(double xn, double un, double c_min, double c_max) {
  if (xn > 0.0 && un > 0.0) {
    const double r = xn / un;
    return r < c_min ? c_min : (r > c_max ? c_max : r);
  }
  return 1.0;
}
"""

_KERNELS = r"""
typedef unsigned long long u64;
typedef long long i64;
#define SLAMB_G1 0x9E3779B97F4A7C15ULL
/* a tensor's unit shift when it is always dense (a compressible piece of a sharded tensor may have a
   negative shift: its units start past its offset) */
#define SLAMB_DENSE_SHIFT (-0x7fffffffffffffffLL - 1)
/* the flags the kernels of one step share (DeviceStep's word, SLAMB_WORDS of them) */
#define SLAMB_W_BAD 0   /* pack: some gradient element of this rank is bad (cleared by the last block) */
#define SLAMB_W_DONE 1  /* pack: blocks finished (cleared by the last block) */
#define SLAMB_W_XBAD 2  /* update: a new parameter is not finite (the periodic sync's check) */
#define SLAMB_W_SKIP 3  /* verdict: the summed payload is not finite, the step changes nothing */
#define SLAMB_WORDS 4
/* the most groups of C >= 2 units that one tile's units touch */
#define SLAMB_MAXG (SLAMB_TILE / 2 + 2)
/* elements a thread of the update loads before it computes (the moments' four loads suffice there) */
#define SLAMB_U 2

/* ---- payload values: float16 travels as its bits (unsigned short); finiteness of each ---- */
SLAMB_DEV void slamb_put(unsigned short* a, i64 i, float x) { a[i] = slamb_f2h(x); }
SLAMB_DEV void slamb_put(unsigned short* a, i64 i, double x) { a[i] = slamb_d2h(x); }
template <typename A, typename X> SLAMB_DEV void slamb_put(A* a, i64 i, X x) { a[i] = (A)x; }
SLAMB_DEV float slamb_get(const unsigned short* a, i64 i) { return slamb_h2f(a[i]); }
SLAMB_DEV float slamb_get(const float* a, i64 i) { return a[i]; }
SLAMB_DEV double slamb_get(const double* a, i64 i) { return a[i]; }
SLAMB_DEV bool slamb_finite(unsigned short h) { return (h & 0x7c00u) != 0x7c00u; }
SLAMB_DEV bool slamb_finite(float x) { return x - x == 0.0f; }
SLAMB_DEV bool slamb_finite(double x) { return x - x == 0.0; }

/* the dtype a mean is scaled in: the wider of the payload's and the parameters' (NumPy's promotion) */
template <typename P, typename V> struct SlambWide { typedef float T; };
template <typename V> struct SlambWide<double, V> { typedef double T; };
template <> struct SlambWide<float, double> { typedef double T; };

SLAMB_DEV float slamb_max(float) { return 3.402823466e38f; }
SLAMB_DEV double slamb_max(double) { return 1.7976931348623157e308; }

/* ---- the cyclic mask (docs/algorithm.md section 1, step 2) ---- */
SLAMB_DEV u64 slamb_mix(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/* h(g): the rotation of group g, ((mix(key + g + G1) >> 32) C) >> 32 */
SLAMB_DEV unsigned slamb_rot(u64 g, u64 key, unsigned C) {
  return (unsigned)(((slamb_mix(key + g + SLAMB_G1) >> 32) * (u64)C) >> 32);
}

/* The groups of C units that n consecutive units from unit q0 touch: the first g0, the offset w0 of
   unit q0 in it, and their number ng. Once per tile: everything per element below is 32-bit. */
struct SlambSpan { u64 g0; unsigned w0, ng; };
SLAMB_DEV SlambSpan slamb_span(u64 q0, unsigned C, unsigned n) {
  SlambSpan s;
  s.g0 = (q0 >> 32) == 0 ? (u64)((unsigned)q0 / C) : q0 / C;
  s.w0 = (unsigned)(q0 - s.g0 * C);
  s.ng = (s.w0 + n + C - 1) / C;
  return s;
}

/* Every group's rotation of a tile's span, into shared memory (one hash per group, not per element). */
SLAMB_DEV void slamb_fill_rot(unsigned* rot, SlambSpan sp, u64 key, unsigned C) {
  SLAMB_FOR_THREADS(t) {
    for (unsigned k = t; k < sp.ng; k += SLAMB_THREADS) rot[k] = slamb_rot(sp.g0 + k, key, C);
  }
  SLAMB_SYNC();
}

/* The chunk of the unit at position p of a tile's span (p = w0 + its index in the tile), and its group
   k in the span. M = ceil(2^32 / C) makes p / C one multiply where C (C + TILE) < 2^32, else 0. */
SLAMB_DEV unsigned slamb_chunk_at(unsigned p, unsigned C, unsigned M, const unsigned* rot, unsigned* k) {
  const unsigned q = M ? (unsigned)(((u64)p * M) >> 32) : p / C;
  const unsigned c = p - q * C + rot[q];
  *k = q;
  return c >= C ? c - C : c;
}

/* The chunk of unit q among C chunks (64-bit: the older masks of a ratio schedule, element by element) */
SLAMB_DEV u64 slamb_chunk(u64 q, u64 C, u64 key) {
  const u64 g = q / C;
  u64 c = (q - g * C) + ((slamb_mix(key + g + SLAMB_G1) >> 32) * C >> 32);
  return c >= C ? c - C : c;
}

/* The freshness, at the change to the current mask, of a unit that mask has not reached yet: the
   masks before it (lv: C and steps run, for L - 1 earlier masks, newest first), down to the start,
   where the freshness was 1. pw[n] = beta3^n. */
SLAMB_DEV double slamb_fresh_before(u64 q, u64 key, int L, const i64* lv, const double* pw) {
  double mult = 1.0;
  for (int l = 1; l < L; ++l) {
    const i64 C = lv[2 * (l - 1)], s = lv[2 * (l - 1) + 1];
    if (s <= 0) continue;
    const i64 c = (i64)slamb_chunk(q, (u64)C, key);
    const i64 j = (s - 1) % C;
    if (c <= j) return mult * pw[j - c];
    if (s > C) return mult * pw[j - c + C];
    mult *= pw[s];
  }
  return mult;
}

/* ---- kernel 1: the gradient's check and this rank's payload ---- */
template <typename P, typename V>
SLAMB_DEV void slamb_pack_impl(
    const int* __restrict__ tile_tensor, const i64* __restrict__ tile_lo, const i64* __restrict__ tile_hi,
    i64 tile0, i64 tile1, const u64* __restrict__ gptr, const i64* __restrict__ toff,
    const i64* __restrict__ tshift, const i64* __restrict__ pbase, const P* __restrict__ m,
    V* __restrict__ payload, i64 status, double present, double b1, double c1, u64 key, unsigned C, unsigned j,
    unsigned* __restrict__ tbad, unsigned stamp, unsigned* __restrict__ word) {
  SLAMB_SHARED int slamb_last;
  const P pb1 = (P)b1, pc1 = (P)c1, big = slamb_max((P)0);
  for (i64 tile = tile0 + blockIdx.x; tile < tile1; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], off = toff[T], shift = tshift[T];
    const unsigned n = (unsigned)(tile_hi[tile] - lo);
    const P* g = (const P*)gptr[T] + (lo - off);
    const P* mt = m + lo;
    const bool dense = shift == SLAMB_DENSE_SHIFT;
    SlambSpan sp = {0, 0, 0};
    if (!dense) sp = slamb_span((u64)(lo - shift), C, n);
    const i64 pat = pbase[T] + (dense ? lo - off : (i64)sp.g0);  /* payload index of element 0 / of group 0 */
    SLAMB_FOR_THREADS(t) {
      unsigned bad = 0;
      SLAMB_UNROLL
      for (unsigned r = t; r < n; r += SLAMB_THREADS) {
        const P gi = g[r];
        const P sq = gi * gi;
        if (!(sq <= big)) bad = 1; /* NaN, Inf, or a square that overflows v */
        if (dense) {
          const P a = mt[r] * pb1;
          const P b = gi * pc1;
          slamb_put(payload, pat + r, (P)(a + b));
        }
      }
      /* a compressible tensor: per group, its unit in chunk j, if that unit is in this tile */
      for (unsigned k = t; k < sp.ng; k += SLAMB_THREADS) {
        const unsigned h = slamb_rot(sp.g0 + k, key, C);
        const i64 r = (i64)k * C + (j >= h ? j - h : j + C - h) - sp.w0;
        if (r >= 0 && r < (i64)n) {
          const P a = mt[r] * pb1;
          const P b = g[r] * pc1;
          slamb_put(payload, pat + k, (P)(a + b));
        }
      }
      if (bad) {
        slamb_atomic_or(word + SLAMB_W_BAD, 1u);
        tbad[T] = stamp; /* the tensors of this step with a bad element: named on the failure path */
      }
    }
  }
  /* the last block to finish writes the status word, then clears the flags for the next launch */
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0) {
      SLAMB_FENCE();
      slamb_last = slamb_atomic_inc(word + SLAMB_W_DONE) == gridDim.x - 1;
    }
  }
  SLAMB_SYNC();
  SLAMB_FOR_THREADS(t) {
    if (t == 0 && slamb_last) {
      const unsigned flagged = slamb_atomic_or(word + SLAMB_W_BAD, 0u);
      slamb_put(payload, status, flagged ? SLAMB_NAN : present);
      word[SLAMB_W_BAD] = 0;
      word[SLAMB_W_DONE] = 0;
      word[SLAMB_W_SKIP] = 0; /* the verdict of this step's sums is still to come */
    }
  }
}

/* ---- the verdict: whether the summed payload (status words included) is finite, on the device ---- */
template <typename V>
SLAMB_DEV void slamb_verdict_impl(const V* __restrict__ payload, i64 n, unsigned* __restrict__ word) {
  SLAMB_FOR_THREADS(t) {
    unsigned bad = 0;
    for (i64 i = (i64)blockIdx.x * SLAMB_THREADS + t; i < n; i += (i64)gridDim.x * SLAMB_THREADS) {
      if (!slamb_finite(payload[i])) bad = 1;
    }
    if (bad) slamb_atomic_or(word + SLAMB_W_SKIP, 1u);
  }
}

/* per-thread sums of squares: float32 over a thread's run of a tile (16 elements), float64 above */
template <typename P> struct SlambAcc { typedef float T; };
template <> struct SlambAcc<double> { typedef double T; };

/* ---- kernel 2: the moments, M_t's means, and the per-tile partial norms ---- */
template <typename P, typename V>
SLAMB_DEV void slamb_moments_impl(
    const int* __restrict__ tile_tensor, const i64* __restrict__ tile_lo, const i64* __restrict__ tile_hi,
    i64 ntiles, const u64* __restrict__ xptr, const u64* __restrict__ gptr, const i64* __restrict__ toff,
    const i64* __restrict__ tshift, const i64* __restrict__ pbase, P* __restrict__ m, P* __restrict__ v,
    const V* __restrict__ payload, double scale, double b1, double c1b1, double b2, double c1b2,
    double eps_t, double wd, const double* __restrict__ wd_table, int wd_each, double s_u, u64 key, unsigned C,
    unsigned j, unsigned M, double* __restrict__ partials, const unsigned* __restrict__ word) {
  typedef typename SlambWide<P, V>::T W;
  typedef typename SlambAcc<P>::T A;
  SLAMB_SHARED double sh[4][SLAMB_THREADS];
  SLAMB_SHARED unsigned rot[SLAMB_MAXG];
  if (word[SLAMB_W_SKIP]) return; /* a skipped step: nothing changes */
  const P pb1 = (P)b1, pc1 = (P)c1b1, pb2 = (P)b2, pc2 = (P)c1b2, ceps = (P)eps_t;
  const W wscale = (W)scale;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], off = toff[T], shift = tshift[T];
    const unsigned n = (unsigned)(tile_hi[tile] - lo);
    const P* x = (const P*)xptr[T] + (lo - off);
    const P* g = (const P*)gptr[T] + (lo - off);
    P* mt = m + lo;
    P* vt = v + lo;
    const double wdv = wd_each ? wd_table[T] : wd;
    const P cwd = (P)(wdv / s_u);
    const bool dense = shift == SLAMB_DENSE_SHIFT;
    SlambSpan sp = {0, 0, 0};
    if (!dense) {
      sp = slamb_span((u64)(lo - shift), C, n);
      slamb_fill_rot(rot, sp, key, C);
    }
    const i64 pat = pbase[T] + (dense ? lo - off : (i64)sp.g0);
    SLAMB_FOR_THREADS(t) {
      A xx = 0, ww = 0, xs = 0, ws = 0;
      for (unsigned r = t; r < n; r += SLAMB_THREADS) {
        const P xi = x[r], gi = g[r];
        const P ma = mt[r] * pb1, mb = gi * pc1;
        P mi = ma + mb;
        const P va = vt[r] * pb2, vb = (gi * gi) * pc2;
        const P vi = va + vb;
        bool sel = true;
        i64 at = pat + r;
        if (!dense) {
          unsigned k;
          sel = slamb_chunk_at(sp.w0 + r, C, M, rot, &k) == j;
          at = pat + k;
        }
        if (sel) mi = (P)((W)slamb_get(payload, at) * wscale); /* exact where scale is 1 */
        mt[r] = mi;
        vt[r] = vi;
        P w = mi / (slamb_sqrt(vi) + ceps);
        if (wdv != 0.0) w = w + xi * cwd;
        const A dx = (A)xi, dw = (A)w;
        const A x2 = dx * dx, w2 = dw * dw;
        xx += x2;
        ww += w2;
        if (sel) {
          xs += x2;
          ws += w2;
        }
      }
      sh[0][t] = (double)xx;
      sh[1][t] = (double)ww;
      sh[2][t] = (double)xs;
      sh[3][t] = (double)ws;
    }
    SLAMB_SYNC();
    for (unsigned s = SLAMB_THREADS / 2; s > 0; s >>= 1) {
      SLAMB_FOR_THREADS(t) {
        if (t < s) {
          for (int k = 0; k < 4; ++k) sh[k][t] += sh[k][t + s];
        }
      }
      SLAMB_SYNC();
    }
    SLAMB_FOR_THREADS(t) {
      if (t < 4) partials[4 * tile + t] = sh[t][0];
    }
    SLAMB_SYNC();
  }
}

/* ---- kernel 3: per tensor, the norms from its tiles' partials, the trust ratios, the rates ---- */

SLAMB_KERNEL slamb_trust(
    const double* __restrict__ partials, const i64* __restrict__ tt0, const i64* __restrict__ ntt, i64 ntensors,
    double s_u, double lr, const double* __restrict__ lr_table, int lr_each, double sqrt_p, double c_min,
    double c_max, double* __restrict__ rates, unsigned* __restrict__ word, int sums_only, double* __restrict__ sums) {
  SLAMB_SHARED double sh[4][SLAMB_THREADS];
  if (word[SLAMB_W_SKIP]) return; /* a skipped step: nothing changes */
  SLAMB_FOR_THREADS(t) {
    if (blockIdx.x == 0 && t == 0) word[SLAMB_W_XBAD] = 0; /* the update's finiteness flag, for this step */
  }
  for (i64 k = blockIdx.x; k < ntensors; k += gridDim.x) {
    const i64 first = tt0[k], count = ntt[k];
    SLAMB_FOR_THREADS(t) {
      double a[4] = {0.0, 0.0, 0.0, 0.0};
      for (i64 q = t; q < count; q += SLAMB_THREADS) {
        for (int c = 0; c < 4; ++c) a[c] += partials[4 * (first + q) + c];
      }
      for (int c = 0; c < 4; ++c) sh[c][t] = a[c];
    }
    SLAMB_SYNC();
    for (unsigned s = SLAMB_THREADS / 2; s > 0; s >>= 1) {
      SLAMB_FOR_THREADS(t) {
        if (t < s) {
          for (int c = 0; c < 4; ++c) sh[c][t] += sh[c][t + s];
        }
      }
      SLAMB_SYNC();
    }
    SLAMB_FOR_THREADS(t) {
      if (t == 0 && sums_only) { /* sharded tensors: the piece's sums, to be summed over the pieces first */
        for (int c = 0; c < 4; ++c) sums[4 * k + c] = sh[c][0];
      } else if (t == 0) {
        const double s2 = s_u * s_u;
        const double xx = sh[0][0], uu = sh[1][0] * s2, xs = sh[2][0], us = sh[3][0] * s2;
        const double xa = xx - xs > 0.0 ? xx - xs : 0.0, ua = uu - us > 0.0 ? uu - us : 0.0;
        const double phi_s = slamb_trust_ratio(sqrt(xs), sqrt(us), c_min, c_max);
        const double phi_a = slamb_trust_ratio(sqrt(xa), sqrt(ua), c_min, c_max);
        const double l = lr_each ? lr_table[k] : lr;
        rates[2 * k] = l * s_u * phi_s;
        rates[2 * k + 1] = l * s_u / sqrt_p * phi_a;
      }
    }
    SLAMB_SYNC();
  }
}

/* ---- kernel 4: x -= (rate_S f + rate_A (1 - f)) u, w recomputed, f derived ----
   The current mask has run s0 steps (jj = (s0 - 1) mod C0; full: s0 > C0): a unit of chunk c was
   synchronised jj - c steps ago if c <= jj, else jj - c + C0 (full), else never under this mask: then
   its freshness is beta3^s0 times what the masks before gave it (LEVELS; 1 at the start). */
template <typename P, bool LEVELS>
SLAMB_DEV void slamb_update_impl(
    const int* __restrict__ tile_tensor, const i64* __restrict__ tile_lo, const i64* __restrict__ tile_hi,
    i64 ntiles, const u64* __restrict__ xptr, const i64* __restrict__ toff, const i64* __restrict__ tshift,
    const P* __restrict__ m, const P* __restrict__ v, double eps_t, double wd, const double* __restrict__ wd_table,
    int wd_each, double s_u, const double* __restrict__ rates, u64 key, unsigned C0, unsigned jj, unsigned full,
    unsigned s0, unsigned M, int L, const i64* __restrict__ lv, const double* __restrict__ pw,
    unsigned* __restrict__ word) {
  SLAMB_SHARED unsigned rot[SLAMB_MAXG];
  if (word[SLAMB_W_SKIP]) return; /* a skipped step: nothing changes */
  const P ceps = (P)eps_t, big = slamb_max((P)0);
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 lo = tile_lo[tile], off = toff[T], shift = tshift[T];
    const unsigned n = (unsigned)(tile_hi[tile] - lo);
    P* x = (P*)xptr[T] + (lo - off);
    const P* mt = m + lo;
    const P* vt = v + lo;
    const double wdv = wd_each ? wd_table[T] : wd;
    const P cwd = (P)(wdv / s_u);
    const P rs = (P)rates[2 * T], ra = (P)rates[2 * T + 1];
    const bool dense = shift == SLAMB_DENSE_SHIFT;
    SlambSpan sp = {0, 0, 0};
    if (!dense) {
      sp = slamb_span((u64)(lo - shift), C0, n);
      slamb_fill_rot(rot, sp, key, C0);
    }
    SLAMB_FOR_THREADS(t) {
      unsigned bad = 0;
      for (unsigned r0 = t; r0 < n; r0 += SLAMB_U * SLAMB_THREADS) {
        P xv[SLAMB_U], mv[SLAMB_U], vv[SLAMB_U];
        SLAMB_UNROLL
        for (int u = 0; u < SLAMB_U; ++u) {
          const unsigned r = r0 + u * SLAMB_THREADS;
          if (r < n) {
            xv[u] = x[r];
            mv[u] = mt[r];
            vv[u] = vt[r];
          }
        }
        SLAMB_UNROLL
        for (int u = 0; u < SLAMB_U; ++u) {
          const unsigned r = r0 + u * SLAMB_THREADS;
          if (r < n) {
            const P xi = xv[u];
            P w = mv[u] / (slamb_sqrt(vv[u]) + ceps);
            if (wdv != 0.0) w = w + xi * cwd;
            P coef = rs;
            if (!dense) {
              unsigned k;
              const unsigned c = slamb_chunk_at(sp.w0 + r, C0, M, rot, &k);
              P pf = (P)pw[c <= jj ? jj - c : (full ? jj + C0 - c : s0)];
              if (LEVELS && c > jj && !full) pf = (P)(pw[s0] * slamb_fresh_before((u64)(lo - shift) + r, key, L, lv, pw));
              coef = rs * pf + ra * ((P)1 - pf);
            }
            const P nx = xi - coef * w;
            x[r] = nx;
            if (!((nx < 0 ? -nx : nx) <= big)) bad = 1; /* NaN or Inf: the periodic sync refuses it */
          }
        }
      }
      if (bad) slamb_atomic_or(word + SLAMB_W_XBAD, 1u);
    }
    if (!dense) SLAMB_SYNC(); /* rot is the next tile's */
  }
}

/* ---- a range of the fused order between the tensors (through their addresses) and a buffer ---- */
template <typename P>
SLAMB_DEV void slamb_copy_impl(
    const int* __restrict__ tile_tensor, const i64* __restrict__ tile_lo, const i64* __restrict__ tile_hi,
    i64 tile0, i64 tile1, const u64* __restrict__ xptr, const i64* __restrict__ toff, P* __restrict__ buf, i64 lo,
    i64 hi, double scale, int into_tensors) {
  const P s = (P)scale;
  for (i64 tile = tile0 + blockIdx.x; tile < tile1; tile += gridDim.x) {
    const int T = tile_tensor[tile];
    const i64 a = tile_lo[tile] > lo ? tile_lo[tile] : lo, b = tile_hi[tile] < hi ? tile_hi[tile] : hi;
    const i64 off = toff[T];
    P* x = (P*)xptr[T];
    SLAMB_FOR_THREADS(t) {
      for (i64 i = a + t; i < b; i += SLAMB_THREADS) {
        if (into_tensors) {
          const P v = buf[i - lo];
          x[i - off] = scale == 1.0 ? v : v * s;
        } else {
          const P v = x[i - off];
          buf[i - lo] = scale == 1.0 ? v : v * s;
        }
      }
    }
  }
}

/* ---- the instances: parameters float32/float64 (f4/f8), payload float16/32/64 (h2/f4/f8) ---- */
#define SLAMB_PACK(P, V, NAME) \
  SLAMB_KERNEL slamb_pack_##NAME(const int* a0, const i64* a1, const i64* a2, i64 a3, i64 a4, const u64* a5, \
      const i64* a6, const i64* a7, const i64* a8, const P* a9, V* a10, i64 a11, double a12, double a13, \
      double a14, u64 a15, unsigned a16, unsigned a17, unsigned* a18, unsigned a19, unsigned* a20) { \
    slamb_pack_impl<P, V>(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, \
                          a19, a20); }
#define SLAMB_MOMENTS(P, V, NAME) \
  SLAMB_KERNEL slamb_moments_##NAME(const int* a0, const i64* a1, const i64* a2, i64 a3, const u64* a4, \
      const u64* a5, const i64* a6, const i64* a7, const i64* a8, P* a9, P* a10, const V* a11, double a12, \
      double a13, double a14, double a15, double a16, double a17, double a18, const double* a19, int a20, \
      double a21, u64 a22, unsigned a23, unsigned a24, unsigned a25, double* a26, const unsigned* a27) { \
    slamb_moments_impl<P, V>(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, \
                             a18, a19, a20, a21, a22, a23, a24, a25, a26, a27); }
#define SLAMB_UPDATE(P, LEVELS, NAME) \
  SLAMB_KERNEL NAME(const int* a0, const i64* a1, const i64* a2, i64 a3, const u64* a4, \
      const i64* a5, const i64* a6, const P* a7, const P* a8, double a9, double a10, const double* a11, \
      int a12, double a13, const double* a14, u64 a15, unsigned a16, unsigned a17, unsigned a18, unsigned a19, \
      unsigned a20, int a21, const i64* a22, const double* a23, unsigned* a24) { \
    slamb_update_impl<P, LEVELS>(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, \
                                 a18, a19, a20, a21, a22, a23, a24); }
#define SLAMB_VERDICT(V, NAME) \
  SLAMB_KERNEL slamb_verdict_##NAME(const V* a0, i64 a1, unsigned* a2) { slamb_verdict_impl<V>(a0, a1, a2); }
SLAMB_PACK(float, unsigned short, f4h2)
SLAMB_PACK(float, float, f4f4)
SLAMB_PACK(float, double, f4f8)
SLAMB_PACK(double, unsigned short, f8h2)
SLAMB_PACK(double, float, f8f4)
SLAMB_PACK(double, double, f8f8)
SLAMB_MOMENTS(float, unsigned short, f4h2)
SLAMB_MOMENTS(float, float, f4f4)
SLAMB_MOMENTS(float, double, f4f8)
SLAMB_MOMENTS(double, unsigned short, f8h2)
SLAMB_MOMENTS(double, float, f8f4)
SLAMB_MOMENTS(double, double, f8f8)
SLAMB_UPDATE(float, false, slamb_update_f4)
SLAMB_UPDATE(double, false, slamb_update_f8)
SLAMB_UPDATE(float, true, slamb_update_levels_f4)
SLAMB_UPDATE(double, true, slamb_update_levels_f8)
SLAMB_VERDICT(unsigned short, h2)
SLAMB_VERDICT(float, f4)
SLAMB_VERDICT(double, f8)
#define SLAMB_COPY(P, NAME) \
  SLAMB_KERNEL slamb_copy_##NAME(const int* a0, const i64* a1, const i64* a2, i64 a3, i64 a4, const u64* a5, \
      const i64* a6, P* a7, i64 a8, i64 a9, double a10, int a11) { \
    slamb_copy_impl<P>(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11); }
SLAMB_COPY(float, f4)
SLAMB_COPY(double, f8)
"""

SOURCE = PRELUDE + _KERNELS

_CODES = {"float16": "h2", "float32": "f4", "float64": "f8"}


def kernel_name(kind, param_dtype, value_dtype=None):
    """The instance of ``kind`` ('pack', 'moments', 'update', 'update_levels', 'copy', 'trust', 'verdict')
    for these dtypes (the verdict's is the payload's alone: ``param_dtype`` None)."""
    if kind == "trust":
        return "slamb_trust"
    code = "" if param_dtype is None else _CODES[np.dtype(param_dtype).name]
    if value_dtype is not None:
        code += _CODES[np.dtype(value_dtype).name]
    return f"slamb_{kind}_{code}"


_MODULES = {}  # (library, device, source) -> the compiled module


def module(xp, source=SOURCE):
    """The compiled kernels of ``source`` (:data:`SOURCE`, or another module's kernels written in
    the same dialect after :data:`PRELUDE`) for the library ``xp`` (CuPy, or the tests' double) on
    the current device: compiled at the first use in a process (CuPy also caches it on disk), then
    kept."""
    key = (id(xp), xp.cuda.Device().id, id(source))
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = xp.RawModule(code=source, options=OPTIONS)
    return mod


def launch(xp, name, grid, args, reads, writes, source=SOURCE):
    """Launch kernel ``name`` of ``source`` with ``grid`` blocks of :data:`THREADS` on the current
    stream.

    ``reads``/``writes``: the bytes it moves in device memory, as ``[(what, nbytes), ...]``. A
    GPU ignores them; a library whose kernels can report them is given them (the tests' strict
    double charges them to its byte counters; it checks by execution that no array behind a
    ``const`` pointer changed, not the declared byte counts themselves)."""
    fn = module(xp, source).get_function(name)
    grid = (max(1, int(grid)),)
    declared = getattr(fn, "launch_declared", None)
    if declared is not None:
        declared(grid, (THREADS,), args, reads=reads, writes=writes)
    else:
        fn(grid, (THREADS,), args)
