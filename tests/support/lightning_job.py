"""Lightning jobs for tests/test_lightning.py, run under torchrun at 2 ranks (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.support.lightning_job CASE OUT_DIR

Each case asserts on every rank and writes what it measured to ``OUT_DIR/CASE.<rank>.json``
(also printed); the test reads both ranks' files. The model and each rank's data are seeded: rank r's batches are
its own, identical in every run.
"""

import json
import os
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import slamb_comm
from slamb_comm.adapters import torch as st
from slamb_comm.adapters.lightning import SlambDDPStrategy
from .state_compare import averaged_from_two

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
torch.set_num_threads(1)
BATCH = 16


class Net(L.LightningModule):
    """A small regression MLP; ``make_opt(module)`` is what configure_optimizers returns."""

    def __init__(self, make_opt=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
        self.make_opt = make_opt

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return self.make_opt(self)


def data(rank, n_batches):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n_batches * BATCH, 16, generator=g)
    y = torch.tanh(x[:, :4] * 2.0) + 0.1 * torch.randn(n_batches * BATCH, 4, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def loader(rank, n_batches):
    return torch.utils.data.DataLoader(data(rank, n_batches), batch_size=BATCH, shuffle=False)


def trainer(strategy, out, **kw):
    base = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, use_distributed_sampler=False, default_root_dir=out)
    return L.Trainer(strategy=strategy, **{**base, **kw})


class Traffic(L.Callback):
    """Each optimizer step's bytes (a slamb_comm.Traffic), as the strategy recorded them (``last_traffic``)."""

    def __init__(self, strategy):
        self.strategy, self.steps = strategy, []

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.steps.append(self.strategy.last_traffic)


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def replicas_agree(module):
    return replicas_agree_tensor(flat(module))


def replicas_agree_tensor(x):
    both = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(both, x)
    return all(torch.equal(both[0], b) for b in both)


def slamb(**kw):
    kw = {"lr": 0.01, "ratio": 1.0, "beta3": 0.9, "dense_threshold": 100, "sync_interval": 4, "seed": 7, **kw}
    return lambda m: st.SLAMB(m.parameters(), **kw)


