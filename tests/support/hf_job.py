"""Hugging Face jobs for tests/test_huggingface.py, run under torchrun at 2 ranks (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.support.hf_job CASE OUT_DIR

Each case asserts on every rank and writes what it measured to ``OUT_DIR/CASE.<rank>.json``.
The Trainer's batches are recorded (``compute_loss``) so that a stock DDP + slamb_hook loop can
replay them (the path mpi_tests/test_torch_dist.py compares with docs/algorithm.md section 1).
"""

import copy
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import transformers

import slamb_comm
from slamb_comm.adapters import huggingface as hf
from slamb_comm.adapters import torch as st
from .state_compare import averaged_from_two

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
BATCH = 16


class Tiny(torch.nn.Module):
    """A small regression MLP in the Trainer's form (keyword inputs, a dict with the loss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def dataset(n):
    g = torch.Generator().manual_seed(100)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x[:, :4] * 2.0) + 0.1 * torch.randn(n, 4, generator=g)
    return [{"x": a, "labels": b} for a, b in zip(x, y)]


class Recorder:
    """Mixed into a Trainer: keeps every batch it computes a loss on, and each step's bytes."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.seen.append({k: v.detach().clone() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, *args, **kwargs)


class SlambRec(Recorder, hf.SlambTrainer):
    pass


class StockRec(Recorder, transformers.Trainer):
    pass


class Bytes(transformers.TrainerCallback):
    """Each optimizer step's bytes, as SlambTrainer recorded them (``last_traffic``)."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, []

    def on_step_end(self, args, state, control, **kw):
        self.steps.append(self.trainer.last_traffic)


def args(out, **kw):
    base = dict(output_dir=out, per_device_train_batch_size=BATCH, learning_rate=0.01, lr_scheduler_type="constant",
                logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                ddp_backend="gloo", remove_unused_columns=False, dataloader_drop_last=True)
    return transformers.TrainingArguments(**{**base, **kw})


def run(cls, out, steps, make_opt=None, callbacks=(), resume=None, **kw):
    """Train a new Tiny with ``cls``; ``make_opt(model)``: the optimizer passed in ``optimizers=``."""
    targs = {k: kw.pop(k) for k in list(kw) if k in transformers.TrainingArguments.__dataclass_fields__}
    targs_ = args(out, max_steps=steps, **targs)
    targs_.device  # sets up the process group, as a user's script does before building its optimizer
    model = Tiny()
    if make_opt is not None:
        kw["optimizers"] = (make_opt(model), None)
    accumulate = targs.get("gradient_accumulation_steps", 1)
    trainer = cls(model=model, args=targs_,
                  train_dataset=dataset(steps * accumulate * 2 * BATCH), **kw)
    trainer.seen = []
    for c in callbacks:
        trainer.add_callback(c(trainer))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def replicas_agree(x):
    both = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(both, x)
    return all(torch.equal(both[0], b) for b in both)


SLAMB_KW = {"lr": 0.01, "ratio": 1.0, "beta3": 0.9, "dense_threshold": 100, "sync_interval": 4, "seed": 7}


def replay(seen, clip=1.0, accumulate=1, **kw):
    """A stock DDP loop with slamb_hook on the Trainer's recorded batches (its clipping at
    max_grad_norm, its no_sync accumulation and loss division)."""
    model = Tiny()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = st.DistributedOptimizer(st.SLAMB(model.parameters(), **{**SLAMB_KW, **kw}),
                                  named_parameters=model.named_parameters())
    ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    for s in range(0, len(seen), accumulate):
        opt.zero_grad()
        for j, b in enumerate(seen[s:s + accumulate]):
            ctx = ddp.no_sync() if j < accumulate - 1 else torch.enable_grad()
            with ctx:
                (ddp(**b)["loss"] / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def expect_error(fn, *needles):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 -- the message is what is checked
        msg = f"{type(err).__name__}: {err}"
        assert all(n in msg for n in needles), msg
        return msg[:80]
    raise AssertionError(f"no error; expected one naming {needles}")


def slamb(**kw):
    return lambda m: st.SLAMB(m.parameters(), **{**SLAMB_KW, **kw})


def case_trainer(out, rank):
    """SLAMB at ratio 1 (H = 4, 9 steps, max_grad_norm=1.0 by default) equals the replayed DDP
    loop and the replicas agree after the step-9 sync; ratio 0.1: the bytes of a step; slamb=
    builds SLAMB from the arguments, with the Trainer's weight-decay groups."""
    res = {}
    t, model = run(SlambRec, out, 9, slamb())
    ref = replay(t.seen)
    diff = float((flat(model) - flat(ref)).abs().max())
    assert diff <= 1e-6, f"SlambTrainer differs from the replayed DDP + slamb_hook loop by {diff}"
    assert replicas_agree(flat(model)) and t.hook_state.calls == 9, t.hook_state.calls
    res.update(ratio1_maxdiff=diff, hook_calls=t.hook_state.calls)

    t, model = run(SlambRec, out, 4, slamb(ratio=0.1, sync_interval=100), callbacks=[Bytes])
    traffic = t.callback_handler.callbacks[-1].steps[-1]
    want = (256 + 132) / 2692  # 0.1 of the two weights, the biases whole, + status words
    assert abs(traffic.elements_sent / traffic.elements_total - want) < 1e-9, traffic
    assert want < traffic.ratio < want + 0.01, traffic
    res.update(slamb_step_bytes=traffic.payload_bytes, dense_bytes=traffic.dense_payload_bytes,
               slamb_ratio=traffic.ratio)

    t, model = run(SlambRec, out, 3, slamb={"ratio": 0.1, "beta3": 0.9}, weight_decay=0.01)
    inner = t.optimizer.optimizer
    assert isinstance(inner, st.SLAMB) and hasattr(inner, "ddp_bucket") and len(inner.param_groups) == 2
    assert inner.param_groups[0]["weight_decay"] == 0.01 and inner.param_groups[1]["weight_decay"] == 0.0
    assert t.hook_state.calls == 3
    return res


