"""torch.distributed collectives per step of SLAMB's adapters (a count, nothing is timed).

    torchrun --nproc_per_node 2 benchmarks/collectives.py            # plain, ddp and clip
    torchrun --nproc_per_node 2 benchmarks/collectives.py --tensors 100

A model of ``--tensors`` tensors (Linear(64, 64) layers: weight and bias), gloo, and
``DistributedOptimizer(SLAMB(...))``. Three ways to drive it:

* ``plain``: the plain process group, ``loss.backward(); opt.step()``;
* ``ddp``: ``DistributedDataParallel`` with ``slamb_hook``;
* ``clip``: plain, with ``clip_grad_norm_`` between ``backward()`` and ``step()`` (the first
  step redoes its exchange, later ones exchange from ``step()``).

Counts the calls of ``torch.distributed.all_reduce`` per step (slamb_comm's collectives; under
DDP, DDP's own bucket allreduces are replaced by the hook). Rank 0 prints one line per way.
"""

import argparse
import sys

import torch
import torch.distributed as dist


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=30, help="tensors in the model (even)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ways", default="plain,ddp,clip")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    import slamb_comm.adapters.torch as st

    calls = [0]
    real = dist.all_reduce

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    dist.all_reduce = counted
    for way in args.ways.split(","):
        torch.manual_seed(0)
        layers = []
        for _ in range(args.tensors // 2):
            layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers)
        opt = st.DistributedOptimizer(st.SLAMB(model.parameters(), lr=1e-3, ratio=0.1, dense_threshold=0),
                                      named_parameters=model.named_parameters())
        net = model
        if way == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
            net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
        per = []
        for _ in range(args.steps):
            calls[0] = 0
            opt.zero_grad()
            net(torch.randn(16, 64)).pow(2).mean().backward()
            if way == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            per.append(calls[0])
        if dist.get_rank() == 0:
            print(f"{way}: {args.tensors} tensors, all_reduce calls per step: {per}", flush=True)
    dist.all_reduce = real
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