def manual_ddp_slamb(rank, steps, **kw):
    """The same training as a stock DDP loop with slamb_hook (the path mpi_tests/test_torch_dist.py
    compares with the dense reference of docs/algorithm.md section 1)."""
    model = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = st.DistributedOptimizer(slamb(**kw)(model), named_parameters=model.named_parameters())
    ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    for x, y in loader(rank, steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return model


def expect_error(fn, *needles):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 -- the message is what is checked
        msg = f"{type(err).__name__}: {err}"
        assert all(n in msg for n in needles), msg
        return msg
    raise AssertionError(f"no error; expected one naming {needles}")


def case_slamb(out, rank):
    """Ratio 1, H = 4, 9 steps: equal to the stock DDP + slamb_hook loop, replicas equal after the
    step-9 sync, the hook called every step; ratio 0.1: the bytes against dense."""
    res = {}
    model = Net(slamb())
    strategy = SlambDDPStrategy()
    trainer(strategy, out, max_steps=9).fit(model, loader(rank, 9))
    ref = manual_ddp_slamb(rank, 9)
    diff = float((flat(model) - flat(ref)).abs().max())
    assert diff <= 1e-6, f"Lightning SLAMB differs from the DDP + slamb_hook loop by {diff}"
    assert replicas_agree(model), "replicas differ right after the periodic sync (step 9)"
    assert strategy.hook_state.calls >= 9, strategy.hook_state.calls
    res.update(ratio1_maxdiff=diff, ratio1_hook_calls=strategy.hook_state.calls)

    model = Net(slamb(ratio=0.1, sync_interval=100))
    strategy = SlambDDPStrategy()
    log = Traffic(strategy)
    trainer(strategy, out, max_steps=6, callbacks=[log]).fit(model, loader(rank, 6))
    traffic = log.steps[-1]  # step 6 (step 1 also syncs the parameters, densely)
    # 0.1 of the two weights (2048 + 512 elements) plus the dense biases (132), float32, + status words
    want = (256 + 132) / 2692
    assert abs(traffic.elements_sent / traffic.elements_total - want) < 1e-9, traffic
    assert want < traffic.ratio < want + 0.01, traffic
    res.update(step_bytes=traffic.payload_bytes, dense_bytes=traffic.dense_payload_bytes, bytes_ratio=traffic.ratio,
               all_steps_ratio=sum(t.payload_bytes for t in log.steps) / sum(t.dense_payload_bytes for t in log.steps))
    return res


def case_recipes(out, rank):
    """bf16-mixed, gradient_clip_val and accumulate_grad_batches=2 under SLAMB and top-k: they train,
    the hook runs once per optimizer step (on the last micro-batch), replicas agree after a sync;
    an LR scheduler built on the bare SLAMB steps the distributed optimizer's groups, without
    torch's "lr_scheduler.step() before optimizer.step()" warning."""
    res = {}
    for name, make, strategy in (("slamb", slamb(ratio=0.25, sync_interval=3), SlambDDPStrategy()),
                                 ("topk", lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                                  SlambDDPStrategy(compression=slamb_comm.TopK(0.1)))):
        model = Net(make)
        trainer(strategy, out, max_steps=4, precision="bf16-mixed", gradient_clip_val=0.5,
                accumulate_grad_batches=2).fit(model, loader(rank, 8))
        assert torch.isfinite(flat(model)).all()
        assert strategy.hook_state.calls == 4, (name, strategy.hook_state.calls)  # one bucket, 4 steps
        assert replicas_agree(model), name  # slamb: step 4 is a sync step (H = 3); top-k: always
        res[f"{name}_hook_calls"] = strategy.hook_state.calls

    # 16-mixed with Lightning's GradScaler: Lightning maps precision="16-mixed" to bf16 on CPU, so the
    # plugin is given directly (fp16 autocast and GradScaler("cpu") exist in torch)
    from lightning.pytorch.plugins.precision import MixedPrecision
    for name, make, strategy in (("slamb", slamb(ratio=0.25, sync_interval=3), SlambDDPStrategy()),
                                 ("topk", lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                                  SlambDDPStrategy(compression=slamb_comm.TopK(0.1)))):
        model = Net(make)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
        trainer(strategy, out, max_steps=4, plugins=[plugin], gradient_clip_val=0.5).fit(model, loader(rank, 4))
        assert torch.isfinite(flat(model)).all() and strategy.hook_state.calls == 4, (name, strategy.hook_state.calls)
        assert plugin.scaler.get_scale() == 1024.0 and not torch.equal(flat(model), flat(Net())), name  # no skip
        if name == "topk":
            assert strategy.hook_state.grad_scaler is plugin.scaler  # error buffers kept in unscaled units
        assert replicas_agree(model), name
        res[f"fp16_{name}_hook_calls"] = strategy.hook_state.calls

    def with_scheduler(m):  # an LR schedule on the bare SLAMB: it steps the distributed one's groups
        opt = slamb()(m)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "step"}}

    strategy = SlambDDPStrategy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy, out, max_steps=3).fit(Net(with_scheduler), loader(rank, 3))
    lr = strategy.optimizers[0].param_groups[0]["lr"]
    assert lr == 0.01 * 0.5 ** 3, lr
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
    return res


def case_topk(out, rank):
    """TopK(1.0) under AdamW is plain DDP's averaging; TopK(0.1) sends about a tenth."""
    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)  # noqa: E731
    dense = Net(adam)
    trainer(DDPStrategy(), out, max_steps=5).fit(dense, loader(rank, 5))
    model = Net(adam)
    strategy = SlambDDPStrategy(compression=slamb_comm.TopK(1.0))
    trainer(strategy, out, max_steps=5).fit(model, loader(rank, 5))
    diff = float((flat(model) - flat(dense)).abs().max())
    assert diff < 1e-5, f"TopK(1.0) under Lightning differs from DDP's averaging by {diff}"
    assert strategy.hook_state.calls == 5 and replicas_agree(model)
    model = Net(adam)
    strategy = SlambDDPStrategy(compression=slamb_comm.TopK(0.1))
    log = Traffic(strategy)
    trainer(strategy, out, max_steps=5, callbacks=[log]).fit(model, loader(rank, 5))
    traffic = log.steps[-1]
    assert replicas_agree(model)
    # max(1, round(0.1 n)) per tensor (205 + 13 + 51 + 1), 4 value + 4 index bytes each, against 4 dense bytes
    assert traffic.elements_sent == 270 and 270 * 8 <= traffic.payload_bytes <= 270 * 8 + 16, traffic
    return {"ratio1_maxdiff": diff, "bytes": traffic.payload_bytes, "dense_bytes": traffic.dense_payload_bytes,
            "bytes_ratio": traffic.ratio, "hook_calls": strategy.hook_state.calls}


