"""torchrun --nproc_per_node 2 benchmarks/integrations.py --framework lightning --out benchmarks/results/integrations_lightning.csv

Bytes per step and step time of slamb_comm under Lightning (``SlambDDPStrategy``) and Hugging
Face's ``transformers.Trainer`` (``SlambTrainer``), against the same framework's stock DDP with
AdamW, at 2 ranks on gloo, one thread per rank. The model is a 1.58M-parameter MLP (256 ->
1024 -> 1024 -> 256, GELU) regressing random targets, 64 samples per rank per step.

Arms, run one after the other within a repeat, the repeats interleaved (``--repeats``):

* ``dense``: stock DDP (Lightning's ``DDPStrategy`` / the stock ``Trainer``) with AdamW: the
  baseline of the ratios;
* ``slamb``: SLAMB, ratio 0.1, H = 100 (Lightning: ``configure_optimizers`` returns ``SLAMB``;
  Trainer: ``SlambTrainer(slamb={...})``, whose default ``max_grad_norm=1.0`` moves the
  exchange into ``step()``);
* ``topk``: top-k with error feedback, TopK(0.01), under the same AdamW.

A step's time is the mean over the steps after ``--warmup`` (from the framework's end-of-step
callback); bytes are the last step's payload against a dense fp32 allreduce of every gradient
(``step_traffic()``). Writes a CSV (one row per arm and repeat) and prints a markdown table on
rank 0: medians and ranges of the per-repeat ratios.
"""

import argparse
import os
import sys
import time
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from csvout import write_rows  # noqa: E402

ARMS = ("dense", "slamb", "topk")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                               torch.nn.GELU(), torch.nn.Linear(1024, 256))


def traffic_of(owner):
    """The last optimizer step's bytes as slamb_comm's adapters record them (``last_traffic`` of
    ``SlambDDPStrategy`` / ``SlambTrainer``, which read ``step_traffic()`` at every step), or None
    for the stock strategy and Trainer (the dense arm)."""
    return getattr(owner, "last_traffic", None)


def run_lightning(arm, args, rank):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import slamb_comm
    from slamb_comm.adapters import torch as st
    from slamb_comm.adapters.lightning import SlambDDPStrategy

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, b, i):
            return torch.nn.functional.mse_loss(self.net(b[0]), b[1])

        def configure_optimizers(self):
            if arm == "slamb":
                return st.SLAMB(self.parameters(), lr=1e-3, ratio=0.1, sync_interval=100)
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    strat = {"dense": lambda: DDPStrategy(), "slamb": lambda: SlambDDPStrategy(),
             "topk": lambda: SlambDDPStrategy(compression=slamb_comm.TopK(0.01))}[arm]()
    times, traffic = [], []

    class Clock(L.Callback):
        def on_train_batch_end(self, *a):
            times.append(time.perf_counter())
            traffic.append(traffic_of(strat))

    g = torch.Generator().manual_seed(rank)
    n = (args.steps + 1) * 64
    ds = torch.utils.data.TensorDataset(torch.randn(n, 256, generator=g), torch.randn(n, 256, generator=g))
    L.Trainer(strategy=strat, accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False, callbacks=[Clock()]).fit(Net(), torch.utils.data.DataLoader(ds, 64))
    return times, traffic


def run_trainer(arm, args, rank):
    import transformers

    import slamb_comm
    from slamb_comm.adapters import huggingface as hf

    transformers.logging.set_verbosity_error()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    g = torch.Generator().manual_seed(0)
    n = (args.steps + 1) * 128
    X, Y = torch.randn(n, 256, generator=g), torch.randn(n, 256, generator=g)
    ds = [{"x": a, "labels": b} for a, b in zip(X, Y)]
    targs = transformers.TrainingArguments(
        output_dir=os.path.join(args.tmp, f"trainer_{arm}"), per_device_train_batch_size=64, max_steps=args.steps,
        learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        ddp_backend="gloo", remove_unused_columns=False)
    cls, kw = {"dense": (transformers.Trainer, {}),
               "slamb": (hf.SlambTrainer, {"slamb": {"ratio": 0.1, "sync_interval": 100}}),
               "topk": (hf.SlambTrainer, {"compression": slamb_comm.TopK(0.01)})}[arm]
    trainer = cls(model=Net(), args=targs, train_dataset=ds, **kw)
    times, traffic = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            times.append(time.perf_counter())
            traffic.append(traffic_of(trainer))

    trainer.add_callback(Clock())
    trainer.train()
    return times, traffic


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--framework", choices=["lightning", "trainer"], required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tmp", default="/tmp/slamb_integrations")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.warmup + 2 > args.steps:
        ap.error("--steps must exceed --warmup by at least 2")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    run = run_lightning if args.framework == "lightning" else run_trainer
    rows = []
    for rep in range(args.repeats):
        got = {}
        for arm in ARMS:
            times, traffic = run(arm, args, rank)
            step = (times[-1] - times[args.warmup]) / (len(times) - 1 - args.warmup)
            last = traffic[-1]
            got[arm] = (step, last)
        for arm in ARMS:
            step, last = got[arm]
            rows.append({"framework": args.framework, "repeat": rep, "arm": arm, "step_ms": round(1e3 * step, 2),
                         "ratio_to_dense": round(step / got["dense"][0], 4),
                         "payload_bytes": None if last is None else last.payload_bytes,
                         "dense_bytes": None if last is None else last.dense_payload_bytes})
    if rank == 0:
        print(f"{args.framework}, 2 ranks, {args.repeats} interleaved repeats of {args.steps} steps "
              f"(timed after {args.warmup}); medians (ranges)\n")
        print("| arm | step | / stock DDP + AdamW | bytes per step / dense |")
        print("|---|---|---|---|")
        for arm in ARMS:
            rs = [r for r in rows if r["arm"] == arm]
            ms = [r["step_ms"] for r in rs]
            q = [r["ratio_to_dense"] for r in rs]
            b = rs[-1]
            frac = "1 (DDP's allreduce)" if b["payload_bytes"] is None else \
                f"{b['payload_bytes']:,} / {b['dense_bytes']:,} ({b['payload_bytes'] / b['dense_bytes']:.3f})"
            print(f"| {arm} | {np.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f}) | "
                  f"{np.median(q):.2f} ({min(q):.2f}-{max(q):.2f}) | {frac} |")
        if args.out:
            write_rows(rows, args.out)
            print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
