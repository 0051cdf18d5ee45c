"""Lightning's FSDP2 path for tests/test_fsdp_launchers.py: SlambModelParallelStrategy + HybridSLAMB
under a real Trainer, 4 ranks (a 2 x 2 mesh) under torchrun, gloo on CPU.

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.support.fsdp_framework_job OUT_DIR

Run A trains 2 epochs of 4 steps (sync_interval 7: the replicas are averaged after steps 1
and 8) with a ModelCheckpoint at the end of each epoch; run B, a new Trainer and module in the
same processes, resumes A's first checkpoint with ``fit(ckpt_path=...)``. Each rank writes
``OUT_DIR/job.<rank>.json``: its losses, a digest of its pieces after every step, the bytes of
every step, and whether B ended bitwise where A did; rank 0 also writes ``OUT_DIR/full.pt``, A's
final model gathered whole.
"""

import hashlib
import json
import os
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.fsdp import fully_shard

from slamb_comm.adapters.lightning import SlambModelParallelStrategy
from slamb_comm.adapters.torch import HybridSLAMB

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
torch.set_num_threads(1)
BATCH, STEPS_PER_EPOCH, RANKS, H = 16, 4, 4, 7  # SLAMB syncs the replicas after steps 1 and 8


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 4))


def dataset():
    """Every rank's batches (Lightning's sampler gives each rank its own quarter)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(RANKS * STEPS_PER_EPOCH * BATCH, 16, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(2.0 * x[:, :4]) + 0.5 * x[:, 4:8])


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = make_model()

    def configure_model(self):  # a stock FSDP2 module would shard over self.device_mesh["data_parallel"]
        for i in (0, 2, 4):
            fully_shard(self.model[i], mesh=self.device_mesh["shard"])
        fully_shard(self.model, mesh=self.device_mesh["shard"])

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return HybridSLAMB(self, self.device_mesh, lr=0.02, ratio=0.25, dense_threshold=100, sync_interval=H, seed=3)


def pieces(module):
    return [p.to_local().detach().clone() for p in module.parameters()]


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


class Record(Callback):
    def __init__(self):
        self.losses, self.digests, self.traffic = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.digests.append(digest(pieces(module)))
        t = trainer.strategy.last_traffic
        self.traffic.append([t.payload_bytes, t.dense_payload_bytes])


def trainer(callbacks, **kwargs):
    return L.Trainer(accelerator="cpu", devices=RANKS, strategy=SlambModelParallelStrategy(replicas=2), max_epochs=2,
                     enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0,
                     callbacks=callbacks, **kwargs)


def main():
    out = sys.argv[1]
    ckpt_dir = os.path.join(out, "ckpt")
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)

    rec = Record()
    a = trainer([rec, ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)])
    net_a = Net()
    a.fit(net_a, loader)
    rank = dist.get_rank()
    mesh = net_a.device_mesh
    final = pieces(net_a)
    whole = {n: p.full_tensor().detach() for n, p in net_a.model.named_parameters()}  # over each shard group
    if rank == 0:
        torch.save(whole, os.path.join(out, "full.pt"))

    b = trainer([], enable_checkpointing=False)
    net_b = Net()
    b.fit(net_b, loader, ckpt_path=os.path.join(ckpt_dir, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"))
    resumed = pieces(net_b)

    res = {"rank": rank, "r": mesh["replicate"].get_local_rank(), "s": mesh["shard"].get_local_rank(),
           "mesh": list(mesh.shape), "losses": rec.losses, "digests": rec.digests, "traffic": rec.traffic,
           "steps": a.global_step, "resumed_steps": b.global_step,
           "resume_bitwise": all(torch.equal(x, y) for x, y in zip(final, resumed)),
           "checkpoints": sorted(os.listdir(ckpt_dir))}
    with open(os.path.join(out, f"job.{rank}.json"), "w") as f:
        json.dump(res, f)
    print(json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
