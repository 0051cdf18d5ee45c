# OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/hsdp.py measure --out benchmarks/results/hsdp_bytes.csv
# OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/hsdp.py measure --d-model 512 --batch 1 \
#     --steps 12 --out benchmarks/results/hsdp_bytes_13m.csv    (bytes and memory at the timing size)
# sudo python3 benchmarks/hsdp.py time --rates 1gbit,10gbit,none --repeats 3 --arms hsdp_adamw,hybrid_slamb,hybrid_slamb_overlap \
#     --out benchmarks/results/hsdp_time.csv
# sudo python3 benchmarks/hsdp.py cleanup --prefix slambh   (only after a kill -9 left namespaces behind)
"""HybridSLAMB across the replicas of an FSDP2 model against stock HSDP + AdamW: bytes, memory, step time.

The model is a small GPT-like transformer (:func:`gpt`: token and position embeddings, pre-norm
blocks of causal self-attention and a 4x MLP, a final norm and an untied head), each block and the
root sharded by FSDP2's ``fully_shard``, on a 2 x 2 ``(replicate, shard)`` mesh of 4 CPU ranks
(gloo, one thread each). The arms, each a fresh model and optimizer:

* ``hsdp_adamw`` -- stock HSDP: ``fully_shard(block, mesh=mesh)`` on the 2-D mesh, so FSDP2
  reduce-scatters each gradient in its shard group and all-reduces every gradient piece across
  the replicas (float32, densely), and ``torch.optim.AdamW(foreach=True)``: the baseline;
* ``hybrid_slamb`` -- ``fully_shard(block, mesh=mesh["shard"])`` (no replica allreduce) and
  ``HybridSLAMB(model, mesh, ratio=0.1, value_dtype="float16", sync_interval=100, overlap=False)``, which
  exchanges the momentum of each rank's pieces sparsely across the replicas in ``step()``;
* ``hybrid_slamb_overlap`` (``--arms``, not run unless named) -- the same with ``overlap=True``: each FSDP
  module's exchange starts during the backward pass (adapters/torch/fsdp/overlap.py).

Sub-commands:

* ``measure`` (under ``torchrun --standalone --nproc_per_node 4``): **bytes** and **memory**.
  Every ``torch.distributed`` collective is wrapped for the run and its send tensor's bytes are
  counted per group (``replicate``: the ranks that hold the same pieces; ``shard``; ``world``),
  from after the optimizer's construction on; each arm runs ``--steps`` steps (default 100 = one
  period of the parameter sync, which comes at step 1). Per rank: the replica bytes measured at
  each step, HybridSLAMB's own count (``step_traffic()``), and HSDP's replica allreduce counted
  from the model's sizes (every local gradient piece, float32: ``N_piece * 4`` bytes per step).
  Memory: the bytes of every array and tensor the optimizer keeps (``opt.state``; for
  HybridSLAMB also its engines' core rule: m, v, scratch buffers, payloads, masks; for AdamW
  exp_avg, exp_avg_sq, step), each storage counted once and the parameters' and gradients' own
  storage excluded, per local parameter element; the process's RSS growth from the optimizer
  (construction plus first step) and the transient peak during a later ``opt.step()`` (VmHWM
  after a reset through ``/proc/self/clear_refs``; glibc's mmap threshold is pinned at 64 KiB
  so that freed arrays leave the RSS). Writes ``<out>`` (bytes, one row per arm and rank) and
  ``<out>`` with ``bytes`` replaced by ``memory``; prints markdown tables.
* ``time`` (root): **step time** on an emulated 2 nodes x 2 ranks (``netns.py``: a namespace
  per node, veth to a bridge, ``tbf`` on each node link at ``--rates``). One ``torchrun
  --nnodes 2 --node_rank i --master_addr <node 0>`` per namespace runs ``steps``; the two ranks
  of a node form a shard group (they talk over the node's own loopback), the replica groups
  [0, 2] and [1, 3] cross the rate-limited link. Per rate and repeat (a fresh job, started when
  the 1-minute load is below ``--max-load``; the load seen is in the CSV), both arms, in
  alternating order, ``--warmup`` untimed steps (the first is HybridSLAMB's sync step, timed
  apart) then ``--steps`` timed steps: the slowest rank's wall time per step. Each node's
  ``eth0`` byte counters say what crossed the link per step. Writes ``<out>`` (one row per rate,
  repeat and arm) and prints the ratios (medians and ranges over the repeats).
* ``steps``: the timing job (under the per-node ``torchrun``s that ``time`` starts).
* ``cleanup``: delete ``<prefix>-n<i>``/``<prefix>-br`` namespaces left by a ``kill -9``.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from csvout import write_rows  # noqa: E402
from hsdp_costs import (CollectiveMeter, bytes_table, memory_table, optimizer_bytes, peak_bytes,  # noqa: E402
                        pin_mmap_threshold, reset_peak, rss_bytes, time_table)

ARMS = ("hsdp_adamw", "hybrid_slamb")  # the default --arms; also "hybrid_slamb_overlap"
BASE = "hsdp_adamw"


# ====================================================================== the model
def gpt(vocab, d_model, n_layers, n_heads, context):
    """A GPT-like causal language model: embeddings, ``n_layers`` pre-norm blocks (attention, 4x
    MLP), final norm, untied head. ``model.blocks`` are the units ``fully_shard`` wraps."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, n_heads, d // n_heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, idx):
            h = self.embed(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.norm(h))

    return GPT()


