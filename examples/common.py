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
def tiny_transformer(vocab=256, d_model=128, n_layers=2, n_heads=4, context=64, scale=1, flat_logits=False):
    """A small causal transformer language model (pre-norm, learned positions).

    ``scale`` multiplies the width (for communication-bound benchmarks). The logits are
    ``(batch, length, vocab)``; with ``flat_logits=True`` they are one ``(batch * length, vocab)``
    matrix, the same values: the head's own output rather than a view of it, since ``nn.Linear``
    on a 3-D input returns a view, and FSDP2 warns about a wrapped module that returns one (an
    in-place op on it would skip FSDP2's pre-backward hook).
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
            h = self.norm(self.blocks(h, mask=self.causal[:t, :t], is_causal=True))
            return self.head(h.flatten(0, 1)) if flat_logits else self.head(h)

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


# ---------------------------------------------------------------------- training (torch + horovod)
OPTIMIZERS = ("slamb", "lamb", "onebit_lamb", "adam", "sgd", "topk-adam")


def add_training_args(ap, steps, lr):
    """The command-line options every torch example shares (optimizer choice and SLAMB's knobs)."""
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="slamb")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--ratio", type=float, default=0.1, help="SLAMB: momentum fraction per step; topk-adam: k")
    ap.add_argument("--beta3", type=float, default=0.9, help="SLAMB freshness decay")
    ap.add_argument("--sync-interval", type=int, default=100, help="SLAMB: parameter average every H steps")
    ap.add_argument("--mask", choices=["cyclic", "bernoulli", "topk"], default="cyclic")
    ap.add_argument("--block", type=int, default=1,
                    help="SLAMB cyclic mask: runs of this many contiguous elements (1: single elements)")
    ap.add_argument("--value-dtype", choices=["float32", "float16"], default="float32",
                    help="payload dtype of the sparse exchange")
    ap.add_argument("--freeze-step", type=int, default=None,
                    help="onebit_lamb: dense LAMB warm-up steps before the 1-bit exchange "
                         "(default: 15%% of --steps, at least 10; see onebit_freeze_step)")
    ap.add_argument("--eps", type=float, default=None,
                    help="the optimizer's eps (default: its own; not for sgd). 1-bit LAMB on models with "
                         "near-zero second moments needs a larger one: docs/onebit_lamb.md section 4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mask-seed", type=int, default=None,
                    help="SLAMB: the mask's seed alone (default: --seed), to vary the mask with the rest fixed")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--csv", default=None, help="write one row per evaluation (rank 0)")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--save-at", type=int, default=None,
                    help="after this step, save every rank's model and optimizer state with slamb_comm.methods.checkpoint "
                         "into --checkpoint-dir (and train on)")
    ap.add_argument("--resume", action="store_true",
                    help="start from the slamb_comm.methods.checkpoint in --checkpoint-dir, on any number of ranks: saved by "
                         "another number, it is resized by docs/algorithm.md section 10's rule")
    ap.add_argument("--checkpoint-dir", default=None, help="directory of --save-at / --resume")


def onebit_freeze_step(args):
    """1-bit LAMB's warm-up length: ``--freeze-step``, else 15% of ``--steps`` and at least 10.

    Why 15%: DeepSpeed's 1-bit LAMB BERT recipes freeze after about 23k of their 150k+ steps
    (~15%), long enough for the second moment v (frozen afterwards) to settle; and the floor of
    10 is ``1 / (1 - coeff_beta)`` at the default coeff_beta 0.9, the warm-up DeepSpeed's
    docstring asks for at least so that the frozen LAMB coefficient's average has seen enough
    steps. At the convergence benchmark's 600 steps this is 90 dense steps, then 510 compressed.
    """
    if args.freeze_step is not None:
        return args.freeze_step
    return max(10, int(round(0.15 * args.steps)))