def case_misuse(out, rank):
    """The silent misuses of issue 22 raise at the first step, naming the fix."""
    res = {}
    res["topk_opt_plain_ddp"] = expect_error(lambda: trainer(DDPStrategy(), out, max_steps=2).fit(
        Net(lambda m: st.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                              named_parameters=m.named_parameters(),
                                              compression=slamb_comm.TopK(0.1))), loader(rank, 2)),
        "RuntimeError", "topk_hook")
    model = Net(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    hook_state = st.TopKHookState(model.named_parameters(), slamb_comm.TopK(0.1))
    res["topk_hook_not_registered"] = expect_error(lambda: trainer(
        DDPStrategy(ddp_comm_state=hook_state, ddp_comm_hook=st.topk_hook), out, max_steps=2).fit(
        model, loader(rank, 2)), "RuntimeError", "never called", "SlambDDPStrategy")
    res["plain_sgd_under_slamb_strategy"] = expect_error(lambda: trainer(SlambDDPStrategy(), out, max_steps=2).fit(
        Net(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)), loader(rank, 2)), "TypeError", "compression=")
    # last: needs the check in DistributedSlamb.distributed_step (adapters/torch/distributed/slamb.py)
    res["slamb_plain_ddp"] = expect_error(lambda: trainer(DDPStrategy(), out, max_steps=2).fit(
        Net(lambda m: st.DistributedOptimizer(slamb()(m), named_parameters=m.named_parameters())), loader(rank, 2)),
        "RuntimeError", "SlambDDPStrategy", "register_comm_hook")
    return {k: v[:80] for k, v in res.items()}


def _resume_arm(name):
    """``(make_opt, strategy)`` of the resume cases: SLAMB at ratio 0.25, H = 4, or top-k under AdamW."""
    if name == "slamb":
        return slamb(ratio=0.25, sync_interval=4), SlambDDPStrategy()
    return (lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)), SlambDDPStrategy(compression=slamb_comm.TopK(0.1))


def case_resume(out, rank, phase):
    """Two epochs of 6 steps, ModelCheckpoint every epoch; ``whole``: straight through; ``first``:
    epoch 1 only; ``second``: a new model, strategy and Trainer, fit(ckpt_path=epoch 1); then,
    from a copy of that checkpoint without the per-rank files, a warning and another result. SLAMB at ratio 0.25 with
    H = 4 (syncs at steps 1, 5, 9: the checkpoint at step 6 and the end at step 12 fall between
    syncs, where parameters and moments differ per rank) and top-k under AdamW."""
    res = {}
    for name in ("slamb", "topk"):
        make, strategy = _resume_arm(name)
        model = Net(make)
        ckdir = os.path.join(out, f"ck_{name}_{'whole' if phase == 'whole' else 'split'}")
        cb = ModelCheckpoint(dirpath=ckdir, filename="{epoch}", save_top_k=-1)
        kw = dict(enable_checkpointing=True, callbacks=[cb], max_epochs=1 if phase == "first" else 2)
        ckpt = os.path.join(ckdir, "epoch=0.ckpt") if phase == "second" else None
        trainer(strategy, out, **kw).fit(model, loader(rank, 6), ckpt_path=ckpt)
        if phase != "first":
            torch.save(flat(model), os.path.join(out, f"{name}_{phase}.{rank}"))
        if phase == "first":
            assert os.path.exists(os.path.join(ckdir, f"epoch=0.ckpt.slamb_rank{rank}"))
        if phase == "second" and name == "slamb":  # without the per-rank files: rank 0's state, with a warning
            bare = os.path.join(out, "bare.ckpt")
            if rank == 0:
                import shutil
                shutil.copy(ckpt, bare)
            dist.barrier()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = Net(make)
                trainer(SlambDDPStrategy(), out, max_epochs=2).fit(model, loader(rank, 6), ckpt_path=bare)
            assert any("rank 0's" in str(w.message) for w in caught), [str(w.message) for w in caught]
            assert not torch.equal(flat(model), torch.load(os.path.join(out, f"slamb_whole.{rank}")))
        res[name] = "ok"
    return res


