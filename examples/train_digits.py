# horovodrun -np 4 python examples/train_digits.py --optimizer slamb
# (or: mpirun -np 4 python examples/train_digits.py; as root on 2 cores: bash scripts/mpirun.sh 4 600 python3 examples/train_digits.py)
"""An MLP classifier on scikit-learn's bundled digits, with Horovod.

Each rank takes its own shard of every global batch. ``--optimizer`` as in
``train_lm.py``; rank 0 logs loss, validation accuracy and bytes against dense.
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
    common.add_training_args(ap, steps=300, lr=0.01)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank")
    args = ap.parse_args(argv)

    import horovod.torch as hvd

    hvd.init()
    (xtr, ytr), (xva, yva) = common.digits_split(args.seed)
    torch.manual_seed(args.seed)
    model = common.mlp_classifier()
    xva_t, yva_t = torch.from_numpy(xva), torch.from_numpy(yva)

    def batch_fn(step, rank):
        rng = np.random.default_rng([args.seed, step])  # one global batch, sharded by rank
        idx = rng.choice(len(ytr), size=args.batch * hvd.size(), replace=False)
        mine = idx[rank * args.batch:(rank + 1) * args.batch]
        return torch.from_numpy(xtr[mine]), torch.from_numpy(ytr[mine])

    def evaluate(m):
        with torch.no_grad():
            logits = m(xva_t)
        return F.cross_entropy(logits, yva_t).item(), "accuracy", (logits.argmax(1) == yva_t).float().mean().item()

    return common.train(args, model, batch_fn, F.cross_entropy, evaluate, "MLP on digits")


if __name__ == "__main__":
    main()
