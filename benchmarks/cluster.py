# sudo python3 benchmarks/cluster.py bench --nodes 2,4 --rates 1gbit,10gbit,none --out results/cluster.csv
# sudo python3 benchmarks/cluster.py run --nodes 4 --rate 1gbit -- python3 examples/numpy_slamb.py --steps 50
# sudo python3 benchmarks/cluster.py lm --nodes 4 --rates 1gbit,10gbit,local --out results/cluster_lm.csv
# sudo python3 benchmarks/cluster.py check --nodes 2          (build, ping every pair, tear down)
# sudo python3 benchmarks/cluster.py cleanup --prefix slambx  (only after a kill -9 left namespaces behind)
"""An emulated N-node cluster out of network namespaces, and the step-time benchmark run on it.

Topology (everything lives in namespaces this script creates; the root namespace only
holds the mpirun launcher's parent, this script)::

    <prefix>-n0 (10.213.0.1, eth0) --veth-- h0 |
    <prefix>-n1 (10.213.0.2, eth0) --veth-- h1 |-- br0 in <prefix>-br
    ...                                        |

Each node's link is rate-limited in both directions with a ``tbf`` qdisc (node egress on
its ``eth0``, node ingress on the bridge-side ``h<i>``), like a full-duplex NIC on a
non-blocking switch; ``--delay`` adds a ``netem`` latency where the kernel has netem.
No address outside the subnet is ever configured, routed or contacted, and nothing is
created in the root namespace.

``mpirun`` runs inside node 0 (in its own UTS namespace, hostname ``<prefix>-n0``) with
one slot per node from a hostfile of the node addresses, over TCP only
(``--mca pml ob1 --mca btl tcp,self``, ``btl_tcp_if_include`` / ``oob_tcp_if_include`` =
the subnet). Its ``plm_rsh_agent`` is a generated local script, not ssh: it maps the
host address to that node's namespace and runs the orted there through
``ip netns exec <ns> unshare --uts`` (so every node has its own hostname).

Safety: root only; refuses to start if any namespace it would create already exists or
the subnet is in use in the root namespace or in any existing namespace; deletes only
what it created; tears down in ``finally``, on SIGINT/SIGTERM/SIGHUP and at exit, also
when the job fails; processes left in its namespaces are killed before they are deleted.

Sub-commands:

* ``check``  -- build, ping every pair, print the setup, tear down (exit 0 on success);
* ``cleanup`` -- delete ``<prefix>-n<i>``/``<prefix>-br`` left behind by a ``kill -9``;
* ``run``    -- build, run ``mpirun -np N <command...>`` on the cluster, tear down;
  usable for any MPI program (the end-to-end language-model example, once it exists);
* ``report`` -- the table and plot again from bench CSV(s);
* ``bench``  -- the step-time benchmark: for every node count and link rate, the ``loop``
  below with each method; CSV, PNG and a markdown table;
* ``lm``     -- the end-to-end benchmark: ``examples/train_lm.py`` (Horovod, PyTorch), scaled
  up with ``--d-model``/``--layers``, for each link rate (and ``local``: plain mpirun,
  no emulation) with dense LAMB over Horovod's allreduce (``--optimizer lamb``) and SLAMB
  (``--optimizer slamb``, ratio 0.1, fp16 payload); reports the median training-step time
  (forward, backward, exchange, update) and the bytes per step; CSV, PNG and a table;
* ``loop``   -- (run under mpirun) a synthetic training loop on a flat fp32 buffer:
  per step a fixed compute cost (single-threaded ``--matmuls`` matmuls of
  ``--matmul-dim``), then the exchange:

  - ``dense``      -- ``Communicator.sync`` of the gradient (fused fp32 allreduce-mean);
  - ``dense_hvd``  -- ``hvd.allreduce`` (Average, fp32) of the gradient as a torch tensor;
  - ``slamb``      -- ``Communicator.masked_allreduce`` of the momentum (ratio 0.1, fp16
    payload, cyclic mask) plus the periodic parameter sync (``Communicator.sync``) every H
    steps, its measured time amortised over H;

  and with ``--optimizer``: ``dense`` then runs a NumPy LAMB update on the mean gradient
  and ``slamb`` runs ``slamb_comm.slamb.Slamb.step`` (moments, masked allreduce, trust
  ratios, update, sync), so a step is compute + optimizer + communication.
"""

import argparse
import atexit
import contextlib
import csv
import ipaddress
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from csvout import write_rows

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class ClusterError(RuntimeError):
    """The cluster cannot be built (not root, names or subnet taken, a tool missing)."""


