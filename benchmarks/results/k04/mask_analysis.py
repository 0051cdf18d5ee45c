"""The cyclic mask of SAdamW on the example LM's layout at k = 0.03, 0.04, 0.05, 0.1 (seed 0): balance,
hash quality, and the phase between the cycle of C chunks and the sync interval H (issue 36).

    python3 benchmarks/results/k04/mask_analysis.py > benchmarks/results/k04/mask_analysis.txt
"""
import math
import sys

import numpy as np

sys.path.insert(0, "examples")
import common  # noqa: E402
from slamb_comm.wire.layout import Layout  # noqa: E402
from slamb_comm.wire.masks import CyclicMask  # noqa: E402

named = list(common.tiny_transformer().named_parameters())
lay = Layout([p.shape for _, p in named], np.float32, names=[n for n, _ in named])
print(f"compressible tensors: {[lay.names[i] for i in lay.compressible]}")
print(f"always dense: {sum(n for n, d in zip(lay.sizes, lay.dense) if d)} of {lay.total} elements")
for k in (0.03, 0.04, 0.05, 0.1):
    m = CyclicMask(lay, k, 0)
    C, G = m.num_chunks, m.units // m.num_chunks
    h = np.array([m.rotation(g) for g in range(G)])
    cnt = np.bincount(h, minlength=C)
    chi2 = float(((cnt - G / C) ** 2 / (G / C)).sum())
    lags = max((float((h[:-L] == h[L:]).mean()) * C, L) for L in range(1, 1025))
    sizes = [sum(m.count_of_chunk(j, i) for i in lay.compressible) for j in range(C)]
    col = []
    for i in lay.compressible:
        c = m._geo[i].chunks(0, lay.sizes[i], np).reshape(lay.shapes[i][0], -1)
        per_col = np.stack([(c == j).sum(0) for j in range(C)])
        binom = math.sqrt(lay.shapes[i][0] / C * (1 - 1 / C))
        col.append(per_col.std() / binom)
    print(f"k={k}: C={C}, {m.units} units in {G} full groups; chunk sizes {min(sizes)}-{max(sizes)}; "
          f"rotations chi2 {chi2:.1f} on {C - 1} dof; max over lags 1..1024 of P(h(g+L)=h(g))*C = "
          f"{lags[0]:.3f} (lag {lags[1]}); per-column count std / binomial std: {min(col):.2f}-{max(col):.2f}")
    for H in (20, 25, 100):
        phases = sorted({(t - 1) % C for t in range(1, 601) if (t - 1) % H == 0})
        print(f"    H={H}: chunks exchanged on sync steps over 600 steps: {phases}")
