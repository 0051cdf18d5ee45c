"""SLAMB's DDP communication hook beside its state: :func:`slamb_hook`, :class:`SlambHookState`.

:func:`slamb_hook` with :class:`SlambHookState` starts SLAMB's momentum exchange from DDP's
buckets, as soon as DDP hands each one (PyTorch's convention for compressed communication,
``ddp.register_comm_hook(state, hook)``, laid out as ``torch.distributed.algorithms.ddp_comm_hooks``:
one file per hook family, the state beside its hook).
"""

import torch

from ..distributed.slamb import DistributedSlamb

__all__ = ["SlambHookState", "slamb_hook", "done"]


def done(tensor):
    """A future already holding ``tensor`` (what a DDP hook returns when its work is done)."""
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class SlambHookState:
    """State of :func:`slamb_hook`: the distributed SLAMB optimizer whose exchange the hook starts.

    Usage (two lines of a stock DDP script change)::

        opt = DistributedOptimizer(SLAMB(ddp.parameters(), lr=1e-3, ratio=0.1, beta3=0.9),
                                   named_parameters=ddp.module.named_parameters())
        ddp.register_comm_hook(SlambHookState(opt), slamb_hook)

    For frameworks that wrap the model in DDP before the optimizer exists (Lightning, Hugging
    Face), the state can be made first and bound later, before the first backward pass::

        state = SlambHookState()
        ddp.register_comm_hook(state, slamb_hook)
        ...                                    # the framework builds the optimizer
        state.bind(DistributedOptimizer(SLAMB(...), named_parameters=...))

    A backward pass that reaches the hook before :meth:`bind` raises RuntimeError naming the fix;
    so does the optimizer's first ``step()`` if DDP never called the hook (it was registered
    on another module, or a framework did not register it: Lightning's DDPStrategy registers
    comm hooks on CUDA only). ``calls`` counts the buckets the hook was handed.

    Tuning guide (SLAMB's knobs live on the optimizer):

    * ``ratio`` (k): the fraction of each large tensor's momentum averaged per step. The paper
      uses 0.1; the bytes per step are about ``k * N * value_bytes + 4 N / H``.
    * ``value_dtype='float16'`` halves the payload (values beyond +-65504 skip the step).
    * ``sync_interval`` (H): parameters are averaged every H steps (paper: 100).
    * ``beta3``: sweep it with the learning rate (0.9-0.999); it matters as much as lr at short
      budgets (docs/algorithm.md section 5).
    * DDP's ``bucket_cap_mb`` sets how soon a bucket's exchange starts; smaller buckets start
      earlier.

    The hook keeps the gradients local (SLAMB never averages gradients): DDP writes back each
    rank's own gradient. Gradient clipping then clips the local gradient, as with the Horovod
    adapter. The state pickles without the optimizer or its process group (it holds no state
    of its own: checkpoint ``opt.state_dict()``).
    """

    __slots__ = ("optimizer", "calls", "unpickled")

    def __init__(self, optimizer=None):
        self.optimizer = None
        self.calls = 0
        self.unpickled = False  # made by pickle, without its optimizer
        if optimizer is not None:
            self.bind(optimizer)

    def bind(self, optimizer):
        """Give the state its ``DistributedOptimizer(SLAMB(...))`` (before the first backward pass);
        returns the optimizer. From then on the hook, not the parameters' gradient hooks, launches
        its exchange."""
        if not isinstance(optimizer, DistributedSlamb):
            raise TypeError("SlambHookState takes the DistributedOptimizer(SLAMB(...)) that you step, "
                            f"got {type(optimizer).__name__}"
                            + (" (wrap it: slamb_comm.adapters.torch.DistributedOptimizer(opt, named_parameters=...))"
                               if type(optimizer).__name__ == "SLAMB" else ""))
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise RuntimeError("this SlambHookState is bound to another optimizer already; one state per optimizer")
        if self.calls:
            raise RuntimeError("SlambHookState.bind() after DDP already called slamb_hook: bind before the first "
                               "backward pass")
        optimizer.attach_hook_state(self)  # the hook launches the exchange; its first step() checks DDP called it
        self.optimizer = optimizer
        return optimizer

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.optimizer = None
        self.calls = 0
        self.unpickled = True


def slamb_hook(state, bucket):
    """DDP communication hook for SLAMB: start the masked momentum exchange of the bucket's
    parameters (asynchronously) and return the bucket's local gradients unchanged. The step's
    agreement follows at the end of the backward pass (see the distributed optimizer)."""
    opt = state.optimizer
    if opt is None:
        if state.unpickled:
            raise RuntimeError("this SlambHookState was unpickled without its optimizer; build a new one")
        raise RuntimeError("slamb_hook ran before its SlambHookState was bound to an optimizer: call "
                           "state.bind(slamb_comm.adapters.torch.DistributedOptimizer(SLAMB(...), "
                           "named_parameters=...)) before the first backward pass (Lightning: SlambDDPStrategy "
                           "binds it for you)")
    state.calls += 1
    opt.ddp_bucket(bucket)  # the optimizer's own method: the hook is its DDP front end
    return done(bucket.buffer())