def _ip(*args, check=True, capture=True):
    return subprocess.run(["ip", *args], check=check, capture_output=capture, text=True, timeout=30)


def _existing_netns():
    out = _ip("netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _addrs_in(ns=None):
    """IPv4 networks of every address and route in a namespace (None: the root one)."""
    pre = ["-n", ns] if ns else []
    nets = []
    for cmd in (["-4", "-o", "addr", "show"], ["-4", "route", "show", "table", "all"]):
        res = _ip(*pre, *cmd, check=False)
        for line in res.stdout.splitlines():
            for tok in line.split():
                if "." in tok and tok[0].isdigit():
                    try:
                        nets.append(ipaddress.ip_network(tok, strict=False))
                    except ValueError:
                        pass
    return nets


class Cluster:
    """N namespaces on one bridge, rate-limited; a context manager that always tears down.

    Args:
        nodes: number of nodes (namespaces), 1..250.
        rate: per-node link rate for ``tc`` (e.g. '1gbit', '10gbit'), or None for no limit.
        delay: one-way latency added per node link with netem (e.g. '100us'), or None.
        prefix: namespace-name prefix; namespaces are ``<prefix>-n<i>`` and ``<prefix>-br``.
        subnet: a private IPv4 /24 used only inside the namespaces.
        mtu: veth MTU.
    """

    def __init__(self, nodes, rate=None, delay=None, prefix="slambx", subnet="10.213.0.0/24", mtu=1500,
                 verbose=True):
        if not 1 <= int(nodes) <= 250:
            raise ClusterError("nodes must be in 1..250")
        self.nodes = int(nodes)
        self.rate = None if rate in (None, "", "none") else rate
        self.delay = None if delay in (None, "", "none", "0") else delay
        self.prefix = prefix
        self.net = ipaddress.ip_network(subnet, strict=True)
        if not self.net.is_private or self.net.prefixlen > 24 or self.net.version != 4:
            raise ClusterError(f"{subnet}: need a private IPv4 network of /24 or larger")
        hosts = list(self.net.hosts())
        self.addrs = [str(hosts[i]) for i in range(self.nodes)]
        self.ns = [f"{prefix}-n{i}" for i in range(self.nodes)]
        self.br_ns = f"{prefix}-br"
        self.mtu = int(mtu)
        self.verbose = verbose
        self.created = []  # namespaces this object created, in order (the only ones it deletes)
        self.tmpdir = None
        self.procs = []  # Popen objects started by this object
        self._old_handlers = {}
        self._atexit = False

    # ------------------------------------------------------------------ checks
    def preflight(self):
        """Refuse to run unless root, the tools exist, and our names and subnet are free."""
        if os.geteuid() != 0:
            raise ClusterError("the emulated cluster needs root (network namespaces, veth, tc): run it as root")
        for tool in ("ip", "tc", "unshare", "mpirun"):
            if shutil.which(tool) is None:
                raise ClusterError(f"'{tool}' not found (apt-get install -y iproute2 util-linux openmpi-bin)")
        existing = _existing_netns()
        taken = sorted(set(self.ns + [self.br_ns]) & existing)
        if taken:
            raise ClusterError(f"refusing to run: namespace(s) {taken} already exist (another run, or not ours); "
                               f"pick another --prefix")
        for ns in [None, *sorted(existing)]:
            for net in _addrs_in(ns):
                if net.prefixlen > 0 and net.overlaps(self.net):
                    where = "the root namespace" if ns is None else f"namespace {ns}"
                    raise ClusterError(f"refusing to run: subnet {self.net} overlaps {net} in use in {where}; "
                                       f"pick another --subnet")

    # ------------------------------------------------------------------ build / tear down
    def _log(self, msg):
        if self.verbose:
            print(f"[cluster] {msg}", file=sys.stderr, flush=True)

    def _add_ns(self, name):
        _ip("netns", "add", name)  # fails if it exists: we never adopt a namespace we did not create
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _tc(self, ns, dev):
        """Root qdisc on one side of a node link: tbf at the rate, behind netem if a delay is asked."""
        if self.rate is None and self.delay is None:
            return
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.delay is not None:
            res = subprocess.run(base + ["root", "handle", "1:", "netem", "delay", self.delay],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise ClusterError(f"netem is not available in this kernel ({res.stderr.strip()}); run without --delay")
            parent = ["parent", "1:1"]
        if self.rate is not None:
            bps = _rate_bps(self.rate)
            burst = max(64 * 1024, int(bps / 8 * 0.001))  # >= one GSO packet, ~1 ms of line rate
            subprocess.run(base + parent + ["handle", "10:", "tbf", "rate", self.rate, "burst", str(burst),
                                            "latency", "20ms"], check=True, capture_output=True, text=True)

    def up(self):
        """Build the cluster (after :meth:`preflight`); on any failure, tear down and re-raise."""
        self.preflight()
        self.install_handlers()
        try:
            self._add_ns(self.br_ns)
            _ip("-n", self.br_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.br_ns, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(zip(self.ns, self.addrs)):
                self._add_ns(ns)
                host_if = f"h{i}"
                _ip("-n", self.br_ns, "link", "add", host_if, "mtu", str(self.mtu), "type", "veth",
                    "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns)
                _ip("-n", self.br_ns, "link", "set", host_if, "master", "br0")
                _ip("-n", self.br_ns, "link", "set", host_if, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._tc(ns, "eth0")
                self._tc(self.br_ns, host_if)
            self.tmpdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
            self._write_launch_files()
            self._log(f"up: {self.nodes} node(s) {self.ns[0]}..{self.ns[-1]} on {self.net}, "
                      f"rate {self.rate or 'unlimited'}, delay {self.delay or 'none'}")
        except BaseException:
            self.down()
            raise
        return self

    def down(self):
        """Kill what runs in our namespaces, delete them (only those we created), remove temp files."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.procs = []
        for ns in reversed(self.created):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            for _ in range(50):
                if not _ip("netns", "pids", ns, check=False).stdout.split():
                    break
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        if self.created:
            self._log(f"down: deleted {len(self.created)} namespace(s)")
        self.created = []
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        self.restore_handlers()

    def install_handlers(self):
        """SIGINT/SIGTERM/SIGHUP raise SystemExit (so ``finally`` tears down); atexit as a backstop."""
        def handler(signum, frame):
            raise SystemExit(128 + signum)

        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if s not in self._old_handlers:
                self._old_handlers[s] = signal.signal(s, handler)
        if not self._atexit:
            atexit.register(self.down)
            self._atexit = True

    def restore_handlers(self):
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False

    # ------------------------------------------------------------------ use
    def _write_launch_files(self):
        self.hostfile = os.path.join(self.tmpdir, "hostfile")
        with open(self.hostfile, "w") as fh:
            for a in self.addrs:
                fh.write(f"{a} slots=1\n")
        self.agent = os.path.join(self.tmpdir, "netns-rsh")
        cases = "\n".join(f"  {a}) ns={n} ;;" for a, n in zip(self.addrs, self.ns))
        with open(self.agent, "w") as fh:
            fh.write(f"""#!/bin/sh
# plm_rsh_agent for the emulated cluster: "ssh HOST CMD..." becomes "run CMD in HOST's namespace".
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host="$1"; shift
case "$host" in
{cases}
  *) echo "netns-rsh: unknown host $host (not in this emulated cluster)" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0"; exec /bin/sh -c "$1"' "$ns" "$*"
""")
        os.chmod(self.agent, 0o755)

    def exec(self, node, cmd, **kw):
        """Run ``cmd`` (a list) inside node ``node``'s namespace; returns CompletedProcess."""
        return subprocess.run(["ip", "netns", "exec", self.ns[node], *cmd], capture_output=True, text=True, **kw)

    def counters(self):
        """Per node: (tx_bytes, rx_bytes) of its eth0."""
        out = []
        for ns in self.ns:
            base = "/sys/class/net/eth0/statistics/"
            r = subprocess.run(["ip", "netns", "exec", ns, "cat", base + "tx_bytes", base + "rx_bytes"],
                               capture_output=True, text=True, check=True)
            tx, rx = (int(v) for v in r.stdout.split())
            out.append((tx, rx))
        return out

    def mpirun_argv(self, cmd, np_=None, extra_mca=()):
        """The mpirun command line (run inside node 0) for ``cmd`` with one rank per node."""
        np_ = self.nodes if np_ is None else int(np_)
        mca = [("pml", "ob1"), ("btl", "tcp,self"), ("btl_tcp_if_include", str(self.net)),
               ("oob_tcp_if_include", str(self.net)), ("plm_rsh_agent", self.agent),
               ("plm_rsh_no_tree_spawn", "1"), ("btl_vader_single_copy_mechanism", "none"), *extra_mca]
        argv = ["mpirun", "--allow-run-as-root", "-np", str(np_), "--hostfile", self.hostfile,
                "--map-by", "node", "--bind-to", "none"]
        for k, v in mca:
            argv += ["--mca", k, v]
        argv += ["-x", "SLAMBX_NODE=1"]
        for var in ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
            if var in os.environ:
                argv += ["-x", var]
        return argv + list(cmd)

    def mpirun(self, cmd, timeout=600, np_=None, extra_mca=()):
        """Run an MPI job on the cluster; returns (returncode, stdout, stderr). Kills it on timeout."""
        argv = self.mpirun_argv(cmd, np_=np_, extra_mca=extra_mca)
        inner = "hostname \"$0\"; exec \"$@\""
        full = ["ip", "netns", "exec", self.ns[0], "unshare", "--uts", "/bin/sh", "-c", inner, self.ns[0], *argv]
        self._log("mpirun: " + " ".join(shlex.quote(a) for a in cmd))
        p = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             start_new_session=True)
        self.procs.append(p)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            return 124, out, err + f"\n[cluster] timed out after {timeout}s"
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        return p.returncode, out, err

    def ping_all(self):
        """Ping every ordered pair once; returns a list of failures (empty if all reachable)."""
        bad = []
        for i in range(self.nodes):
            for j in range(self.nodes):
                if i != j:
                    r = self.exec(i, ["ping", "-c", "1", "-W", "2", self.addrs[j]], timeout=10)
                    if r.returncode != 0:
                        bad.append((i, j))
        return bad


def _rate_bps(rate):
    s = rate.lower().rstrip("ps").rstrip("/")
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for u, f in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    raise ClusterError(f"rate {rate!r}: use e.g. 100mbit, 1gbit, 10gbit")


def leftovers(prefix):
    """Namespaces with our prefix that still exist (should be none after a run)."""
    return sorted(n for n in _existing_netns() if n.startswith(prefix + "-"))


# ====================================================================== the synthetic loop (under mpirun)
def loop_main(args):
    import numpy as np
    from mpi4py import MPI

    import slamb_comm as sc

    world = MPI.COMM_WORLD
    P = world.size
    n = 2**args.log2
    cols = 1024
    per = min(n, 2**20)
    layout = sc.Layout([(per // cols, cols)] * (n // per), "float32")
    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal(n).astype(np.float32) * 0.1
    grads = [rng.standard_normal(n).astype(np.float32) * 0.01 for _ in range(2)]
    a = rng.standard_normal((args.matmul_dim, args.matmul_dim)).astype(np.float32)
    transport = sc.MPITransport()
    hvd = torch = None
    if args.method == "dense_hvd":
        os.environ.update({"HOROVOD_FUSION_THRESHOLD": str(64 * 2**20), "HOROVOD_CYCLE_TIME": "1",
                           "HOROVOD_AUTOTUNE": "0"})
        import torch
        import horovod.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
    if args.method == "slamb":
        comm = sc.Communicator(transport, layout, ratio=args.ratio, mask="cyclic", value_dtype=args.value_dtype, seed=3)
    else:
        comm = sc.Communicator(transport, layout, ratio=1.0, seed=3)
    opt = None
    if args.optimizer and args.method == "slamb":
        from slamb_comm.slamb import Slamb

        opt = Slamb(comm, lr=0.01, weight_decay=0.01, beta3=0.9, sync_interval=args.sync_interval)
    lamb = _Lamb(layout, np) if args.optimizer and args.method != "slamb" else None
    gbuf = np.empty(n, np.float32)
    m = grads[0].copy()
    parts = []  # Traffic of the timed exchanges (encode / comm / decode split)

    def nic():
        try:  # inside an emulated node this is the node's own link; elsewhere not meaningful
            with open("/sys/class/net/eth0/statistics/tx_bytes") as fh:
                return int(fh.read())
        except OSError:
            return 0

    def compute():
        for _ in range(args.matmuls):
            a @ a

    step_t, comp_t, sync_t = [], [], []
    total = args.warmup + args.steps
    for t in range(1, total + 1):
        g = grads[t % 2]
        if t == args.warmup + 1:
            tx0 = nic()
        world.Barrier()
        t0 = time.perf_counter()
        compute()
        t1 = time.perf_counter()
        synced = 0.0
        if args.method == "slamb":
            if opt is not None:
                before = comm.stats.by_kind.get("sync")
                opt.step(x, g)
                after = comm.stats.by_kind.get("sync")
                if after is not None and (before is None or after.calls > before.calls):
                    synced = (after.comm_s + after.encode_s + after.decode_s) - (
                        0 if before is None else before.comm_s + before.encode_s + before.decode_s)
            else:  # the exchange alone: SLAMB's momentum masked allreduce (m's values do not matter)
                comm.masked_allreduce(m, t)
                parts.append(comm.stats.last)
                if (t - 1) % args.sync_interval == 0:
                    ts = time.perf_counter()
                    comm.sync(x)
                    synced = time.perf_counter() - ts
        elif args.method == "dense":
            gbuf[...] = g
            comm.sync(gbuf)
            parts.append(comm.stats.last)
            if lamb is not None:
                lamb.step(x, gbuf)
        else:  # dense_hvd
            tg = torch.from_numpy(gbuf)
            gbuf[...] = g
            hvd.allreduce_(tg, op=hvd.Average, name="grad")
            if lamb is not None:
                lamb.step(x, gbuf)
        t2 = time.perf_counter()
        if t > args.warmup:
            step_t.append(t2 - t0 - synced)  # the sync step's sync is amortised below instead
            comp_t.append(t1 - t0)
        if synced:
            sync_t.append(synced)
    tx = nic() - tx0
    fields3 = ("encode_s", "comm_s", "decode_s")
    if opt is not None:
        tot = comm.stats.by_kind["masked_allreduce"]
        split = [getattr(tot, f) / tot.calls for f in fields3]
    elif parts:
        split = [statistics.median(getattr(p, f) for p in parts[-len(step_t):]) for f in fields3]
    else:
        split = [float("nan")] * 3
    split_all = world.gather(split, root=0)
    tx_all = world.gather(tx, root=0)
    # slowest rank per step
    step_all = world.gather(step_t, root=0)
    comp_all = world.gather(comp_t, root=0)
    sync_all = world.gather(sync_t, root=0)
    if world.rank != 0:
        return
    steps = [max(v) for v in zip(*step_all)]
    comps = [max(v) for v in zip(*comp_all)]
    med = statistics.median(steps)
    sync_s = max(statistics.median(s) for s in sync_all) if sync_all and all(sync_all) else 0.0
    amort = med + (sync_s / args.sync_interval if args.method == "slamb" else 0.0)
    k = comm.stats.by_kind
    ex = k.get("masked_allreduce") if args.method == "slamb" else k.get("sync")
    if args.method == "dense_hvd":
        payload = 4 * n
    else:
        payload = ex.payload_bytes / ex.calls if ex else 0
    if args.method == "slamb":
        payload += 4 * (n + 1) / args.sync_interval  # the periodic sync, amortised
    res = {
        "method": args.method, "optimizer": int(bool(args.optimizer)), "ranks": P, "elements": n,
        "ratio": args.ratio if args.method == "slamb" else 1.0,
        "value_dtype": args.value_dtype if args.method == "slamb" else "float32",
        "sync_interval": args.sync_interval, "steps": len(steps),
        "step_median_s": med, "step_p25_s": float(np.percentile(steps, 25)), "step_p75_s": float(np.percentile(steps, 75)),
        "sync_s": sync_s, "step_amortised_s": amort, "compute_median_s": statistics.median(comps),
        "payload_bytes_per_step": payload, "dense_payload_bytes": 4 * n,
        "wire_bytes_per_step": payload * 2 * (P - 1) / P,
        "encode_s": max(v[0] for v in split_all), "comm_s": max(v[1] for v in split_all),
        "decode_s": max(v[2] for v in split_all),
        "nic_tx_bytes_per_node_per_step": statistics.mean(tx_all) / len(steps) if os.environ.get("SLAMBX_NODE") else float("nan"),
    }
    print("RESULT " + json.dumps(res), flush=True)


class _Lamb:
    """Plain LAMB (bias-corrected Adam direction, per-tensor trust ratio) on a fused buffer."""

    def __init__(self, layout, np):
        self.np = np
        n = layout.total
        self.m = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)
        self.t = 0
        self.starts = np.asarray(layout.offsets)
        self.sizes = np.asarray(layout.sizes)

    def step(self, x, g, lr=0.01, b1=0.9, b2=0.999, eps=1e-6, wd=0.01):
        np = self.np
        self.t += 1
        self.m *= b1
        self.m += (1 - b1) * g
        self.v *= b2
        self.v += (1 - b2) * g * g
        u = self.m / (1 - b1**self.t)
        d = np.sqrt(self.v / (1 - b2**self.t))
        d += eps
        u /= d
        u += wd * x
        xn = np.sqrt(np.add.reduceat(x * x, self.starts))
        un = np.sqrt(np.add.reduceat(u * u, self.starts))
        phi = np.where((xn > 0) & (un > 0), np.clip(xn / np.where(un > 0, un, 1), 0.01, 1000), 1.0)
        u *= np.repeat((lr * phi).astype(np.float32), self.sizes)
        x -= u


# ====================================================================== bench (root)
def run_loop_local(np_, loop_args, timeout):
    """The same loop without emulation: plain mpirun on this machine (shared memory)."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(np_), str(timeout), sys.executable,
           os.path.abspath(__file__), "loop", *loop_args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout + 60)
    return p.returncode, p.stdout, p.stderr


def parse_result(out):
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def bench_main(args):
    nodes_list = [int(v) for v in args.nodes.split(",")]
    rates = [r.strip() for r in args.rates.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    rows = []
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    base_loop = ["--log2", str(args.log2), "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--matmuls", str(args.matmuls), "--matmul-dim", str(args.matmul_dim),
                 "--sync-interval", str(args.sync_interval)] + (["--optimizer"] if args.optimizer else [])
    for nodes in nodes_list:
        for rate in rates:
            if rate == "local":
                for m in methods:
                    rc, out, err = run_loop_local(nodes, base_loop + ["--method", m], args.timeout)
                    _collect(rows, nodes, rate, m, rc, out, err)
                continue
            with Cluster(nodes, rate=rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet) as cl:
                for m in methods:
                    rc, out, err = cl.mpirun([sys.executable, os.path.abspath(__file__), "loop", *base_loop,
                                              "--method", m], timeout=args.timeout)
                    _collect(rows, nodes, rate, m, rc, out, err)
            write_rows(rows, args.out)
    write_rows(rows, args.out)
    print(cluster_table(rows))
    print(f"wrote {args.out}")
    if not args.no_plot:
        print(f"wrote {plot_cluster(rows, os.path.splitext(args.out)[0] + '.png')}")
    return 0 if all(r.get("ok") for r in rows) else 1


def _collect(rows, nodes, rate, method, rc, out, err):
    res = parse_result(out)
    if rc != 0 or res is None:
        print(f"[bench] {nodes} nodes {rate} {method}: FAILED rc={rc}\n{out[-2000:]}\n{err[-3000:]}", file=sys.stderr)
        rows.append({"nodes": nodes, "link": rate, "method": method, "ok": 0})
        return
    res.update({"nodes": nodes, "link": rate, "ok": 1})
    rows.append(res)
    print(f"[bench] {nodes} nodes, link {rate}, {method}: step {res['step_amortised_s'] * 1e3:.1f} ms "
          f"(compute {res['compute_median_s'] * 1e3:.1f} ms)", file=sys.stderr, flush=True)


def cluster_table(rows):
    out = ["| nodes | link per node | method | step ms, median [p25, p75] | compute ms | payload / step | "
           "NIC tx / node / step | exchange encode / comm / decode ms | step / dense |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not int(r.get("ok", 0)):
            out.append(f"| {r['nodes']} | {r['link']} | {r['method']} | FAILED | | | | | |")
            continue
        dense = next((d for d in rows if int(d.get("ok", 0)) and d["nodes"] == r["nodes"] and d["link"] == r["link"]
                      and d["method"] == "dense" and int(d["optimizer"]) == int(r["optimizer"])), None)
        rel = float(r["step_amortised_s"]) / float(dense["step_amortised_s"]) if dense else float("nan")
        tx = float(r.get("nic_tx_bytes_per_node_per_step", "nan") or "nan")
        am = float(r["step_amortised_s"]) - float(r["step_median_s"])  # the sync's share, slamb only
        out.append(
            f"| {r['nodes']} | {r['link']} | {r['method']}{' + optimizer' if int(r['optimizer']) else ''} | "
            f"{float(r['step_amortised_s']) * 1e3:.0f} [{(float(r['step_p25_s']) + am) * 1e3:.0f}, "
            f"{(float(r['step_p75_s']) + am) * 1e3:.0f}] | {float(r['compute_median_s']) * 1e3:.0f} | "
            f"{float(r['payload_bytes_per_step']) / 1e6:.2f} MB | "
            f"{'-' if math.isnan(tx) else f'{tx / 1e6:.2f} MB'} | {_ms3(r)} | {rel:.2f} |")
    return "\n".join(out)


def _ms3(r):
    v = [float(r.get(k, "nan") or "nan") for k in ("encode_s", "comm_s", "decode_s")]
    return "-" if any(math.isnan(x) for x in v) else " / ".join(f"{x * 1e3:.0f}" for x in v)


def plot_cluster(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if int(r.get("ok", 0))]
    def link_order(link):
        return {"none": 1e30, "local": 1e31}.get(link) or _rate_bps(link)

    groups = sorted({(int(r["nodes"]), r["link"]) for r in ok}, key=lambda g: (g[0], link_order(g[1])))
    methods = sorted({r["method"] for r in ok}, key=lambda m: ["dense", "dense_hvd", "slamb"].index(m)
                     if m in ("dense", "dense_hvd", "slamb") else 9)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 4.3))
    w = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs, ys, cs = [], [], []
        for i, g in enumerate(groups):
            r = next((r for r in ok if (int(r["nodes"]), r["link"]) == g and r["method"] == m), None)
            if r:
                xs.append(i + (j - (len(methods) - 1) / 2) * w)
                ys.append(float(r["step_amortised_s"]) * 1e3)
                cs.append(float(r["compute_median_s"]) * 1e3)
        ax.bar(xs, ys, w, label=m)
        ax.bar(xs, cs, w, fill=False, hatch="//", edgecolor="k", lw=0.5)
        if m != "dense":
            for xv, yv, g in zip(xs, ys, [g for g in groups if any(
                    (int(r["nodes"]), r["link"]) == g and r["method"] == m for r in ok)]):
                d = next((r for r in ok if (int(r["nodes"]), r["link"]) == g and r["method"] == "dense"), None)
                if d:
                    ax.text(xv, yv, f"{yv / (float(d['step_amortised_s']) * 1e3):.2f}x", ha="center",
                            va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{n} nodes\n{l}" for n, l in groups], fontsize=8)
    ax.set_ylabel("step time, ms (median of slowest rank)\nlabels: step / dense step")
    n = int(ok[0]["elements"]) if ok else 0
    opt = ok and int(ok[0].get("optimizer", 0))
    what = ("dense = fused fp32 allreduce + NumPy LAMB; slamb = Slamb.step (k=0.1 fp16, sync every H)" if opt else
            "dense = fused fp32 allreduce; slamb = masked allreduce k=0.1 fp16 + sync/H")
    ax.set_title(f"emulated cluster (netns + tc tbf per node link, TCP), {n / 2**20:g}M fp32 elements\n"
                 f"{what}\nhatched = compute; 'none' = netns without rate limit; 'local' = plain mpirun, shared memory",
                 fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ====================================================================== end-to-end LM
def lm_main(args):
    """``examples/train_lm.py`` with each optimizer on each link: median step time and bytes."""
    rows = []
    train = [sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), "--steps", str(args.steps),
             "--eval-every", str(10 * args.steps), "--eval-batches", "1", "--no-progress", "--threads", "1",
             "--d-model", str(args.d_model), "--layers", str(args.layers), "--batch", str(args.batch),
             "--context", str(args.context), "--files", str(args.files), "--ratio", str(args.ratio),
             "--value-dtype", args.value_dtype, "--lr", "0.01"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="slamb_lm_")
    for rate in (r.strip() for r in args.rates.split(",")):
        net = contextlib.nullcontext() if rate == "local" else Cluster(
            args.nodes, rate=rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet)
        with net as cluster:
            for opt in (o.strip() for o in args.optimizers.split(",")):
                out_csv = os.path.join(tmp, f"{rate}_{opt}.csv")
                cmd = train + ["--optimizer", opt, "--csv", out_csv]
                if cluster is None:
                    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(args.nodes),
                                        str(args.timeout), *cmd], capture_output=True, text=True, cwd=ROOT,
                                       timeout=args.timeout + 60)
                    rc, out, err = p.returncode, p.stdout, p.stderr
                else:
                    rc, out, err = cluster.mpirun(cmd, timeout=args.timeout)
                row = {"nodes": args.nodes, "link": rate, "optimizer": opt, "ok": 0}
                if rc == 0 and os.path.exists(out_csv):
                    with open(out_csv) as fh:
                        last = list(csv.DictReader(fh))[-1]
                    n = int(last["step"])
                    row.update(ok=1, steps=n, step_ms_median=float(last["step_ms_median"]),
                               payload_bytes_per_step=float(last["bytes"]) / n,
                               dense_bytes_per_step=float(last["dense_bytes"]) / n,
                               params=int(float(last["dense_bytes"]) / n / 4), val_loss=float(last["val_loss"]))
                    print(f"[lm] {args.nodes} nodes, link {rate}, {opt}: median step {row['step_ms_median']:.0f} ms, "
                          f"{row['payload_bytes_per_step'] / 1e6:.2f} MB/step", file=sys.stderr, flush=True)
                else:
                    print(f"[lm] {rate} {opt}: FAILED rc={rc}\n{out[-2000:]}\n{err[-3000:]}", file=sys.stderr)
                rows.append(row)
                write_rows(rows, args.out)
    shutil.rmtree(tmp, ignore_errors=True)
    print(lm_table(rows))
    print(f"wrote {args.out}")
    if not args.no_plot:
        print(f"wrote {plot_lm(rows, os.path.splitext(args.out)[0] + '.png')}")
    return 0 if rows and all(r["ok"] for r in rows) else 1


def lm_table(rows):
    out = ["| nodes | link per node | optimizer | median step ms | step / dense LAMB | payload / step | "
           "payload / dense |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not int(r.get("ok", 0)):
            out.append(f"| {r['nodes']} | {r['link']} | {r['optimizer']} | FAILED | | | |")
            continue
        base = next((d for d in rows if int(d.get("ok", 0)) and d["link"] == r["link"] and d["optimizer"] == "lamb"),
                    None)
        rel = float(r["step_ms_median"]) / float(base["step_ms_median"]) if base else float("nan")
        out.append(f"| {r['nodes']} | {r['link']} | {r['optimizer']} | {float(r['step_ms_median']):.0f} | {rel:.2f} | "
                   f"{float(r['payload_bytes_per_step']) / 1e6:.2f} MB | "
                   f"{float(r['payload_bytes_per_step']) / float(r['dense_bytes_per_step']):.3f} |")
    return "\n".join(out)


def plot_lm(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if int(r.get("ok", 0))]
    links = list(dict.fromkeys(r["link"] for r in ok))
    opts = list(dict.fromkeys(r["optimizer"] for r in ok))
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / max(1, len(opts))
    for j, o in enumerate(opts):
        for i, link in enumerate(links):
            r = next((r for r in ok if r["link"] == link and r["optimizer"] == o), None)
            base = next((r for r in ok if r["link"] == link and r["optimizer"] == "lamb"), None)
            if r is None:
                continue
            x, y = i + (j - (len(opts) - 1) / 2) * w, float(r["step_ms_median"])
            ax.bar(x, y, w, color=f"C{j}", label=o if i == 0 else None)
            if base is not None:
                ax.text(x, y, f"{y / float(base['step_ms_median']):.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(links)))
    ax.set_xticklabels(links)
    ax.set_ylabel("median training step, ms (labels: / dense LAMB)")
    p = int(ok[0]["params"]) if ok else 0
    ax.set_title(f"train_lm.py, {ok[0]['nodes'] if ok else '?'} ranks, {p / 1e6:.1f}M parameters; emulated node links "
                 f"(netns + tbf, TCP)\n'local' = plain mpirun on one machine (shared memory)", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ====================================================================== CLI
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
        q.add_argument("--optimizer", action="store_true", help="include the optimizer update (LAMB / Slamb.step)")
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
        rows = []
        for path in args.csvs:
            with open(path) as fh:
                rows += list(csv.DictReader(fh))
        print(cluster_table(rows))
        print(f"wrote {plot_cluster(rows, args.png or os.path.splitext(args.csvs[0])[0] + '.png')}")
        return 0
    try:
        if args.cmd == "cleanup":
            if os.geteuid() != 0:
                raise ClusterError("cleanup needs root")
            import re

            pat = re.compile(re.escape(args.prefix) + r"-(n\d+|br)$")
            stale = Cluster(1, prefix=args.prefix, verbose=True)
            stale.created = sorted(n for n in _existing_netns() if pat.match(n))
            print(f"deleting {stale.created or 'nothing'}")
            stale.down()
            return 0
        if args.cmd == "check":
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
        if args.cmd == "run":
            cmd = args.command[1:] if args.command and args.command[0] == "--" else args.command
            if not cmd:
                print("run: give a command after --", file=sys.stderr)
                return 2
            with Cluster(args.nodes, rate=args.rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet) as cl:
                rc, out, err = cl.mpirun(cmd, timeout=args.timeout)
                sys.stdout.write(out)
                sys.stderr.write(err)
                return rc
        if args.cmd == "bench":
            return bench_main(args)
        if args.cmd == "lm":
            return lm_main(args)
    except ClusterError as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