def case_trainer_topk(out, rank):
    """TopK(1.0) under the Trainer's AdamW is the stock Trainer's DDP; TopK(0.1) sends the
    expected elements (max(1, round(0.1 n)) per tensor: 205 + 13 + 51 + 1)."""
    res = {}
    _, dense = run(StockRec, out, 5)
    t, model = run(SlambRec, out, 5, compression=slamb_comm.TopK(1.0))
    diff = float((flat(model) - flat(dense)).abs().max())
    assert diff < 1e-5 and t.hook_state.calls == 5, (diff, t.hook_state.calls)
    t, model = run(SlambRec, out, 5, compression=slamb_comm.TopK(0.1), callbacks=[Bytes])
    traffic = t.callback_handler.callbacks[-1].steps[-1]
    assert traffic.elements_sent == 270 and replicas_agree(flat(model)), traffic
    res.update(topk1_maxdiff=diff, topk_step_bytes=traffic.payload_bytes, dense_bytes=traffic.dense_payload_bytes,
               topk_ratio=traffic.ratio)
    return res


def case_recipes(out, rank):
    """gradient_accumulation_steps=2 with bf16 autocast and the default clipping: SLAMB equals the
    replayed loop (fp32 here: bf16 rounds differently in a replay) and the hook runs once per step;
    under bf16 SLAMB and top-k train, replicas agree after a sync."""
    res = {}
    t, model = run(SlambRec, out, 4, slamb(sync_interval=3), gradient_accumulation_steps=2)
    ref = replay(t.seen, accumulate=2, sync_interval=3)
    diff = float((flat(model) - flat(ref)).abs().max())
    assert diff <= 1e-6 and t.hook_state.calls == 4, (diff, t.hook_state.calls)
    res["accumulate_maxdiff"] = diff
    for name, kw in (("slamb", dict(make_opt=slamb(ratio=0.25, sync_interval=3))),
                     ("topk", dict(compression=slamb_comm.TopK(0.1)))):
        t, model = run(SlambRec, out, 4, bf16=True, gradient_accumulation_steps=2, **kw)
        assert torch.isfinite(flat(model)).all() and t.hook_state.calls == 4, (name, t.hook_state.calls)
        assert replicas_agree(flat(model)), name
        res[f"bf16_{name}_hook_calls"] = t.hook_state.calls
    return res