def build_optimizer(args, model):
    """The distributed optimizer for ``args.optimizer``; each line is what a user would write.

    Returns ``(optimizer, bytes_fn)`` where ``bytes_fn()`` gives the step's
    :class:`slamb_comm.Traffic` (payload handed to the collectives vs a dense fp32 allreduce).
    """
    import horovod.torch as hvd
    import torch

    import slamb_comm
    from slamb_comm.adapters import horovod as shvd

    named = list(model.named_parameters())
    params = [p for _, p in named]
    if args.eps is not None and args.optimizer == "sgd":
        raise SystemExit("--eps: sgd has no eps")
    eps = {} if args.eps is None else {"eps": args.eps}
    if args.optimizer == "slamb":
        opt = shvd.DistributedOptimizer(
            shvd.SLAMB(params, lr=args.lr, weight_decay=args.weight_decay, ratio=args.ratio, beta3=args.beta3, **eps,
                       sync_interval=args.sync_interval, mask=args.mask, block=args.block,
                       value_dtype=args.value_dtype, seed=args.seed if args.mask_seed is None else args.mask_seed),
            named_parameters=named)
        return opt, opt.step_traffic
    if args.optimizer == "onebit_lamb":
        # DeepSpeed's defaults but lr and weight decay (bias_correction=False is DeepSpeed's rule).
        # step_traffic() reads the communicator's stats: warm-up steps record the dense fp32
        # allreduce of the gradient (plus its status word), compressed steps the 1-bit exchange
        # (packed signs and scales in an all-to-all and an allgather).
        opt = shvd.DistributedOptimizer(
            shvd.OneBitLAMB(params, lr=args.lr, weight_decay=args.weight_decay, freeze_step=onebit_freeze_step(args),
                            **eps),
            named_parameters=named)
        return opt, opt.step_traffic
    if args.optimizer == "topk-adam":
        opt = shvd.DistributedOptimizer(torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **eps),
                                        named_parameters=named,
                                        compression=slamb_comm.TopK(args.ratio, value_dtype=args.value_dtype))
        return opt, opt.step_traffic
    if args.optimizer == "lamb":  # dense LAMB, the baseline: Horovod's own allreduce of the gradients, then LAMB
        opt = shvd.DistributedOptimizer(shvd.LAMB(params, lr=args.lr, weight_decay=args.weight_decay, **eps),
                                        named_parameters=named)
    elif args.optimizer == "adam":
        base = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **eps)
    else:
        base = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    if args.optimizer != "lamb":
        opt = hvd.DistributedOptimizer(base, named_parameters=named)
    dense = sum(p.numel() * 4 for p in params)
    wire = slamb_comm.wire.stats.allreduce_wire(dense, hvd.size())
    return opt, lambda: slamb_comm.Traffic(calls=1, payload_bytes=dense, wire_bytes=wire, dense_payload_bytes=dense,
                                           dense_wire_bytes=wire)


def averaged_copy(model):
    """A copy of ``model`` whose parameters are the mean over ranks (for evaluation)."""
    import copy

    import horovod.torch as hvd

    avg = copy.deepcopy(model)
    for name, p in avg.named_parameters():
        p.data.copy_(hvd.allreduce(p.data, op=hvd.Average, name=f"eval.{name}"))
    return avg


