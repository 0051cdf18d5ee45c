"""An emulated N-node cluster out of network namespaces (the harness under ``cluster.py``).

Topology (everything lives in namespaces this module creates; the root namespace only
holds the mpirun launcher's parent, the calling script)::

    <prefix>-n0 (10.213.0.1, eth0) --veth-- h0 |
    <prefix>-n1 (10.213.0.2, eth0) --veth-- h1 |-- br0 in <prefix>-br
    ...                                        |

Each node's link is rate-limited in both directions with a ``tbf`` qdisc (node egress on
its ``eth0``, node ingress on the bridge-side ``h<i>``), like a full-duplex NIC on a
non-blocking switch; ``delay`` adds a ``netem`` latency where the kernel has netem.
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

:func:`mpirun_local` runs the same kind of job without emulation (plain mpirun on this
machine, shared memory): the ``local`` link of the experiments.
"""

import atexit
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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
            bps = rate_bps(self.rate)
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
               ("plm_rsh_no_tree_spawn", "1"), ("btl_vader_single_copy_mechanism", "none"),
               # emulated nodes share this machine's cores: a rank waiting on the network yields
               # its core instead of busy-polling TCP (which slowed every rank's compute by
               # ~40%: the 1 Gbit/s step's excess was CPU contention, not bandwidth)
               ("mpi_yield_when_idle", "1"), *extra_mca]
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


def rate_bps(rate):
    s = rate.lower().rstrip("ps").rstrip("/")
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for u, f in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    raise ClusterError(f"rate {rate!r}: use e.g. 100mbit, 1gbit, 10gbit")


def cleanup(prefix):
    """After a ``kill -9``: delete the ``<prefix>-n<i>`` / ``<prefix>-br`` namespaces and their processes."""
    if os.geteuid() != 0:
        raise ClusterError("cleanup needs root")
    pat = re.compile(re.escape(prefix) + r"-(n\d+|br)$")
    stale = Cluster(1, prefix=prefix, verbose=True)
    stale.created = sorted(n for n in _existing_netns() if pat.match(n))
    print(f"deleting {stale.created or 'nothing'}")
    stale.down()


def mpirun_local(np_, cmd, timeout):
    """``cmd`` under plain mpirun on this machine (no emulation); returns (returncode, stdout, stderr)."""
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(np_), str(timeout), *cmd],
                       capture_output=True, text=True, cwd=ROOT, timeout=timeout + 60)
    return p.returncode, p.stdout, p.stderr
