# horovodrun -np 4 python examples/train_lm.py --optimizer slamb
# (or: mpirun -np 4 python examples/train_lm.py; as root on 2 cores: bash scripts/mpirun.sh 4 1200 python3 examples/train_lm.py)
"""A small transformer language model on the Python standard library's own source, with Horovod.

Byte-level, 2 layers, d = 128, context 64, 16 sequences per rank (the setting of
docs/algorithm.md section 5). Choose the optimizer with ``--optimizer``: ``slamb`` (sparse
momentum, this library), ``lamb`` (dense LAMB over Horovod allreduce), ``onebit_lamb``
(1-bit LAMB, docs/onebit_lamb.md: ``--freeze-step`` dense LAMB steps, by default 15% of
``--steps`` as in DeepSpeed's BERT recipes, then the error-compensated 1-bit momentum
exchange), ``adam``, ``sgd``, or ``topk-adam`` (Adam on top-k gradients with error
feedback). Rank 0 logs training and validation loss and the bytes handed to the collectives
against a dense allreduce: for ``onebit_lamb`` the warm-up steps count the dense fp32
allreduce of the gradient, the later ones the 1-bit exchange's signs and scales, both as the
communicator's statistics record them (``step_traffic()``).
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(ap, steps=600, lr=0.01)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--files", type=int, default=200, help="standard-library modules in the corpus")
    ap.add_argument("--eval-batches", type=int, default=8)
    args = ap.parse_args(argv)

    import horovod.torch as hvd

    hvd.init()
    train_data, val_data = common.stdlib_corpus(args.files)
    torch.manual_seed(args.seed)
    model = common.tiny_transformer(d_model=args.d_model, n_layers=args.layers, context=args.context)
    val = [(torch.from_numpy(x), torch.from_numpy(y))
           for x, y in common.lm_eval_batches(val_data, args.batch, args.context, args.eval_batches)]

    def batch_fn(step, rank):
        rng = np.random.default_rng([args.seed, rank, step])
        x, y = common.lm_batch(train_data, args.batch, args.context, rng)
        return torch.from_numpy(x), torch.from_numpy(y)

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(m):
        with torch.no_grad():
            losses = [loss_fn(m(x), y).item() for x, y in val]
        loss = float(np.mean(losses))
        return loss, "bits_per_byte", loss / np.log(2)

    return common.train(args, model, batch_fn, loss_fn, evaluate, "byte-level LM on the stdlib")


if __name__ == "__main__":
    main()