def train(args, model, batch_fn, loss_fn, evaluate, label):
    """The training loop shared by the examples: returns a summary dict (rank 0 prints it).

    ``batch_fn(step, rank)`` gives this rank's ``(inputs, targets)``; ``evaluate(model)``
    returns ``(val_loss, metric_name, metric)`` for a model (the mean of the replicas).
    """
    import csv
    import time

    import horovod.torch as hvd
    import torch

    from slamb_comm.methods import checkpoint
    from slamb_comm.adapters.horovod import HorovodTransport

    torch.set_num_threads(args.threads)
    if (args.save_at is not None or args.resume) and not args.checkpoint_dir:
        raise SystemExit("--save-at and --resume need --checkpoint-dir")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt, bytes_fn = build_optimizer(args, model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    me, P = hvd.rank(), hvd.size()
    n_params = sum(p.numel() for p in model.parameters())
    rows, moved, dense_moved, first = [], 0, 0, 1
    if args.resume:  # after the broadcasts: each rank's own (or resized) state, not rank 0's
        saved = checkpoint.load(args.checkpoint_dir, HorovodTransport())
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        first, moved, dense_moved = int(saved["step"]) + 1, int(saved["bytes"]), int(saved["dense_bytes"])
        if me == 0:
            print(f"resumed at step {first - 1} from {args.checkpoint_dir} (saved by {saved['ranks']} ranks, "
                  f"now {P})", flush=True)
    bar = None
    if me == 0:
        print(f"{label}: {args.optimizer} on {P} ranks, {n_params} parameters, lr {args.lr}"
              + (f", ratio {args.ratio}, beta3 {args.beta3}, H {args.sync_interval}, mask {args.mask}"
                 + (f" (runs of {args.block})" if args.block != 1 else "") + ", "
                 f"{args.value_dtype} payload" if args.optimizer == "slamb" else "")
              + (f", k {args.ratio}, {args.value_dtype} payload" if args.optimizer == "topk-adam" else "")
              + (f", freeze_step {onebit_freeze_step(args)}" if args.optimizer == "onebit_lamb" else ""),
              flush=True)
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=first - 1, desc=args.optimizer, unit="step")
    t0 = time.perf_counter()
    step_times = []  # wall time of each training step (batch, forward, backward, exchange, update), no evaluation
    for step in range(first, args.steps + 1):
        ts = time.perf_counter()
        x, y = batch_fn(step, me)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - ts)
        traffic = bytes_fn()
        moved += traffic.payload_bytes
        dense_moved += n_params * 4
        last = step == args.steps
        if step % args.eval_every == 0 or last:
            val_loss, metric_name, metric = evaluate(averaged_copy(model))
            train_loss = hvd.allreduce(loss.detach(), op=hvd.Average, name="train_loss").item()
            row = {"method": args.optimizer, "lr": args.lr, "ratio": args.ratio, "beta3": args.beta3,
                   "value_dtype": args.value_dtype, "ranks": P, "step": step, "train_loss": train_loss,
                   "val_loss": val_loss, metric_name: metric, "bytes": moved, "dense_bytes": dense_moved,
                   "bytes_vs_dense": moved / dense_moved, "seconds": time.perf_counter() - t0,
                   "train_seconds": float(sum(step_times)),  # without the evaluations
                   "step_ms_median": 1e3 * float(np.median(step_times[min(5, len(step_times) // 5):]))}
            if args.optimizer == "onebit_lamb":
                row["freeze_step"] = onebit_freeze_step(args)
            rows.append(row)
            if me == 0:
                msg = (f"step {step:5d}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  {metric_name} "
                       f"{metric:.4f}  sent {traffic.payload_bytes} B, {traffic.ratio:.3f} of dense  "
                       f"(all steps: {moved / dense_moved:.3f})")
                (bar.write if bar is not None else print)(msg)
        if step == args.save_at:
            checkpoint.save(args.checkpoint_dir, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                                  "bytes": moved, "dense_bytes": dense_moved, "ranks": P},
                            HorovodTransport())
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    summary = rows[-1]
    if me == 0:
        if args.csv:
            os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
            with open(args.csv, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        print(f"summary: {args.optimizer} final val loss {summary['val_loss']:.4f}, "
              f"{metric_name} {summary[metric_name]:.4f}, "
              f"bytes {moved / 1e6:.1f} MB vs dense allreduce {dense_moved / 1e6:.1f} MB "
              f"({moved / dense_moved:.1%}), {summary['seconds']:.0f} s, "
              f"median step {summary['step_ms_median']:.1f} ms", flush=True)
    return summary