def case_resume(out, rank):
    """save_steps=3 of 7 steps; a new Trainer resumes from checkpoint-3: bitwise the whole run
    (SLAMB with H = 4: syncs at steps 1 and 5, so the checkpoint and the end are between syncs;
    top-k under AdamW with its per-rank error buffers)."""
    res = {}
    for name, kw in (("slamb", dict(make_opt=slamb(ratio=0.25))), ("topk", dict(compression=slamb_comm.TopK(0.1)))):
        d = os.path.join(out, name)
        _, whole = run(SlambRec, d, 7, save_strategy="steps", save_steps=3, **kw)
        ck = os.path.join(d, "checkpoint-3")
        assert os.path.exists(os.path.join(ck, f"slamb_rank{rank}.pt")), os.listdir(ck)
        _, resumed = run(SlambRec, d, 7, resume=ck, **kw)
        diff = float((flat(whole) - flat(resumed)).abs().max())
        assert torch.equal(flat(whole), flat(resumed)), f"{name}: the resumed run differs by {diff}"
        res[f"{name}_ranks_differ"] = not replicas_agree(flat(whole))
    assert res["slamb_ranks_differ"] and not res["topk_ranks_differ"], res
    return res


class Loaded(transformers.TrainerCallback):
    """The model's and optimizer's state as the resume left them, before the first step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kw):
        t = self.trainer
        self.model = {k: v.clone() for k, v in t.model.state_dict().items()}
        self.optimizer = copy.deepcopy(t.optimizer.state_dict())
        self.hook = copy.deepcopy(t.hook_state.state_dict()) if isinstance(t.hook_state, st.TopKHookState) else None


def case_resize(out, rank):
    """On 1 rank, after the 2-rank ``resume`` case in the same OUT_DIR: its checkpoint-3 (saved
    at 2 ranks, between SLAMB's syncs) resumes from both ranks' files averaged (docs/algorithm.md
    section 10), with no warning, and trains on to step 7."""
    res = {}
    for name, kw in (("slamb", dict(make_opt=slamb(ratio=0.25))), ("topk", dict(compression=slamb_comm.TopK(0.1)))):
        ck = os.path.join(out, name, "checkpoint-3")
        old = [torch.load(os.path.join(ck, f"slamb_rank{r}.pt"), weights_only=False) for r in (0, 1)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t, model = run(SlambRec, os.path.join(out, f"{name}_1"), 7, resume=ck, callbacks=[Loaded], **kw)
        assert not any("rank 0's" in str(w.message) for w in caught), [str(w.message) for w in caught]
        seen = next(c for c in t.callback_handler.callbacks if isinstance(c, Loaded))
        res[f"{name}_params_averaged"] = averaged_from_two(seen.model, *(o["model"] for o in old))
        res[f"{name}_optimizer_averaged"] = averaged_from_two(seen.optimizer, *(o["optimizer"] for o in old))
        if name == "topk":
            res["topk_residuals_averaged"] = averaged_from_two(seen.hook, *(o["hook_state"] for o in old))
        assert t.state.global_step == 7 and torch.isfinite(flat(model)).all()
    return res


def case_misuse(out, rank):
    """The silent misuses raise at the first step, naming the fix."""
    res = {}
    res["topk_opt_stock_trainer"] = expect_error(lambda: run(StockRec, out, 2, lambda m: st.DistributedOptimizer(
        torch.optim.AdamW(m.parameters()), named_parameters=m.named_parameters(), compression=slamb_comm.TopK(0.1))),
        "RuntimeError", "topk_hook")
    res["adamw_in_slamb_trainer"] = expect_error(lambda: run(SlambRec, out, 2, lambda m: torch.optim.AdamW(
        m.parameters())), "TypeError", "compression=")
    # last: needs the check in DistributedSlamb.distributed_step (adapters/torch/distributed/slamb.py)
    res["slamb_stock_trainer"] = expect_error(lambda: run(StockRec, out, 2, lambda m: st.DistributedOptimizer(
        slamb()(m), named_parameters=m.named_parameters())), "RuntimeError", "SlambTrainer", "register_comm_hook")
    return res


def case_accelerate(out, rank):
    """A stock Accelerate loop plus install(): SLAMB equals the stock DDP + slamb_hook loop on
    the same batches; save_rank_state at step 3 and load_rank_state into a new model resume
    bitwise; top-k bytes."""
    from accelerate import Accelerator

    res = {}
    data = dataset(7 * 2 * BATCH)

    def loop(steps, kind="slamb", start=None, save=None):
        acc = Accelerator(cpu=True)
        model = Tiny()
        opt = st.SLAMB(model.parameters(), **{**SLAMB_KW, "ratio": 0.25}) if kind == "slamb" else \
            torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=transformers.default_data_collator)
        model, opt, loader = acc.prepare(model, opt, loader)
        if start is not None:
            hf.load_rank_state(start, model, opt)
        state = hf.install(model, opt) if kind == "slamb" else hf.install(model, compression=slamb_comm.TopK(0.1))
        seen, traffic = [], []
        for i, b in enumerate(loader):
            if start is not None and i < 3:
                continue
            if i == steps:
                break
            seen.append(b)
            opt.zero_grad()
            acc.backward(model(**b)["loss"])
            opt.step()
            traffic.append(state.step_traffic() if kind == "topk" else opt.optimizer.step_traffic())
            if save is not None and i == 2:
                hf.save_rank_state(save, model, opt, state)
        return model.module, seen, state, traffic

    model, seen, state, _ = loop(7, save=os.path.join(out, "acc3"))
    ref = replay(seen, clip=float("inf"), ratio=0.25)
    diff = float((flat(model) - flat(ref)).abs().max())
    assert diff <= 1e-6 and state.calls == 7, (diff, state.calls)
    resumed, _, _, _ = loop(7, start=os.path.join(out, "acc3"))
    assert torch.equal(flat(model), flat(resumed)), "Accelerate: the resumed run differs"
    assert not replicas_agree(flat(model))  # step 7 is between syncs: the per-rank files mattered
    _, _, state, traffic = loop(4, kind="topk")
    assert traffic[-1].elements_sent == 270 and state.calls == 4, traffic[-1]
    res.update(slamb_maxdiff=diff, slamb_hook_calls=7, topk_step_bytes=traffic[-1].payload_bytes,
               topk_ratio=traffic[-1].ratio)
    return res


# ----------------------------------------------------------------------------- issue 37: the saved model, bytes, lr
def tiny_gpt2():
    """Issue 37's model: GPT-2 with 2 layers, d = 64, context 64, 256 byte ids (120,576 parameters;
    the output layer is tied to the input embedding)."""
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def byte_dataset(n, seed=100):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, 64), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def case_saved_mean(out, rank):
    """The tiny GPT-2 under SlambTrainer, SLAMB ratio 0.1 with H = 100, 30 steps, checkpoints every
    15 steps, a log every step: each rank writes its own parameters; save_model() on every rank;
    a new Trainer resumed from checkpoint-15 ends bitwise where the uninterrupted run did; the
    bytes are in the log history."""
    def train(resume=None):
        targs = args(os.path.join(out, "run" if resume is None else "resumed"), max_steps=30,
                     per_device_train_batch_size=4, save_strategy="steps", save_steps=15, logging_strategy="steps",
                     logging_steps=1, learning_rate=0.01)
        targs.device  # sets up the process group
        model = tiny_gpt2()
        t = hf.SlambTrainer(model=model, args=targs, train_dataset=byte_dataset(30 * 2 * 4),
                            slamb={"ratio": 0.1, "beta3": 0.9, "sync_interval": 100})
        t.add_callback(Bytes(t))
        t.train(resume_from_checkpoint=resume)
        return t, model

    t, model = train()
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(own, os.path.join(out, f"own.{rank}.pt"))
    assert not replicas_agree(flat(model)), "the replicas should differ at step 30 (H = 100)"
    t.save_model(os.path.join(out, "final"))  # on every rank: the mean is an allreduce
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items()), "save_model changed the live model"
    steps = t.callback_handler.callbacks[-1].steps
    logged = [h for h in t.state.log_history if "slamb/payload_bytes" in h]
    _, resumed = train(resume=os.path.join(out, "run", "checkpoint-15"))
    diff = (flat(resumed) - flat(model)).abs().max()
    assert torch.equal(flat(resumed), flat(model)), f"the resumed run differs by {diff}"
    return {"payload": [x.payload_bytes for x in steps], "of_dense": [x.ratio for x in steps],
            "logged_payload": [h["slamb/payload_bytes"] for h in logged],
            "logged_of_dense": [h["slamb/of_dense"] for h in logged]}


def case_lr_warning(out, rank):
    """SlambTrainer warns once, on rank 0, when the lr looks like AdamW's (1e-3), naming the lr to
    start from, and keeps the lr; at 1e-2 it says nothing."""
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("slamb_comm").addHandler(Keep())
    t, _ = run(SlambRec, out, 2, slamb={"ratio": 0.1}, learning_rate=1e-3)
    assert t.optimizer.param_groups[0]["lr"] == 1e-3
    warned = [m for m in seen if "looks like an AdamW" in m]
    assert len(warned) == (1 if rank == 0 else 0), seen
    run(SlambRec, out, 2, slamb={"ratio": 0.1}, learning_rate=1e-3)  # once per process
    assert len([m for m in seen if "looks like an AdamW" in m]) == len(warned), seen
    return {"warning": warned[0] if warned else None}


def case_accelerate_saved_mean(out, rank):
    """Accelerate + install(), SLAMB ratio 0.1 with H = 100, 30 steps, accelerator.log(step_metrics(state))
    every step into a tracker: save_state + save_rank_state at step 15; at step 30 each rank writes
    its own parameters, get_state_dict's and save_model's weights (the test compares them with the
    float64 mean); load_state + load_rank_state at step 15 resume bitwise."""
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    class Memory(GeneralTracker):
        name, requires_logging_directory = "memory", False

        def __init__(self):
            super().__init__()
            self.logged = []

        @property
        def tracker(self):
            return self.logged

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.logged.append(dict(values, step=step))

    data = dataset(30 * 2 * BATCH)

    def loop(start=None):
        tracker = Memory()
        acc = Accelerator(cpu=True, log_with=[tracker])
        acc.init_trackers("slamb")
        model = Tiny()
        opt = st.SLAMB(model.parameters(), **{**SLAMB_KW, "ratio": 0.1, "sync_interval": 100})
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=transformers.default_data_collator)
        model, opt, loader = acc.prepare(model, opt, loader)
        if start is not None:
            acc.load_state(start)
            hf.load_rank_state(start, model, opt)
        state = hf.install(model, opt)
        for i, b in enumerate(loader):
            if start is not None and i < 15:
                continue
            opt.zero_grad()
            acc.backward(model(**b)["loss"])
            opt.step()
            acc.log(hf.step_metrics(state), step=i + 1)
            if i + 1 == 15 and start is None:
                acc.save_state(os.path.join(out, "acc15"))
                hf.save_rank_state(os.path.join(out, "acc15"), model, opt)
        return acc, model, tracker

    acc, model, tracker = loop()
    own = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    torch.save(own, os.path.join(out, f"own.{rank}.pt"))
    assert not replicas_agree(flat(model.module)), "the replicas should differ at step 30 (H = 100)"
    got = acc.get_state_dict(model)  # every rank: an allreduce
    acc.save_model(model, os.path.join(out, "acc_final"))
    if rank == 0:
        torch.save(got, os.path.join(out, "acc_get_state_dict.pt"))
    _, resumed, _ = loop(start=os.path.join(out, "acc15"))
    assert torch.equal(flat(resumed.module), flat(model.module)), "Accelerate: the resumed run differs"
    return {"logged": tracker.logged}


def main():
    case, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    res = globals()[f"case_{case}"](out, rank)
    with open(os.path.join(out, f"{case}.{rank}.json"), "w") as f:
        json.dump(res, f)
    print(f"{case} OK {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