def case_resize(out, rank):
    """On 1 rank, after the 2-rank ``resume`` case in the same OUT_DIR: its epoch-1 checkpoint
    (step 6, between SLAMB's syncs) resumes from both ranks' files averaged (docs/algorithm.md
    section 10), with no warning; then training goes on to epoch 2."""
    res = {}
    for name in ("slamb", "topk"):
        make, strategy = _resume_arm(name)
        ckpt = os.path.join(out, f"ck_{name}_split", "epoch=0.ckpt")
        old = [torch.load(f"{ckpt}.slamb_rank{r}", weights_only=False) for r in (0, 1)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = Net(make)
            tr = trainer(strategy, out, devices=1, max_epochs=1)
            tr.fit(model, loader(rank, 6), ckpt_path=ckpt)  # restores; epoch 1 is already done
        assert not any("rank 0's" in str(w.message) for w in caught), [str(w.message) for w in caught]
        res[f"{name}_params_averaged"] = averaged_from_two(model.state_dict(), *(o["state_dict"] for o in old))
        res[f"{name}_optimizer_averaged"] = averaged_from_two(tr.optimizers[0].state_dict(),
                                                              *(o["optimizer_states"][0] for o in old))
        if name == "topk":
            res["topk_residuals_averaged"] = averaged_from_two(strategy.hook_state.state_dict(),
                                                               *(o["hook_state"] for o in old))
        before = flat(model)
        model = Net(make)
        trainer(_resume_arm(name)[1], out, devices=1, max_epochs=2).fit(model, loader(rank, 6), ckpt_path=ckpt)
        assert torch.isfinite(flat(model)).all() and not torch.equal(flat(model), before), name
    return res


def case_saved_mean(out, rank):
    """Issue 37: SLAMB ratio 0.1, H = 100 (no sync after step 1), bf16-mixed, gradient_clip_val=1.0,
    30 steps (2 epochs of 15) with ModelCheckpoint every epoch and a CSVLogger. Each rank writes its own parameters at
    the end; the test compares checkpoint 30's state_dict with their float64 mean, and its per-rank
    files with each rank's own. A new Trainer resumed from checkpoint 15 ends bitwise where the
    uninterrupted run did, on each rank. The logger's metrics.csv carries each step's bytes."""
    from lightning.pytorch.loggers import CSVLogger

    def fit(ckdir, ckpt=None, log=None):
        strategy = SlambDDPStrategy()
        model = Net(slamb(ratio=0.1, sync_interval=100))
        cb = ModelCheckpoint(dirpath=os.path.join(out, ckdir), filename="{step}", save_top_k=-1)  # every epoch
        callbacks = [cb] + ([log(strategy)] if log else [])
        trainer(strategy, out, max_epochs=2, precision="bf16-mixed", gradient_clip_val=1.0, enable_checkpointing=True,
                callbacks=callbacks, log_every_n_steps=1, logger=CSVLogger(out, name="logs", version=0) if log else
                False).fit(model, loader(rank, 15), ckpt_path=ckpt)  # 2 epochs of 15 steps: resumable at step 15
        return model, callbacks[-1]

    model, log = fit("ck", log=Traffic)
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(own, os.path.join(out, f"own.{rank}.pt"))
    assert not replicas_agree(model), "the replicas should differ at step 30 (H = 100): the test would prove nothing"
    resumed, _ = fit("ck_resumed", ckpt=os.path.join(out, "ck", "step=15.ckpt"))
    diff = (flat(resumed) - flat(model)).abs().max()
    assert torch.equal(flat(resumed), flat(model)), f"the resumed run differs by {diff}"
    return {"payload": [t.payload_bytes for t in log.steps], "of_dense": [t.ratio for t in log.steps],
            "wire": [t.wire_bytes for t in log.steps]}


def main():
    case, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if case == "resume":  # in one launch: the resumed run builds everything anew and reads the files only
        res = {phase: case_resume(out, rank, phase) for phase in ("whole", "first", "second")}
        for name in ("slamb", "topk"):
            a = torch.load(os.path.join(out, f"{name}_whole.{rank}"))
            b = torch.load(os.path.join(out, f"{name}_second.{rank}"))
            assert torch.equal(a, b), f"{name}: the resumed run differs by {(a - b).abs().max()}"
        # SLAMB's replicas differ between syncs (step 12): the per-rank state files made it bitwise
        res["slamb_ranks_differ"] = not replicas_agree_tensor(torch.load(os.path.join(out, f"slamb_whole.{rank}")))
        assert res["slamb_ranks_differ"]
    else:
        res = globals()[f"case_{case}"](out, rank)
    with open(os.path.join(out, f"{case}.{rank}.json"), "w") as f:
        json.dump(res, f)
    print(f"{case} OK {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
