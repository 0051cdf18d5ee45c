# sudo python3 benchmarks/cluster.py bench --nodes 2,4 --rates 1gbit,10gbit,none --out results/cluster.csv
# sudo python3 benchmarks/cluster.py run --nodes 4 --rate 1gbit -- python3 examples/numpy_slamb.py --steps 50
# sudo python3 benchmarks/cluster.py lm --nodes 4 --rates 1gbit,10gbit,local --out results/cluster_lm.csv
# sudo python3 benchmarks/cluster.py tta --nodes 4 --rate 50mbit --out results/cluster_tta.csv
# sudo python3 benchmarks/cluster.py check --nodes 2          (build, ping every pair, tear down)
# sudo python3 benchmarks/cluster.py cleanup --prefix slambx  (only after a kill -9 left namespaces behind)
"""An emulated N-node cluster out of network namespaces, and the step-time benchmark run on it.

The command line. The cluster itself (namespaces, veth, bridge, ``tc`` per node link,
``mpirun`` over TCP inside them, the safety rules) is ``netns.py``; the experiments are
``cluster_loop.py`` (``loop``/``bench``/``report``), ``cluster_lm.py`` (``lm``) and
``cluster_tta.py`` (``tta``).

Sub-commands:

* ``check``  -- build, ping every pair, print the setup, tear down (exit 0 on success);
* ``cleanup`` -- delete ``<prefix>-n<i>``/``<prefix>-br`` left behind by a ``kill -9``;
* ``run``    -- build, run ``mpirun -np N <command...>`` on the cluster, tear down;
  usable for any MPI program;
* ``report`` -- the table and plot again from bench CSV(s);
* ``bench``  -- the step-time benchmark: for every node count and link rate, the ``loop``
  below with each method; CSV, PNG and a markdown table;
* ``lm``     -- the end-to-end benchmark: ``examples/train_lm.py`` with dense LAMB and SLAMB
  for each link rate (and ``local``: plain mpirun, no emulation); median step time and
  bytes per step; CSV, PNG and a table;
* ``tta``    -- time to accuracy: ``examples/train_lm.py`` with dense LAMB, 1-bit LAMB and
  SLAMB at their best learning rates on one slow link; training time to dense LAMB's final
  validation loss; CSV, PNG and a table;
* ``loop``   -- (run under mpirun) the synthetic training loop: fixed compute, then the
  exchange (``dense``, ``dense_hvd`` or ``slamb``), optionally with the optimizer update.
"""

import argparse
import csv
import json
import os
import sys
import time

from cluster_lm import lm_main
from cluster_tta import add_parser as add_tta_parser, tta_main
from cluster_loop import bench_main, cluster_table, loop_main, plot_cluster
from netns import ROOT, Cluster, ClusterError, cleanup


def check_main(args):
    with Cluster(args.nodes, rate=args.rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet) as cl:
        print(json.dumps({"namespaces": cl.ns + [cl.br_ns], "addresses": cl.addrs}))
        bad = cl.ping_all()
        if bad:
            print(f"ping failed for pairs {bad}", file=sys.stderr)
            return 1
        print(f"ping ok between all {args.nodes} nodes", flush=True)
        if args.hold:
            time.sleep(args.hold)
    return 0


def run_main(args):
    cmd = args.command[1:] if args.command and args.command[0] == "--" else args.command
    if not cmd:
        print("run: give a command after --", file=sys.stderr)
        return 2
    with Cluster(args.nodes, rate=args.rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet) as cl:
        rc, out, err = cl.mpirun(cmd, timeout=args.timeout)
        sys.stdout.write(out)
        sys.stderr.write(err)
        return rc


def report_main(args):
    rows = []
    for path in args.csvs:
        with open(path) as fh:
            rows += list(csv.DictReader(fh))
    print(cluster_table(rows))
    print(f"wrote {plot_cluster(rows, args.png or os.path.splitext(args.csvs[0])[0] + '.png')}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def net_opts(p):
        p.add_argument("--prefix", default="slambx", help="namespace-name prefix (must be unused)")
        p.add_argument("--subnet", default="10.213.0.0/24", help="private subnet used only inside the namespaces")
        p.add_argument("--delay", default=None, help="netem one-way delay per link, e.g. 100us (needs netem)")

    p = sub.add_parser("check", help="build, ping every pair, tear down")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default=None)
    p.add_argument("--hold", type=float, default=0.0, help="seconds to keep the cluster up after pinging")
    net_opts(p)

    p = sub.add_parser("cleanup", help="after a kill -9: delete <prefix>-n<i> / <prefix>-br namespaces and their processes")
    p.add_argument("--prefix", default="slambx")

    p = sub.add_parser("run", help="run 'mpirun -np N CMD' on the emulated cluster")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default=None, help="per-node link rate, e.g. 1gbit (default: unlimited)")
    p.add_argument("--timeout", type=int, default=600)
    net_opts(p)
    p.add_argument("command", nargs=argparse.REMAINDER)

    p = sub.add_parser("lm", help="end-to-end: examples/train_lm.py, dense LAMB vs SLAMB, per link rate")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rates", default="1gbit,10gbit,local", help="link rates; 'local' = plain mpirun, no emulation")
    p.add_argument("--optimizers", default="lamb,slamb")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--files", type=int, default=20, help="stdlib modules in the corpus (small: faster start)")
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--value-dtype", default="float16")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default="results/cluster_lm.csv")
    p.add_argument("--no-plot", action="store_true")
    net_opts(p)

    add_tta_parser(sub, net_opts)

    p = sub.add_parser("report", help="table and plot from bench CSV(s), no measuring")
    p.add_argument("csvs", nargs="+")
    p.add_argument("--png", default=None, help="default: the first CSV with .png")

    p = sub.add_parser("bench", help="step-time benchmark over node counts and link rates")
    p.add_argument("--nodes", default="2,4")
    p.add_argument("--rates", default="1gbit,10gbit,none,local",
                   help="'none' = namespaces without a rate limit; 'local' = plain mpirun, shared memory")
    p.add_argument("--methods", default="dense,dense_hvd,slamb")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default="results/cluster.csv")
    p.add_argument("--no-plot", action="store_true")
    net_opts(p)

    for q in (p, sub.add_parser("loop", help="(under mpirun) the synthetic training loop")):
        q.add_argument("--log2", type=int, default=24, help="buffer of 2^log2 fp32 elements")
        q.add_argument("--steps", type=int, default=10)
        q.add_argument("--warmup", type=int, default=2)
        q.add_argument("--matmuls", type=int, default=1, help="fixed compute: matmuls per step")
        q.add_argument("--matmul-dim", type=int, default=1024)
        q.add_argument("--sync-interval", type=int, default=100)
        q.add_argument("--optimizer", action="store_true", help="include the optimizer update (LAMB / SlambRule.step)")
    q.add_argument("--method", choices=("dense", "dense_hvd", "slamb"), default="dense")
    q.add_argument("--ratio", type=float, default=0.1)
    q.add_argument("--value-dtype", default="float16")

    args = ap.parse_args(argv)
    if args.cmd == "loop":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        loop_main(args)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    if args.cmd == "report":
        return report_main(args)
    try:
        if args.cmd == "cleanup":
            cleanup(args.prefix)
            return 0
        return {"check": check_main, "run": run_main, "bench": bench_main, "lm": lm_main,
                "tta": tta_main}[args.cmd](args)
    except ClusterError as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