def model_args(args):
    return dict(vocab=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                context=args.context)


def build_model(arm, args, mesh):
    """A fresh model (the same initial weights for both arms), sharded as ``arm`` shards it."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = gpt(**model_args(args))
    where = mesh if arm == BASE else mesh["shard"]
    for blk in model.blocks:
        fully_shard(blk, mesh=where)
    fully_shard(model, mesh=where)
    return model


def make_optimizer(arm, args, mesh, model):
    import torch

    from slamb_comm.adapters import torch as st

    if arm == BASE:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    return st.HybridSLAMB(model, mesh, lr=2e-3, weight_decay=0.01, ratio=args.ratio, value_dtype=args.value_dtype,
                          sync_interval=args.sync_interval, overlap=arm == "hybrid_slamb_overlap")


def build(arm, args, mesh):
    """A fresh sharded model and its optimizer for ``arm``."""
    model = build_model(arm, args, mesh)
    return model, make_optimizer(arm, args, mesh, model)


def batches(args, rank, n=4):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=gen) for _ in range(n)]


def forward_backward(model, b):
    import torch

    logits = model(b[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
    loss.backward()
    return loss


def local_elements(model):
    from slamb_comm.adapters.torch.tensors import local_of

    return sum(local_of(p).numel() for p in model.parameters())


def mesh_2x2(R, S):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))




# ====================================================================== memory


# ====================================================================== measure (bytes + memory)
def measure_arm(arm, args, mesh, meter, steps):
    import torch.distributed as dist

    rank = dist.get_rank()
    gc.collect()
    model = build_model(arm, args, mesh)
    gc.collect()
    rss_model = rss_bytes()
    opt = make_optimizer(arm, args, mesh, model)
    rss_build = rss_bytes() - rss_model  # HybridSLAMB allocates its state here, AdamW at its first step
    meter.take()  # the construction's broadcast and agreement are not step traffic
    data = batches(args, rank)
    per_step, traffic = [], []
    rss_first = peak = None
    for i in range(steps):
        opt.zero_grad()
        forward_backward(model, data[i % len(data)])
        before = rss_bytes()
        if i == args.peak_step:
            reset_peak()
        opt.step()
        if i == 0:
            rss_first = rss_bytes() - before
        if i == args.peak_step:
            peak = peak_bytes() - before
        per_step.append(meter.take()[0])
        tr = opt.step_traffic() if hasattr(opt, "step_traffic") else None
        traffic.append(None if tr is None else (tr.payload_bytes, tr.dense_payload_bytes))
    state_bytes, by_label = optimizer_bytes(opt, model)
    res = {"arm": arm, "rank": rank, "n_local": local_elements(model), "per_step": per_step, "traffic": traffic,
           "state_bytes": state_bytes, "by_label": by_label, "rss_build": rss_build, "rss_first_step": rss_first,
           "peak_step": peak, "n_tensors": sum(1 for _ in model.parameters())}
    del model, opt
    gc.collect()
    return res


def measure_main(args):
    import torch
    import torch.distributed as dist

    pinned = pin_mmap_threshold()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    R, S = args.replicas, world // args.replicas
    mesh = mesh_2x2(R, S)
    rep = [int(r) for r in mesh["replicate"].mesh.tolist()]
    shd = [int(r) for r in mesh["shard"].mesh.tolist()]
    meter = CollectiveMeter({"replicate": rep, "shard": shd, "world": list(range(world))}).install()
    results = []
    arms = args.arms.split(",")
    warm = argparse.Namespace(**{**vars(args), "d_model": 32, "layers": 1, "heads": 2, "peak_step": 1})
    for arm in arms if args.warm else ():  # a throwaway pass at a tiny size: imports, lazy init, allocator arenas
        measure_arm(arm, warm, mesh, meter, 3)
    for arm in arms:
        results.append(measure_arm(arm, args, mesh, meter, args.steps))
    meter.uninstall()
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        n_total = sum(p.numel() for p in gpt(**model_args(args)).parameters())
        brows, mrows = summarise(everyone, args, n_total, R, S, pinned)
        write_rows(brows, args.out)
        mem_out = memory_path(args.out)
        write_rows(mrows, mem_out)
        print(bytes_table(brows, args, n_total))
        print()
        print(memory_table(mrows))
        print(f"\nwrote {args.out} and {mem_out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def memory_path(out):
    d, b = os.path.split(out)
    return os.path.join(d, b.replace("bytes", "memory") if "bytes" in b else "memory_" + b)


def summarise(everyone, args, n_total, R, S, pinned):
    """Per arm and rank: the replica bytes (steady steps, the sync step, the period's mean) and the
    memory figures."""
    brows, mrows = [], []
    H = args.sync_interval
    for results in everyone:
        for r in results:
            rep = [b.get("replicate", 0) for b in r["per_step"]]
            steps = len(rep)
            sync_steps = [i for i in range(steps) if r["arm"] != BASE and i % H == 0]  # steps 1, H+1, ...
            steady = [rep[i] for i in range(steps) if i not in sync_steps]
            model_dense = 4 * r["n_local"]  # HSDP: every float32 gradient piece, all-reduced across replicas
            row = {"arm": r["arm"], "rank": r["rank"], "replicas": R, "shards": S, "params_total": n_total,
                   "params_local": r["n_local"], "tensors": r["n_tensors"], "steps": steps,
                   "ratio": args.ratio if r["arm"] != BASE else "", "value_dtype": args.value_dtype
                   if r["arm"] != BASE else "float32", "sync_interval": H if r["arm"] != BASE else "",
                   "hsdp_model_bytes_per_step": model_dense,
                   "replica_bytes_steady": statistics.mean(steady) if steady else "",
                   "replica_bytes_steady_min": min(steady) if steady else "",
                   "replica_bytes_steady_max": max(steady) if steady else "",
                   "replica_bytes_sync_step": rep[sync_steps[0]] if sync_steps else "",
                   "replica_bytes_mean_all": statistics.mean(rep),
                   "shard_bytes_per_step": statistics.mean(b.get("shard", 0) for b in r["per_step"]),
                   "other_bytes_per_step": statistics.mean(b.get("other", 0) + b.get("world", 0)
                                                           for b in r["per_step"])}
            if r["arm"] != BASE and steps >= H:  # the period average: exactly one sync in every H steps
                row["replica_bytes_period_mean"] = statistics.mean(rep[:H])
            elif r["arm"] != BASE and sync_steps and steady:  # composed: one sync step + (H - 1) steady ones
                row["replica_bytes_period_mean"] = (rep[0] + (H - 1) * statistics.mean(steady)) / H
            else:
                row["replica_bytes_period_mean"] = statistics.mean(rep)
            row["period_measured"] = int(r["arm"] == BASE or steps >= H)
            if r["traffic"][0] is not None:
                pay = [t[0] for t in r["traffic"]]
                row["step_traffic_payload_steady"] = statistics.mean(pay[i] for i in range(steps) if i not in
                                                                     sync_steps) if steady else ""
                row["step_traffic_payload_sync_step"] = pay[sync_steps[0]] if sync_steps else ""
                row["step_traffic_dense_per_step"] = r["traffic"][0][1]
            for key in ("steady", "sync_step", "period_mean"):
                v = row[f"replica_bytes_{key}" if key != "steady" else "replica_bytes_steady"]
                row[f"of_hsdp_{key}"] = v / model_dense if v != "" else ""
            brows.append(row)
            per = r["state_bytes"] / r["n_local"]
            mrows.append({"arm": r["arm"], "rank": r["rank"], "params_local": r["n_local"],
                          "state_bytes": r["state_bytes"], "state_bytes_per_param": per,
                          "state_breakdown": ";".join(f"{k}={v}" for k, v in sorted(r["by_label"].items())),
                          "rss_growth_build": r["rss_build"], "rss_growth_first_step": r["rss_first_step"],
                          "rss_growth_per_param": (r["rss_build"] + r["rss_first_step"]) / r["n_local"],
                          "rss_peak_in_step": r["peak_step"] if r["peak_step"] is not None else "",
                          "rss_peak_in_step_per_param": (r["peak_step"] / r["n_local"]) if r["peak_step"] is not None
                          else "", "peak_step_index": args.peak_step + 1, "mmap_threshold_pinned": int(pinned)})
    base = {m["rank"]: m for m in mrows if m["arm"] == BASE}
    for m in mrows:
        b = base.get(m["rank"])
        if b is not None:
            m["state_of_adamw"] = m["state_bytes_per_param"] / b["state_bytes_per_param"]
            m["rss_growth_of_adamw"] = (m["rss_growth_per_param"] / b["rss_growth_per_param"]
                                        if b["rss_growth_per_param"] > 0 else "")
    bbase = {r["rank"]: r for r in brows if r["arm"] == BASE}
    for r in brows:  # against HSDP's measured replica bytes too
        b = bbase.get(r["rank"])
        if b is not None:
            r["of_hsdp_measured_period_mean"] = r["replica_bytes_period_mean"] / b["replica_bytes_mean_all"]
    return brows, mrows


# ====================================================================== steps (the timing job, per node)
def read_counters():
    """This namespace's eth0 (tx, rx) bytes, or None (no eth0: not in an emulated node)."""
    try:
        base = "/sys/class/net/eth0/statistics/"
        with open(base + "tx_bytes") as a, open(base + "rx_bytes") as b:
            return int(a.read()), int(b.read())
    except OSError:
        return None


def time_arm(arm, args, mesh, rank):
    import torch
    import torch.distributed as dist

    model, opt = build(arm, args, mesh)
    data = batches(args, rank)
    first_ms = None

    def step(i):
        opt.zero_grad()
        forward_backward(model, data[i % len(data)])
        t = time.perf_counter()
        opt.step()
        return time.perf_counter() - t

    for i in range(args.warmup):
        dist.barrier()
        t0 = time.perf_counter()
        step(i)
        if i == 0:  # HybridSLAMB's sync step (step 1): timed apart, the slowest rank's
            first = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(first, op=dist.ReduceOp.MAX)
            first_ms = 1e3 * float(first[0])
    dist.barrier()
    c0 = read_counters()
    t0 = time.perf_counter()
    opt_s = 0.0
    for i in range(args.steps):
        opt_s += step(args.warmup + i)
    wall = time.perf_counter() - t0
    c1 = read_counters()
    mine = torch.tensor([wall / args.steps, opt_s / args.steps])
    worst = mine.clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    one_per_node = c0 is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0
    tx = torch.tensor([float(c1[0] - c0[0]) if one_per_node else 0.0])
    dist.all_reduce(tx)  # both nodes' eth0 tx bytes
    dist.barrier()
    return {"step_ms": 1e3 * float(worst[0]), "opt_ms_max": 1e3 * float(worst[1]), "first_step_ms": first_ms,
            "link_tx_bytes_per_step_per_node": float(tx[0]) / args.steps / 2}


def steps_main(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = mesh_2x2(args.replicas, world // args.replicas)
    arms = args.arms.split(",")
    if args.reverse:
        arms = arms[::-1]
    rows = []
    for arm in arms:
        r = time_arm(arm, args, mesh, rank)
        r.update(arm=arm)
        rows.append(r)
    if rank == 0:
        n_total = sum(p.numel() for p in gpt(**model_args(args)).parameters())
        for r in rows:
            r["params_total"] = n_total
        with open(args.json, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ====================================================================== time (root: the emulated 2 nodes)
def wait_for_load(max_load, poll=20.0, limit=600.0):
    """Poll the 1-minute load every ``poll`` s until it is below ``max_load`` (at most ``limit`` s);
    returns (load seen when starting, seconds waited)."""
    t0 = time.monotonic()
    while True:
        with open("/proc/loadavg") as fh:
            load = float(fh.read().split()[0])
        waited = time.monotonic() - t0
        if load < max_load or waited >= limit:
            return load, waited
        print(f"[hsdp] load {load:.2f} >= {max_load}: waiting ({waited:.0f} s so far)", file=sys.stderr, flush=True)
        time.sleep(poll)


def step_argv(args, out_json, reverse):
    return [sys.executable, os.path.join(HERE, "hsdp.py"), "steps", "--json", out_json, "--arms", args.arms,
            "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--context", str(args.context), "--batch", str(args.batch),
            "--ratio", str(args.ratio), "--value-dtype", args.value_dtype, "--sync-interval", str(args.sync_interval),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--replicas", "2"] + (
                ["--reverse"] if reverse else [])


def run_on_cluster(cl, args, out_json, reverse, port):
    """One torchrun per emulated node (2 ranks each); returns (rc, log tail)."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    procs, logs = [], []
    for node in range(2):
        argv = ["ip", "netns", "exec", cl.ns[node], sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node_rank", str(node), "--nproc_per_node", "2", "--master_addr", cl.addrs[0],
                "--master_port", str(port), *step_argv(args, out_json, reverse)[1:]]
        log = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        cl.procs.append(p)
        procs.append(p)
        logs.append(log)
    deadline = time.monotonic() + args.timeout
    rc = 0
    for p in procs:
        try:
            rc = rc or p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = 124
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    tails = []
    for node, log in enumerate(logs):
        log.seek(0)
        tails.append(f"--- node {node}:\n" + log.read()[-3000:])
        log.close()
    return rc, "\n".join(tails)


def time_main(args):
    from netns import Cluster, ClusterError

    rows = []
    tmp = tempfile.mkdtemp(prefix="slamb_hsdp_")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    failed = False
    try:
        for rep in range(args.repeats):
            for rate in rates:
                load, waited = wait_for_load(args.max_load)
                out_json = os.path.join(tmp, f"{rate}_{rep}.json")
                reverse = rep % 2 == 1  # arms alternate their order from one repeat to the next
                cl = Cluster(2, rate=None if rate == "none" else rate, prefix=args.prefix, subnet=args.subnet,
                             verbose=False)
                with cl:
                    t0 = time.monotonic()
                    rc, tail = run_on_cluster(cl, args, out_json, reverse, args.port)
                    took = time.monotonic() - t0
                if rc != 0 or not os.path.exists(out_json):
                    print(f"[hsdp] {rate} repeat {rep}: FAILED rc={rc}\n{tail}", file=sys.stderr, flush=True)
                    rows.append({"link": rate, "repeat": rep, "ok": 0, "load_before": load})
                    failed = True
                    continue
                with open(out_json) as fh:
                    got = json.load(fh)
                base = next(g for g in got if g["arm"] == BASE)
                for order, g in enumerate(got):
                    rows.append({"link": rate, "repeat": rep, "ok": 1, "arm": g["arm"], "order": order,
                                 "step_ms": round(g["step_ms"], 2), "opt_ms_max": round(g["opt_ms_max"], 2),
                                 "first_step_ms": round(g["first_step_ms"], 2),
                                 "ratio_to_hsdp_adamw": round(g["step_ms"] / base["step_ms"], 4),
                                 # the sync step (HybridSLAMB's first, with its one-off costs: an upper bound)
                                 # once in every H steps, against HSDP's steady step
                                 "ratio_incl_sync_bound": round((g["first_step_ms"] + (args.sync_interval - 1) *
                                                                 g["step_ms"]) / args.sync_interval / base["step_ms"],
                                                                4) if g["arm"] != BASE else 1.0,
                                 "link_tx_bytes_per_step_per_node": round(g["link_tx_bytes_per_step_per_node"]),
                                 "params_total": g["params_total"], "d_model": args.d_model, "layers": args.layers,
                                 "batch": args.batch, "context": args.context, "steps": args.steps,
                                 "warmup": args.warmup, "load_before": load, "waited_s": round(waited),
                                 "job_s": round(took, 1)})
                    print(f"[hsdp] {rate} repeat {rep} {g['arm']}: {g['step_ms']:.0f} ms/step "
                          f"(opt {g['opt_ms_max']:.0f} ms), link {g['link_tx_bytes_per_step_per_node'] / 1e6:.2f} "
                          f"MB/step/node, load before {load:.2f}", file=sys.stderr, flush=True)
                write_rows(rows, args.out)
    except ClusterError as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 3
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    write_rows(rows, args.out)
    print(time_table(rows))
    print(f"\nwrote {args.out}")
    return 1 if failed else 0


# ====================================================================== command line
def model_opts(p, d_model, layers, batch, context):
    p.add_argument("--d-model", type=int, default=d_model)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--context", type=int, default=context)
    p.add_argument("--batch", type=int, default=batch, help="sequences per rank")
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--value-dtype", default="float16")
    p.add_argument("--sync-interval", type=int, default=100)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--replicas", type=int, default=2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("measure", help="(under torchrun, 4 ranks) replica bytes and optimizer memory")
    model_opts(p, 256, 4, 2, 64)
    p.add_argument("--steps", type=int, default=100, help="steps per arm (100 = one sync period)")
    p.add_argument("--peak-step", type=int, default=2, help="0-based step whose opt.step() peak RSS is read")
    p.add_argument("--no-warm", dest="warm", action="store_false",
                   help="skip the throwaway pass at a tiny size before the measured arms (its RSS is less clean)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "hsdp_bytes.csv"))

    p = sub.add_parser("steps", help="(under the per-node torchruns of 'time') the timing job")
    model_opts(p, 512, 4, 1, 64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reverse", action="store_true", help="run the arms in reverse order")
    p.add_argument("--json", required=True)

    p = sub.add_parser("time", help="(root) step time on emulated 2 nodes x 2 ranks, per link rate")
    model_opts(p, 512, 4, 1, 64)
    p.add_argument("--rates", default="1gbit,10gbit,none", help="per-node link rates; 'none': no limit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-minute load is below this")
    p.add_argument("--timeout", type=int, default=400, help="seconds per job")
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--prefix", default="slambh", help="namespace-name prefix (must be unused)")
    p.add_argument("--subnet", default="10.214.0.0/24", help="private subnet used only inside the namespaces")
    p.add_argument("--out", default=os.path.join(HERE, "results", "hsdp_time.csv"))

    p = sub.add_parser("cleanup", help="after a kill -9: delete <prefix>-n<i> / <prefix>-br namespaces")
    p.add_argument("--prefix", default="slambh")

    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.cmd == "measure":
        return measure_main(args)
    if args.cmd == "steps":
        return steps_main(args)
    if args.cmd == "cleanup":
        from netns import cleanup

        cleanup(args.prefix)
        return 0
    return time_main(args)


if __name__ == "__main__":
    sys.exit(main())
