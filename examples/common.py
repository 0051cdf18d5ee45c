"""Data and models shared by the examples and the convergence benchmark.

No data set is downloaded: the language-model corpus is the Python standard library's
own source (several MB on every machine), and the classifier uses scikit-learn's bundled
digits. Everything is deterministic for a given seed.
"""

import os
import sysconfig

import numpy as np


# ---------------------------------------------------------------------- data
def stdlib_files(max_files=200):
    """The first ``max_files`` Python source files of the standard library, in sorted path order.

    Tests, site-packages and generated caches are skipped, so the list is the same on
    every machine with the same Python version.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    found.sort(key=lambda p: os.path.relpath(p, root))
    return found[:max_files]


def stdlib_corpus(max_files=200, val_fraction=0.1):
    """Byte-level corpus: ``(train, val)`` uint8 arrays from :func:`stdlib_files`.

    The files are joined in order; the last ``val_fraction`` of the bytes is validation.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    chunks = []
    for path in stdlib_files(max_files):
        with open(path, "rb") as fh:
            chunks.append(fh.read())
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    if data.size < 1024:
        raise RuntimeError(f"the standard library corpus is too small ({data.size} bytes)")
    cut = int(data.size * (1 - val_fraction))
    return data[:cut].copy(), data[cut:].copy()


def lm_batch(data, batch, context, rng):
    """``batch`` random windows of ``context + 1`` bytes: inputs ``[:, :-1]`` and targets ``[:, 1:]``."""
    starts = rng.integers(0, data.size - context - 1, size=batch)
    windows = np.stack([data[s : s + context + 1] for s in starts]).astype(np.int64)
    return windows[:, :-1], windows[:, 1:]


def lm_eval_batches(data, batch, context, n_batches):
    """Fixed, evenly spaced validation windows (the same for every method and rank)."""
    total = batch * n_batches
    starts = np.linspace(0, data.size - context - 2, total).astype(np.int64)
    windows = np.stack([data[s : s + context + 1] for s in starts]).astype(np.int64)
    return [(windows[i : i + batch, :-1], windows[i : i + batch, 1:]) for i in range(0, total, batch)]


def digits_split(seed=0, n_train=1500):
    """scikit-learn's digits (1,797 8x8 images, shipped with the package), shuffled and split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = x[perm], y[perm]
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


# ---------------------------------------------------------------------- models (torch)
def tiny_transformer(vocab=256, d_model=128, n_layers=2, n_heads=4, context=64, scale=1):
    """A small causal transformer language model (pre-norm, learned positions).

    ``scale`` multiplies the width (for communication-bound benchmarks).
    """
    import torch
    from torch import nn

    d = d_model * scale

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(context, d))
            layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

        def forward(self, idx):
            t = idx.shape[1]
            h = self.embed(idx) + self.pos[:t]
            h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
            return self.head(self.norm(h))

    return TinyLM()


def mlp_classifier(sizes=(64, 512, 256, 10)):
    """A ReLU MLP for the digits."""
    from torch import nn

    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
