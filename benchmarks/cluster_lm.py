"""The end-to-end benchmark on the emulated cluster (``cluster.py lm``).

``examples/train_lm.py`` (Horovod, PyTorch), scaled up with ``--d-model``/``--layers``, for
each link rate (and ``local``: plain mpirun, no emulation) with dense LAMB over Horovod's
allreduce (``--optimizer lamb``) and SLAMB (``--optimizer slamb``, ratio 0.1, fp16
payload); reports the median training-step time (forward, backward, exchange, update) and
the bytes per step; CSV, PNG and a table.
"""

import contextlib
import csv
import os
import shutil
import sys
import tempfile

from csvout import write_rows
from netns import ROOT, Cluster, mpirun_local


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
                    rc, out, err = mpirun_local(args.nodes, cmd, args.timeout)
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


