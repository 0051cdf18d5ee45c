"""PyTorch adapter: SLAMB, 1-bit LAMB and sparse top-k exchange for torch, on torch.distributed (torchrun, DDP).

Everything torch-level lives here, once, whatever launches the job:

* :class:`SLAMB` -- a ``torch.optim.Optimizer``. Alone, in one process, it is the SLAMB rule
  with P = 1 (with ``ratio=1`` exactly LAMB); wrapped by a ``DistributedOptimizer`` (this
  module's, or Horovod's in :mod:`slamb_comm.adapters.horovod`) it is SLAMB over all ranks.
* :class:`OneBitLAMB` -- 1-bit LAMB (docs/onebit_lamb.md) as a ``torch.optim.Optimizer``, on
  the core's :class:`slamb_comm.onebit_lamb.OneBitLamb`; alone it is the rule at P = 1,
  wrapped by either ``DistributedOptimizer`` it runs over all ranks.
* :class:`TorchTransport` -- slamb_comm's transport protocol on ``torch.distributed`` (gloo on
  the CPU, NCCL on GPUs, MPI where torch has it), on the default process group or a given one,
  so the core runs inside any ``torchrun`` job.
* :func:`DistributedOptimizer` -- for ``torchrun`` without DDP (a plain process group and your
  own loop): the same form as Horovod's, ``DistributedOptimizer(SLAMB(...))`` or
  ``DistributedOptimizer(torch.optim.Adam(...), compression=slamb_comm.TopK(0.01))``.
* DDP communication hooks, PyTorch's convention for compressed communication
  (``ddp.register_comm_hook(state, hook)``):

  - :func:`slamb_hook` with :class:`SlambHookState`: keeps each bucket's gradients local
    (SLAMB never averages gradients) and starts the masked momentum exchange of the bucket's
    parameters as soon as the bucket is ready, overlapping the backward pass;
    ``optimizer.step()`` waits for it, applies the update and the periodic parameter sync.
    A stock DDP script changes two lines::

        opt = slamb_comm.adapters.torch.DistributedOptimizer(
            slamb_comm.adapters.torch.SLAMB(ddp.parameters(), lr=1e-3, ratio=0.1),
            named_parameters=ddp.module.named_parameters())
        ddp.register_comm_hook(slamb_comm.adapters.torch.SlambHookState(opt), slamb_comm.adapters.torch.slamb_hook)

  - :func:`topk_hook` with :class:`TopKHookState`: top-k with error feedback for any optimizer
    (ALGORITHM.md section 2): each bucket becomes the mean of the ranks' decoded top-k of it.

The distributed optimizers are classes built at run time with
``type(name, (optimizer.__class__,), ...)`` (so ``isinstance(opt, torch.optim.Adam)`` still
holds), on one set of collectives per framework: :class:`_TorchCollectives` here,
Horovod's in :mod:`slamb_comm.adapters.horovod`.

Data types: bfloat16 and float16 parameters are updated through float32 state and cast back;
the exchange is float32 or float16 per ``value_dtype``.
"""

import contextlib
import hashlib
import itertools
import logging
import math
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from slamb_comm import arrays as _arr
from slamb_comm.codecs import Layout, TopK, check_ratio
from slamb_comm.communicator import Communicator
from slamb_comm.errors import ConfigError, LayoutError, NonFiniteError, PeerError
from slamb_comm.masks import check_block
from slamb_comm.onebit_lamb import OneBitLamb
from slamb_comm.slamb import Slamb
from slamb_comm.stats import Traffic, allreduce_wire
from slamb_comm.transports import LocalTransport, check_alltoall, check_buffer

__all__ = ["SLAMB", "OneBitLAMB", "TopK", "TorchTransport", "DistributedOptimizer", "SlambHookState", "slamb_hook",
           "TopKHookState", "topk_hook"]

_log = logging.getLogger("slamb_comm")


# ---------------------------------------------------------------------------- transport
def _torch_view(buf):
    """A torch tensor sharing memory with a NumPy (CPU) or CuPy (CUDA) buffer."""
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf)
    if _arr.is_cupy(buf):
        _arr.synchronize(buf)  # the buffer must be complete before the collective reads it
        return torch.from_dlpack(buf)
    raise TypeError(f"expected a numpy or cupy array, got {type(buf).__module__}.{type(buf).__name__}")


def _group_size_rank(group):
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return False, 1, 0
    return True, dist.get_world_size(group), dist.get_rank(group)


class TorchTransport:
    """slamb_comm's transport protocol on ``torch.distributed`` (call ``init_process_group`` first).

    Buffers are NumPy arrays (viewed as CPU tensors, no copy) or CuPy arrays (CUDA tensors
    through DLPack). A backend that cannot take a buffer's device gets a staged copy: NCCL
    takes CUDA tensors only, so the core's small host buffers (agreement at construction,
    status words on the failure path) travel through the current CUDA device; gloo gets a
    CUDA buffer through host memory.

    Args:
        group: a process group (default: the default group). A rank outside ``group`` cannot
            build one (ValueError).
    """

    name = "torch"

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchTransport needs torch.distributed.init_process_group() to have been called")
        member, self.size, self.rank = _group_size_rank(group)
        if not member:
            raise ValueError("this rank is not in the given process group")
        self.group = group
        self._nccl = dist.get_backend(group) == "nccl"

    def _staged(self, t):
        if self._nccl and t.device.type != "cuda":
            return t.to(torch.device("cuda", torch.cuda.current_device()))
        if not self._nccl and t.device.type == "cuda":
            return t.cpu()
        return t

    def allreduce(self, buf):
        """In place: the element-wise sum over ranks."""
        check_buffer(buf)
        t = _torch_view(buf)
        w = self._staged(t)
        dist.all_reduce(w, group=self.group)
        if w is not t:
            t.copy_(w)

    def allgather(self, sendbuf, recvbuf):
        """``recvbuf[r * n:(r + 1) * n]`` = rank r's ``sendbuf`` (n = ``sendbuf.size``)."""
        check_buffer(sendbuf)
        check_buffer(recvbuf)
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError("allgather needs recvbuf of size * sendbuf.size elements of the same dtype")
        r = _torch_view(recvbuf)
        w = self._staged(r)
        dist.all_gather(list(w.reshape(self.size, -1).unbind(0)), self._staged(_torch_view(sendbuf)),
                        group=self.group)
        if w is not r:
            r.copy_(w)

    def alltoall(self, sendbuf, recvbuf):
        """Rank r's ``sendbuf[j * n:(j + 1) * n]`` goes to rank j's ``recvbuf[r * n:(r + 1) * n]``
        (n = ``sendbuf.size // size``): ``all_to_all_single`` with equal splits."""
        check_alltoall(sendbuf, recvbuf, self.size)
        r = _torch_view(recvbuf)
        w = self._staged(r)
        dist.all_to_all_single(w, self._staged(_torch_view(sendbuf)), group=self.group)
        if w is not r:
            r.copy_(w)

    def broadcast(self, buf, root=0):
        """In place: every rank gets ``root``'s buffer (``root``: a rank of the group)."""
        check_buffer(buf)
        if not 0 <= int(root) < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        t = _torch_view(buf)
        w = self._staged(t)
        src = int(root) if self.group is None else dist.get_global_rank(self.group, int(root))
        dist.broadcast(w, src=src, group=self.group)
        if w is not t:
            t.copy_(w)

    def barrier(self):
        """Wait until every rank of the group has arrived."""
        dist.barrier(group=self.group)


class _TorchCollectives:
    """The few collectives the distributed optimizers use, on a torch.distributed process group.
    Horovod's counterpart is ``slamb_comm.adapters.horovod._HorovodCollectives``; both offer:
    ``member``, ``size``, ``rank``, ``device`` (where flag tensors live), ``allreduce_async`` /
    ``wait`` (in place; Sum, or Average with pre- and post-scaling), ``allreduce`` (Sum, in
    place), ``allgather`` (concatenated along dim 0), ``transport()`` (for the core; None outside
    the group) and ``recognise(opt)``.

    Horovod matches collectives by name; torch.distributed by the order in which each rank
    issues them. Gradient hooks fire in an order that can differ between ranks (a parameter
    without a gradient on one rank is launched later, from ``synchronize()``), so outside DDP the
    asynchronous allreduces are queued and issued at the first ``wait`` (or blocking call), sorted
    by name: the same order everywhere. Under DDP (``immediate``) they start at once, from DDP's
    bucket hooks, which run in the same order on every rank."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group() before building a DistributedOptimizer")
        self.group = group
        self.member, self.size, self.rank = _group_size_rank(group)
        nccl = self.member and dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.immediate = False
        self._queued = []

    def _start(self, h):
        if h["pre"] != 1.0:
            h["t"].mul_(h["pre"])
        h["work"] = dist.all_reduce(h["t"], group=self.group, async_op=True)

    def _issue(self):
        queued, self._queued = self._queued, []
        for h in sorted(queued, key=lambda h: h["name"]):
            self._start(h)

    def allreduce_async(self, t, name, average=False, prescale=1.0, postscale=1.0):
        h = {"t": t, "name": name, "average": average, "pre": prescale, "post": postscale, "work": None}
        if self.immediate:
            self._start(h)
        else:
            self._queued.append(h)
        return h

    def wait(self, handle):
        if handle["work"] is None:
            self._issue()
        handle["work"].wait()
        t = handle["t"]
        if handle["average"]:
            t.div_(self.size)
        if handle["post"] != 1.0:
            t.mul_(handle["post"])
        return t

    def allreduce(self, t, name):
        self._issue()
        dist.all_reduce(t, group=self.group)

    def allgather(self, t, name):
        self._issue()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return torch.cat(out)

    def transport(self):
        return TorchTransport(self.group) if self.member else None

    def recognise(self, opt):
        pass


# ---------------------------------------------------------------------------- helpers
_MASKS = ("cyclic", "bernoulli", "topk")


def _schedule(e):
    """Bucket ``e``'s ratio changes that its cyclic mask still follows, as [[chunks, step], ...]
    (integers: a checkpoint keeps them exactly, where torch would cast a float tensor to the
    parameters' dtype); None if it has had none."""
    mask = e.comm.mask
    if "schedule" not in mask.state_dict():
        return None
    return [[m.num_chunks, m.origin] for m in mask.levels()]


def _state_dtype(dtype):
    """The dtype slamb_comm computes in for parameters of ``dtype``: 16-bit -> float32."""
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    raise TypeError(f"slamb_comm cannot optimise parameters of dtype {dtype}")


def _np_dtype(tdtype):
    return np.dtype({torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}[tdtype])


def _torch_dtype(npdtype):
    return {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}[np.dtype(npdtype).name]


def _as_compute(t, dtype):
    """``t`` (detached) as a contiguous tensor of ``dtype``; no copy when it already is one."""
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def _cuda_scope(device):
    """For tensors on a CUDA ``device``: CuPy's current device is that device and its current
    stream is torch's current stream there, so what the core queues is ordered with torch's own
    work (before: the gradients; after: whatever reads the parameters) without a host
    synchronisation. A no-op context for CPU tensors."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import cupy

    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()))
    stack.enter_context(cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream))
    return stack


def _array(t):
    """A NumPy/CuPy view of a contiguous tensor."""
    return _arr.as_array(t)


def _tensor_of(a):
    """A torch view of a NumPy/CuPy array."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


class _Params:
    """The parameters of a bucket as a lazily read sequence of arrays of the bucket's dtype:
    a view for float32/float64 parameters, a converted copy for 16-bit ones, made when the
    core reads the tensor and written back (and dropped) when it calls :meth:`written`. So a
    bfloat16 model never has more than one tensor's float32 copy alive."""

    def __init__(self, e):
        self.e = e
        self._copy = {}

    def __len__(self):
        return len(self.e.params)

    def __getitem__(self, i):
        x = self._copy.get(i)
        if x is None:
            p = self.e.params[i]
            x = _as_compute(p, self.e.dtype)
            if x.data_ptr() != p.data_ptr():
                self._copy[i] = x
        return _array(x)

    def written(self, i):
        x = self._copy.pop(i, None)
        if x is not None:
            self.e.params[i].data.copy_(x)


class _Grads:
    """The gradients of a bucket as a lazily read sequence of arrays of the bucket's dtype
    (zeros for a parameter without a gradient; converted per access for 16-bit ones)."""

    def __init__(self, e):
        self.e = e

    def __len__(self):
        return len(self.e.params)

    def __getitem__(self, i):
        p = self.e.params[i]
        if p.grad is None:
            return _arr.as_array(torch.zeros(p.shape, dtype=self.e.dtype, device=p.device))
        return _array(_as_compute(p.grad, self.e.dtype))


def _check_named_parameters(named_parameters, param_groups):
    """Horovod's checks: (name, tensor) tuples, unique names, every parameter named."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [
            (f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(param_groups) for j, v in enumerate(g["params"])
        ]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), "
            "usually produced by model.named_parameters()."
        )
    seen, dups = set(), set()
    for k, _ in named_parameters:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         "Found duplicates: %s" % ", ".join(sorted(dups)))
    all_ids = {id(v) for g in param_groups for v in g["params"]}
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = all_ids - named_ids
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            "Python object ids: %s" % ", ".join(str(i) for i in sorted(unnamed))
        )
    names = {}
    for k, v in named_parameters:
        names.setdefault(id(v), k)
    return names


def _changed(p, name, shape, dtype):
    """A :class:`LayoutError` if parameter ``p`` (or its gradient) no longer fits the bucket it
    was built into (``shape``, compute ``dtype``), else None."""
    now = tuple(p.shape) if tuple(p.shape) != shape or p.grad is None else tuple(p.grad.shape)
    if now != shape:
        return LayoutError(f"parameter {name!r} changed shape after the optimizer was built: "
                           f"was {shape}, is now {now}")
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or _state_dtype(p.dtype) != dtype:
        return LayoutError(f"parameter {name!r} changed dtype after the optimizer was built: "
                           f"its bucket is {dtype}, it is now {p.dtype} (shape {shape})")
    return None


def _changed_set(opt, params):
    """A :class:`LayoutError` if ``opt``'s parameter groups no longer hold exactly ``params``."""
    now = [p for g in opt.param_groups for p in g["params"]]
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        return LayoutError(f"the set of parameters changed after the optimizer was built: "
                           f"{len(params)} then, {len(now)} now (build a new optimizer instead)")
    return None


def _saved_state_by_param(optimizer, state_dict):
    """The raw per-parameter state of ``state_dict`` keyed by this optimizer's parameters
    (torch's own mapping: saved ids, in order, onto the current groups' parameters)."""
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    current = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved) != len(current):
        raise ValueError("loaded state dict has a different number of parameters")
    return {p: state_dict["state"][i] for i, p in zip(saved, current) if i in state_dict["state"]}


# ---------------------------------------------------------------------------- SLAMB
class _Engine:
    """The parameters of one (device, dtype, hyper-parameter) bucket: one Communicator and
    one :class:`slamb_comm.slamb.Slamb` over their fused layout."""

    __slots__ = (
        "key", "params", "index", "groups", "names", "dtype", "np_dtype", "comm", "rule",
        "open", "counts", "means", "wire", "launched", "encode_s", "payload", "skip",
    )

    def __init__(self, key, params, groups, names, dtype):
        self.key = key
        self.params = params
        self.index = {p: i for i, p in enumerate(params)}
        self.groups = groups
        self.names = names
        self.dtype = dtype
        self.np_dtype = _np_dtype(dtype)
        self.comm = self.rule = None
        self.open = False
        self.counts = self.means = None
        self.wire = None
        self.launched = {}
        self.encode_s = 0.0
        self.payload = 0
        self.skip = set()  # tensors without a gradient on any rank at the open step


class SLAMB(torch.optim.Optimizer):
    r"""SLAMB (Xu et al., ICML 2023) as a ``torch.optim.Optimizer``: LAMB with sparse momentum.

    Alone (no :func:`DistributedOptimizer`), in one process, it is the SLAMB rule with
    P = 1, which is LAMB with the freshness machinery (with ``ratio=1`` exactly LAMB).
    Wrapped by a ``DistributedOptimizer`` (this module's on torch.distributed, or
    :mod:`slamb_comm.adapters.horovod`'s) it is SLAMB over all ranks:
    each rank keeps its own moments from its *local* gradient; per step only the momentum
    entries on a shared mask M_t (a ``ratio`` fraction of each large tensor, all of every
    small or 1-D tensor) are averaged over the ranks, stale entries move with a rate that
    slides from ``lr`` to ``lr / sqrt(P)`` by their freshness, and the parameters are
    averaged every ``sync_interval`` steps. The math is ALGORITHM.md section 1, computed by
    :class:`slamb_comm.slamb.Slamb` on fused flat buffers.

    Args:
        params: parameters or parameter groups, as for any torch optimizer. Every option
            below can be set per group; ``lr`` and ``weight_decay`` are read from the
            groups at every step (lr schedulers work).
        lr: learning rate (the large-batch rate of fresh elements).
        betas: ``(beta1, beta2)`` of the moments (bias-corrected).
        eps: added to ``sqrt(vhat)``.
        weight_decay: decoupled weight decay inside the LAMB direction.
        ratio: k, the fraction of each large tensor's momentum exchanged per step. It may
            change between steps (a schedule: set ``param_group["ratio"]`` on every rank
            alike); the change applies from the next step, see :meth:`slamb_comm.slamb.Slamb.set_ratio`.
        beta3: freshness decay; stale element i moves with
            ``lr * (phi_S * f_i + phi_A * (1 - f_i) / sqrt(P))``, ``f_i = beta3 ** staleness``.
        sync_interval: H; parameters are averaged over ranks after steps 1, H+1, 2H+1, ...
        mask: ``'cyclic'`` (default; every element exchanged once every ceil(1/k) steps),
            ``'bernoulli'`` or ``'topk'`` (union of the ranks' largest momenta; its exchange
            waits for the whole backward pass).
        block: the cyclic mask's run length: 1 (default) picks single elements, as in the
            paper; a larger value picks runs of that many contiguous elements of the fused
            buffer (see :class:`slamb_comm.masks.CyclicMask`).
        value_dtype: ``'float32'`` or ``'float16'`` payload of the momentum exchange
            (16 bits halve the bytes).
        c_min, c_max: clamp of the layer-wise trust ratios.
        dense_threshold: tensors with ndim <= 1 or fewer elements are exchanged whole.
        seed: seed of the shared mask; rank 0's value is used by every rank.
        on_nonfinite: ``'skip'`` (default, like AMP's grad scaler): a step with a NaN or Inf
            gradient on any rank is skipped by every rank (logged on logger ``slamb_comm``,
            counted in :attr:`skipped_steps`); ``'raise'``: every rank raises
            :class:`slamb_comm.NonFiniteError`. Either way no state changes.

    Tuning: ``ratio=0.1`` and ``sync_interval=100`` are the paper's; sweep ``beta3``
    (0.9-0.999) together with ``lr``. See :mod:`slamb_comm.slamb` for the full guide.

    State: per parameter ``exp_avg`` (m), ``exp_avg_sq`` (v), ``freshness`` (f) -- float32
    views (float64 for float64 parameters) into SLAMB's fused buffers, live between
    steps -- ``step`` (a float32 tensor) and ``mask_seed`` (an int64 tensor, so that a
    broadcast reaches it in place). ``state_dict()`` and ``load_state_dict()`` round-trip
    exactly, so a run resumed from every rank's own state is bitwise the run that was
    interrupted. The state exists from construction on (zeros, freshness 1, step 0), so
    ``hvd.broadcast_optimizer_state`` never needs the zero-gradient ``step()`` it uses to
    create state (and creates no ``p.grad``): it copies rank 0's state and does not advance
    the step count. After Horovod's resume idiom (only rank 0 loads a checkpoint, then
    broadcasts) every rank continues from rank 0's moments: a valid run, not bitwise the
    interrupted one; the other ranks log a warning saying so.

    Data types: float32 and float64 parameters are updated in place; float16 and bfloat16
    parameters are updated through a float32 copy and cast back (Horovod has no bfloat16;
    the exchange is float32 or float16 per ``value_dtype``). Parameters with
    ``requires_grad=False`` at construction join when they become trainable (on every rank
    alike). A parameter whose gradient is ``None`` on every rank at a step is left exactly as it
    is (no moment decay, no weight decay, no move, freshness unchanged), as torch optimizers
    and the reference code do; it still takes part in the exchange, with zeros, so no rank
    waits. Where only some ranks have its gradient, the others count it as zero (Horovod's
    convention). With the cyclic mask such a parameter's freshness is stored from then on (4
    bytes per element of that parameter), since it no longer follows the mask's schedule.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        ratio=0.1,
        beta3=0.99,
        sync_interval=100,
        mask="cyclic",
        block=1,
        value_dtype="float32",
        c_min=0.01,
        c_max=1000.0,
        dense_threshold=9000,
        seed=0,
        on_nonfinite="skip",
    ):
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, ratio=ratio, beta3=beta3,
            sync_interval=sync_interval, mask=mask, block=block, value_dtype=value_dtype, c_min=c_min,
            c_max=c_max, dense_threshold=dense_threshold, seed=seed, on_nonfinite=on_nonfinite,
        )
        self._check_options(defaults)
        super().__init__(params, defaults)
        for g in self.param_groups:
            self._check_options(g)
        self._slamb_transport = getattr(self, "_slamb_transport", None)
        self._slamb_names = getattr(self, "_slamb_names", None)
        self._engines = None
        if not getattr(self, "_slamb_defer_build", False):
            self._build_engines()

    # ------------------------------------------------------------------ options
    @staticmethod
    def _check_options(g):
        if not (isinstance(g["lr"], (int, float)) and g["lr"] >= 0):
            raise ConfigError(f"lr must be a number >= 0, got {g['lr']!r}")
        b = g["betas"]
        if len(b) != 2 or not all(0.0 <= float(x) < 1.0 for x in b):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {b!r}")
        if not float(g["eps"]) >= 0:
            raise ConfigError(f"eps must be >= 0, got {g['eps']!r}")
        if not float(g["weight_decay"]) >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {g['weight_decay']!r}")
        check_ratio(g["ratio"])
        if not 0.0 <= float(g["beta3"]) < 1.0:
            raise ConfigError(f"beta3 must be in [0, 1), got {g['beta3']!r}")
        h = g["sync_interval"]
        if isinstance(h, bool) or int(h) != h or h < 1:
            raise ConfigError(f"sync_interval must be an integer >= 1, got {g['sync_interval']!r}")
        if g["mask"] not in _MASKS:
            raise ConfigError(f"unknown mask {g['mask']!r}; choose one of {list(_MASKS)}")
        if check_block(g.get("block", 1)) != 1 and g["mask"] != "cyclic":
            raise ConfigError(f"block={g['block']} applies to the cyclic mask only, not {g['mask']!r}")
        _arr.value_dtype(g["value_dtype"])
        if not 0.0 < float(g["c_min"]) <= float(g["c_max"]):
            raise ConfigError(f"need 0 < c_min <= c_max, got {g['c_min']!r}, {g['c_max']!r}")
        if int(g["dense_threshold"]) < 0:
            raise ConfigError(f"dense_threshold must be >= 0, got {g['dense_threshold']!r}")
        if g["on_nonfinite"] not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {g['on_nonfinite']!r}")
        if g["seed"] is not None and int(g["seed"]) != g["seed"]:
            raise ConfigError(f"seed must be an integer or None, got {g['seed']!r}")

    @staticmethod
    def _knobs(g):
        rule = (tuple(float(b) for b in g["betas"]), float(g["eps"]), float(g["beta3"]), int(g["sync_interval"]),
                float(g["c_min"]), float(g["c_max"]), g["on_nonfinite"])
        comm = (check_ratio(g["ratio"]), g["mask"], _arr.value_dtype(g["value_dtype"]).name, int(g["dense_threshold"]),
                check_block(g.get("block", 1)), None if g["seed"] is None else int(g["seed"]))
        return rule, comm

    def add_param_group(self, param_group):
        """Add a parameter group (options default to the constructor's); SLAMB's buckets are
        rebuilt, keeping the existing state, at the next step (collectively when distributed)."""
        super().add_param_group(param_group)
        self._check_options(self.param_groups[-1])
        if getattr(self, "_engines", None) is not None:
            self._engines = "stale"  # rebuilt (keeping the state) at the next step

    # ------------------------------------------------------------------ engines
    def _build_engines(self, ages=None):
        """Bucket the parameters by (device, compute dtype, options, step count) and build one
        Communicator + Slamb per bucket, keeping existing state. Collective when distributed."""
        old = getattr(self, "_built", None) or []
        saved = {p: dict(self.state[p]) for e in old for p in e.params}
        if ages is None:
            ages = {p: int(float(st["step"])) for p, st in saved.items()}
        transport = self._slamb_transport if self._slamb_transport is not None else LocalTransport()
        buckets = {}
        for gi, g in enumerate(self.param_groups):
            rule_k, comm_k = self._knobs(g)
            for j, p in enumerate(g["params"]):
                if not p.requires_grad:
                    continue
                dt = _state_dtype(p.dtype)
                # parameters that already have state at another step (added by add_param_group)
                # cannot share a bucket, whose step count is one
                age = ages.get(p, 0)
                key = (str(p.device), str(dt), rule_k, comm_k, age)
                buckets.setdefault(key, []).append((p, g, j, gi))
        engines = []
        for key, items in buckets.items():
            params = [p for p, _, _, _ in items]
            groups = [g for _, g, _, _ in items]
            names = [
                (self._slamb_names or {}).get(id(p), f"group{gi}.{j}") for p, _, j, gi in items
            ]
            e = _Engine(key, params, groups, names, _state_dtype(params[0].dtype))
            g0 = groups[0]
            layout = Layout([tuple(p.shape) for p in params], e.np_dtype, names=names,
                            dense_threshold=int(g0["dense_threshold"]))
            e.comm = Communicator(transport, layout, ratio=g0["ratio"], mask=g0["mask"], block=e.key[3][4],
                                  value_dtype=g0["value_dtype"], seed=g0["seed"],
                                  dense_threshold=int(g0["dense_threshold"]))
            e.wire = e.comm.value_dtype
            e.rule = Slamb(e.comm, lr=[float(g["lr"]) for g in groups], betas=g0["betas"], eps=g0["eps"],
                           weight_decay=[float(g["weight_decay"]) for g in groups], beta3=g0["beta3"],
                           sync_interval=int(g0["sync_interval"]), c_min=g0["c_min"], c_max=g0["c_max"],
                           on_nonfinite=g0["on_nonfinite"], check_options=self._slamb_transport is None)
            self._import_state(e, {p: saved[p] for p in params if p in saved})
            engines.append(e)
        self._engines = self._built = engines

    def _ensure_engines(self):
        if not isinstance(self._engines, list):
            self._build_engines()
        return self._engines

    def _import_state(self, e, raw):
        """Load ``raw`` (param -> saved state dict) into engine ``e`` exactly; fresh state if empty.
        The state is allocated on the parameters' device and filled tensor by tensor (no fused
        host copy of the model); a saved freshness is used only where it is stored (the
        bernoulli and topk masks: the cyclic mask derives it from the step and the seed)."""
        lay = e.comm.layout
        missing = [n for p, n in zip(e.params, e.names) if p not in raw or "exp_avg" not in raw[p]]
        have = [p for p in e.params if p in raw and "exp_avg" in raw[p]]
        step, comm_state = 0, e.comm.state_dict()
        if have:
            steps = {int(float(raw[p]["step"])) for p in have}
            if len(steps) != 1 or (missing and steps != {0}):
                raise ValueError(f"the SLAMB state to load mixes step counts {sorted(steps)} in one bucket"
                                 + (f" or lacks parameter(s) {missing[:5]}" if missing else ""))
            step = steps.pop()
            comm_state["seed"] = int(raw[have[0]].get("mask_seed", comm_state["seed"]))
            sched = raw[have[0]].get("mask_schedule")
            if sched is not None and e.key[3][1] == "cyclic":
                sched = [(int(c), int(o)) for c, o in torch.as_tensor(sched).tolist()]
                if sched[-1][0] != e.comm.mask.num_chunks:
                    raise ValueError(f"the saved mask schedule (chunks, step) {sched} ends at {sched[-1][0]} chunks, "
                                     f"but the parameter group's ratio {e.comm.ratio} makes {e.comm.mask.num_chunks}")
                ratios = [1.0 / c for c, _ in sched[:-1]] + [e.comm.ratio]  # a cyclic mask's ratio is its C
                comm_state["mask"] = dict(comm_state["mask"], schedule=[(k, o) for k, (_, o) in zip(ratios, sched)])
        e.rule.load_state_dict({"step": step, "m": None, "v": None, "f": None, "comm": comm_state})
        with _cuda_scope(e.params[0].device):
            e.rule.place(torch.empty(0, dtype=e.dtype, device=e.params[0].device))
        stored = not e.rule.derived
        for p, (o, n), shape in zip(have, [lay.segments()[e.index[p]] for p in have],
                                    [lay.shapes[e.index[p]] for p in have]):
            keys = [("exp_avg", e.rule.m), ("exp_avg_sq", e.rule.v)] + ([("freshness", e.rule._f)] if stored else [])
            for key, buf in keys:
                if key in raw[p]:
                    _tensor_of(buf[o:o + n]).view(shape).copy_(torch.as_tensor(raw[p][key]).detach())
            if not stored and "freshness" in raw[p]:  # a tensor that once skipped a step left the schedule
                i = e.index[p]
                saved = torch.as_tensor(raw[p]["freshness"]).detach().reshape(-1).to(e.dtype).cpu()
                if not torch.equal(saved, torch.from_numpy(e.rule.freshness(i).reshape(-1))):
                    e.rule.keep_freshness(i, saved)
        self._publish(e)

    def _publish(self, e):
        """Point each parameter's torch state at the fused buffers (no copy). The freshness is a
        live view where it is stored; for the cyclic mask it is derived, and appears only in
        :meth:`state_dict`."""
        r, lay = e.rule, e.comm.layout
        for i, (p, (o, n), shape) in enumerate(zip(e.params, lay.segments(), lay.shapes)):
            st = self.state[p]
            st["step"] = torch.tensor(float(r.t))
            st["exp_avg"] = _tensor_of(r.m[o:o + n]).view(shape)
            st["exp_avg_sq"] = _tensor_of(r.v[o:o + n]).view(shape)
            f = r.stored_freshness(i)
            if f is None:
                st.pop("freshness", None)
            else:
                st["freshness"] = _tensor_of(f).view(shape)
            # a tensor, so that hvd.broadcast_optimizer_state writes it in place like the moments
            st["mask_seed"] = torch.tensor(int(e.comm.seed), dtype=torch.int64)
            sched = _schedule(e)
            if sched is None:
                st.pop("mask_schedule", None)
            else:  # the cyclic mask's ratio changes that still decide its freshness: [(chunks, step)]
                st["mask_schedule"] = torch.tensor(sched, dtype=torch.int64)

    def state_dict(self):
        """torch's ``state_dict()``, plus each parameter's ``freshness`` where it is derived (the
        cyclic mask): a float32 CPU tensor built here, so a checkpoint shows every element's
        freshness; it is not needed to resume."""
        sd = super().state_dict()
        index = {}
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(id(p), len(index))
        for e in (self._engines if isinstance(self._engines, list) else []):
            if not e.rule.derived:
                continue
            for i, p in enumerate(e.params):
                k = index.get(id(p))
                if k in sd["state"] and e.rule.stored_freshness(i) is None:  # else a live view is there
                    sd["state"][k] = dict(sd["state"][k], freshness=torch.from_numpy(e.rule.freshness(i)))
        return sd

    def _pull(self, e):
        """Before a step: take in what was written into the torch state since the last step
        (``hvd.broadcast_optimizer_state`` overwrites step and seed; the moment tensors are
        live views). Also refresh the options read from the groups."""
        st = self.state[e.params[0]]
        t, seed = int(float(st["step"])), int(st["mask_seed"])
        same_views = st["exp_avg"].data_ptr() == _tensor_of(e.rule.m[:1]).data_ptr() if e.rule.m.size else True
        sched = st.get("mask_schedule")
        same_schedule = (None if sched is None else sched.tolist()) == _schedule(e)
        if t != e.rule.t or seed != e.comm.seed or not same_views or not same_schedule:
            if self._slamb_transport is not None:  # a local load imports at once, never here
                _log.warning(
                    "slamb_comm: SLAMB state of bucket %s was replaced from outside (a broadcast, e.g. "
                    "hvd.broadcast_optimizer_state after rank 0 loaded a checkpoint): this rank continues from "
                    "the broadcaster's moments, step %d and mask seed. That is a valid SLAMB run but not bitwise "
                    "the interrupted one, whose moments differed per rank; save and load every rank's state "
                    "(slamb_comm.checkpoint) for that.", e.names[0], t)
            self._import_state(e, {p: self.state[p] for p in e.params})
            self._options_agreed = False
        rule_k, comm_k = self._knobs(e.groups[0])
        for g in e.groups[1:]:
            if self._knobs(g)[0] != rule_k:
                raise ConfigError("parameter groups that share a SLAMB bucket now disagree on betas/eps/beta3/"
                                  "sync_interval/c_min/c_max; change them for every group at once")
        for g in e.groups:
            c = self._knobs(g)[1]
            if c[1:5] != e.key[3][1:5]:
                raise ConfigError("mask, value_dtype, dense_threshold and block are fixed at construction "
                                  f"(built with {e.key[3][1:5]}, the group now says {c[1:5]}); the ratio may change")
        self._requested_ratio(e)
        r = e.rule
        r.betas, r.eps, r.beta3, r.sync_interval, r.c_min, r.c_max, r.on_nonfinite = rule_k

    def _requested_ratio(self, e):
        """The ratio the bucket's parameter groups ask for now (a schedule may have changed it);
        ConfigError if groups that share the bucket disagree."""
        asked = {check_ratio(g["ratio"]) for g in e.groups}
        if len(asked) != 1:
            raise ConfigError(f"parameter groups that share a SLAMB bucket ask for different ratios {sorted(asked)}; "
                              "change the ratio of every group of the bucket at once")
        return asked.pop()

    def _set_ratio(self, e, problem=None):
        """Move bucket ``e`` to its groups' ratio from the next step on (collective when
        distributed: every rank alike, or ConfigError/PeerError everywhere and nothing changes)."""
        k = e.comm.ratio
        if problem is None:
            try:
                k = self._requested_ratio(e)
            except ConfigError as err:
                problem = err
        if problem is None:
            e.rule.set_ratio(k)
        else:  # still collective: the other ranks learn of it and raise PeerError
            e.comm.set_ratio(k, e.rule.t, problem=problem)
        e.key = e.key[:3] + ((e.comm.ratio,) + e.key[3][1:],) + e.key[4:]
        self._publish(e)

    def _lr_wd(self, e):
        return [float(g["lr"]) for g in e.groups], [float(g["weight_decay"]) for g in e.groups]

    def _grad_array(self, p, e):
        if p.grad is None:
            return _arr.as_array(torch.zeros(p.shape, dtype=e.dtype, device=p.device)), None
        g = _as_compute(p.grad, e.dtype)
        return _array(g), g

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step of every parameter (in a single process: P = 1)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engines = self._ensure_engines()
        for e in engines:  # before any bucket steps: a changed parameter changes nothing
            for i, p in enumerate(e.params):
                problem = _changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
                if problem is not None:
                    raise problem
        for e in engines:
            if all(p.grad is None for p in e.params):
                continue
            self._pull(e)
            if self._requested_ratio(e) != e.comm.ratio:  # a ratio schedule: from this step on
                self._set_ratio(e)
            lr, wd = self._lr_wd(e)
            x = _Params(e)
            skip = {i for i, p in enumerate(e.params) if p.grad is None}  # left exactly as they are
            with _cuda_scope(e.params[0].device):
                e.rule.step(x, _Grads(e), lr=lr, weight_decay=wd, written=x.written, skip=skip)
            self._publish(e)
        return loss

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output exactly (moments stay in their saved precision)."""
        self._options_agreed = False
        raw = _saved_state_by_param(self, state_dict)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            self._check_options(g)
        engines = self._ensure_engines()
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for e in engines:  # torch's load made new group dicts: read options (an lr schedule's) from those
            e.groups = [group_of[p] for p in e.params]
        ages = {p: int(float(st["step"])) for p, st in raw.items() if "step" in st}
        if any(self._knobs(g)[1][:5] != e.key[3][:5] for e in engines for g in e.groups) or any(
            len({ages.get(p, 0) for p in e.params}) > 1 for e in engines
        ):
            self._build_engines(ages)  # the checkpoint's buckets differ from ours
            engines = self._engines
        for e in engines:
            self._import_state(e, {p: raw[p] for p in e.params if p in raw})

    # ------------------------------------------------------------------ statistics
    @property
    def skipped_steps(self):
        """Steps skipped (on every rank alike) for non-finite gradients, with ``on_nonfinite='skip'``."""
        return max((e.rule.skipped_steps for e in self._ensure_engines()), default=0)

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every parameter bucket (for statistics)."""
        return [e.comm for e in self._ensure_engines()]

    def step_traffic(self):
        """Bytes of the step just finished (summed over buckets), and start counting anew:
        a :class:`slamb_comm.Traffic` whose ``payload_bytes`` / ``dense_payload_bytes`` read as
        "this step moved x of the y bytes a dense allreduce would have"."""
        total = Traffic()
        for c in self.communicators:
            total = total + c.stats.new_step()
        return total


# ---------------------------------------------------------------------------- 1-bit LAMB
_ONEBIT_KEYS = ("freeze_step", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "coeff_beta",
                "factor_max", "factor_min", "factor_threshold", "bias_correction", "on_nonfinite")
_ONEBIT_PROBE = []  # a one-element LocalTransport communicator: the core checks options on it


def _onebit_knobs(g):
    """Group ``g``'s 1-bit LAMB options but lr, as the core keeps them (a bucket shares them)."""
    conv = {"freeze_step": int, "betas": lambda b: tuple(float(x) for x in b), "bias_correction": bool,
            "on_nonfinite": str}
    return tuple(conv.get(k, float)(g[k]) for k in _ONEBIT_KEYS)


def _host_flat(t, n, what):
    """A saved state tensor as a flat float64 NumPy array of ``n`` elements (exact for float32/64)."""
    a = torch.as_tensor(t).detach().reshape(-1)
    if a.numel() != n:
        raise LayoutError(f"saved {what} has {a.numel()} elements, expected {n}")
    return a.to(device="cpu", dtype=torch.float64).numpy()


class OneBitLAMB(torch.optim.Optimizer):
    r"""1-bit LAMB (Li et al., HiPC 2022; DeepSpeed's ``OnebitLamb``) as a ``torch.optim.Optimizer``.

    The math is docs/onebit_lamb.md section 2 with section 3's choices, computed by
    :class:`slamb_comm.onebit_lamb.OneBitLamb` on each bucket's fused flat buffers: for
    ``freeze_step`` steps LAMB on the gradient averaged over the ranks (one dense allreduce per
    step), then v frozen and each rank's momentum averaged by the error-compensated 1-bit
    exchange (signs, one scale per rank and chunk), the LAMB coefficient frozen and rescaled by
    a bounded factor. Alone (no ``DistributedOptimizer``) it is that rule with P = 1 (no
    exchange; with ``bias_correction=True`` and ``freeze_step`` beyond the run, exactly
    ALGORITHM.md's LAMB). Wrapped by :func:`DistributedOptimizer` (torch.distributed) or
    :func:`slamb_comm.adapters.horovod.DistributedOptimizer` it runs over all P ranks of the
    group. The exchange happens inside ``step()``, after the backward pass (no overlap with
    it); ``synchronize()`` only agrees on the step (one small allgather), and ``p.grad`` stays
    each rank's own gradient (clipping between ``synchronize()`` and ``step()`` clips it).

    Args:
        params: parameters or parameter groups; every option can be set per group. ``lr`` is
            read at every step (lr schedulers work); the other options may change between
            steps too, alike for all groups of a bucket and on every rank.
        lr, freeze_step, betas, eps, weight_decay, max_coeff, min_coeff, coeff_beta,
        factor_max, factor_min, factor_threshold, bias_correction: as
            :class:`slamb_comm.onebit_lamb.OneBitLamb` (DeepSpeed's names and defaults;
            ``bias_correction=False`` is DeepSpeed's rule).
        on_nonfinite: ``'skip'`` (default): a step with a NaN/Inf gradient on any rank is
            skipped on every rank (logged, counted in :attr:`skipped_steps`); ``'raise'``:
            every rank raises :class:`slamb_comm.NonFiniteError`. Either way nothing changes.

    Buckets: trainable parameters are fused per (device, compute dtype, options but ``lr``,
    step count); each bucket has its own exchange, momentum scaling (γ̄ is over the bucket's
    tensors; DeepSpeed takes it over all) and error buffers, and groups sharing a bucket must
    have the same ``lr`` at each step (ConfigError). Parameters with ``requires_grad=False``
    at construction are not optimised.

    State: per parameter ``step`` (a float32 tensor), ``exp_avg``, ``exp_avg_sq`` and
    ``exp_avg_sq_fresh`` (live views into the core's fused buffers, float32 -- float64 for
    float64 parameters; the fresh second moment is zeros until the end of the warm-up),
    ``lamb_coeff_freeze``, ``last_factor`` and ``scaling_coeff`` (Python floats; γ is 0.0
    until the first compression step); when P > 1, the first parameter of each bucket also
    holds the bucket's exchange state: ``worker_error`` (N' elements), ``server_error`` (N'/P)
    and their ``exchange_rank`` / ``exchange_size``. Every rank's error buffers are its own:
    ``state_dict()`` / ``load_state_dict()`` round-trip exactly, so a run resumed with each
    rank loading **its own** saved state is bitwise the run that was interrupted (as for
    :mod:`slamb_comm.checkpoint`). Error buffers saved by another rank or for another P (e.g.
    after Horovod's idiom: rank 0 loads, ``hvd.broadcast_optimizer_state``) are reset to zero
    with a warning, as DeepSpeed does on every load: a valid run, not bitwise the interrupted
    one.

    Failures: a gradient that is ``None`` on a rank counts as zero there (the core fuses every
    tensor of a bucket); a bucket whose parameters have no gradient on any rank does not step.
    A parameter whose shape or dtype changed after construction raises LayoutError on its rank
    and PeerError on the others (nothing changes anywhere); ranks that disagree on options,
    ``lr`` or step count raise ConfigError on every rank. With several buckets every gradient
    is checked for NaN/Inf before any bucket steps (one more pass over them), so a skipped step
    skips every bucket.

    Data types: float32/float64 parameters are updated in place; float16/bfloat16 parameters
    through float32 copies (a whole bucket's at once, during the step), cast back.
    """

    def __init__(self, params, lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, bias_correction=False, on_nonfinite="skip"):
        defaults = dict(lr=lr, freeze_step=freeze_step, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                        factor_min=factor_min, factor_threshold=factor_threshold,
                        bias_correction=bias_correction, on_nonfinite=on_nonfinite)
        self._check_options(defaults)
        self._engines = None
        super().__init__(params, defaults)  # checks every group (add_param_group)
        self._onebit_transport = getattr(self, "_onebit_transport", None)  # set first by the distributed class
        self._onebit_names = getattr(self, "_onebit_names", None) or {}
        self._published = {}  # param -> the torch state entries _publish wrote (to see outside changes)
        self._build_engines()

    @staticmethod
    def _check_options(g):
        if not (isinstance(g["lr"], (int, float)) and g["lr"] >= 0):
            raise ConfigError(f"lr must be a number >= 0, got {g['lr']!r}")
        if not _ONEBIT_PROBE:
            _ONEBIT_PROBE.append(Communicator(None, Layout([(1,)], np.float32), ratio=1.0, seed=0))
        OneBitLamb(_ONEBIT_PROBE[0], lr=g["lr"], **{k: g[k] for k in _ONEBIT_KEYS})  # ConfigError if out of range

    def add_param_group(self, param_group):
        """Add a parameter group (options default to the constructor's); its parameters get
        buckets of their own, at step 0."""
        super().add_param_group(param_group)
        self._check_options(self.param_groups[-1])
        if self._engines is not None:
            self._build_engines()

    def _build_engines(self):
        """Bucket the trainable parameters by (device, compute dtype, options, step count) and
        build one Communicator + core OneBitLamb per bucket, keeping existing state. Collective
        when distributed."""
        saved = {p: dict(self.state[p]) for e in (self._engines or []) for p in e.params}
        transport = self._onebit_transport if self._onebit_transport is not None else LocalTransport()
        buckets = {}
        for gi, g in enumerate(self.param_groups):
            for j, p in enumerate(g["params"]):
                if p.requires_grad:
                    age = int(float(saved[p]["step"])) if p in saved else 0
                    key = (str(p.device), str(_state_dtype(p.dtype)), _onebit_knobs(g), age)
                    buckets.setdefault(key, []).append((p, g, self._onebit_names.get(id(p), f"group{gi}.{j}")))
        self._engines = []
        for key, items in buckets.items():
            params, groups, names = ([it[k] for it in items] for k in range(3))
            e = _Engine(key, params, groups, names, _state_dtype(params[0].dtype))
            e.comm = Communicator(transport, Layout([tuple(p.shape) for p in params], e.np_dtype, names=names),
                                  ratio=1.0, seed=0)
            e.rule = OneBitLamb(e.comm, lr=float(groups[0]["lr"]), **dict(zip(_ONEBIT_KEYS, key[2])))
            self._import_state(e, {p: saved[p] for p in params if p in saved})
            self._engines.append(e)
        self._params = [p for g in self.param_groups for p in g["params"]]

    def _import_state(self, e, raw):
        """Load ``raw`` (param -> saved state dict) into bucket ``e`` exactly; fresh state if empty."""
        r, lay, ex = e.rule, e.comm.layout, e.rule.exchange
        have = [p for p in e.params if "exp_avg" in raw.get(p, ())]
        missing = [n for p, n in zip(e.params, e.names) if "exp_avg" not in raw.get(p, ())]
        t = 0
        if have:
            steps = {int(float(raw[p]["step"])) for p in have}
            if len(steps) != 1 or (missing and steps != {0}):
                raise ValueError(f"the OneBitLAMB state to load mixes step counts {sorted(steps)} in one bucket"
                                 + (f" or lacks parameter(s) {missing[:5]}" if missing else ""))
            t = steps.pop()
        m, v, f = (np.zeros(lay.total, e.np_dtype) for _ in range(3))
        segments = lay.segments()
        for p in have:
            o, n = segments[e.index[p]]
            m[o:o + n] = _host_flat(raw[p]["exp_avg"], n, "exp_avg")
            v[o:o + n] = _host_flat(raw[p]["exp_avg_sq"], n, "exp_avg_sq")
            fresh = raw[p].get("exp_avg_sq_fresh")  # the core's f = v where it has none
            f[o:o + n] = v[o:o + n] if fresh is None else _host_flat(fresh, n, "exp_avg_sq_fresh")
        st = [raw.get(p, {}) for p in e.params]
        gamma = [float(s.get("scaling_coeff", 0.0)) for s in st]
        state = {"step": t, "m": m, "v": v, "f": f, "skipped_steps": r.skipped_steps,
                 "kappa": [float(s.get("lamb_coeff_freeze", 0.0)) for s in st],
                 "phi": [float(s.get("last_factor", 1.0)) for s in st],
                 "gamma": None if not any(gamma) else [g or 1.0 for g in gamma],
                 "exchange": dict(ex.state_dict(), worker_error=None, server_error=None)}
        if e.comm.size > 1:  # error buffers always exist (zeros until the first exchange): same keys everywhere
            src = st[0]
            mine = ("worker_error" in src and int(src.get("exchange_rank", -1)) == ex.rank
                    and int(src.get("exchange_size", -1)) == ex.size)
            if not mine and t > r.freeze_step:
                _log.warning("slamb_comm: OneBitLAMB bucket %s: the state loaded holds no 1-bit error buffers of this "
                             "rank (%d of %d): they restart from zero. A valid run, not bitwise the interrupted one; "
                             "load every rank's own state for that.", e.names[0], ex.rank, ex.size)
            state["exchange"].update(
                worker_error=_host_flat(src["worker_error"], ex.padded, "worker_error") if mine
                else np.zeros(ex.padded, ex.acc_dtype),
                server_error=_host_flat(src["server_error"], ex.chunk, "server_error") if mine
                else np.zeros(ex.chunk, ex.acc_dtype))
        r.load_state_dict(state)
        like = _array(torch.empty(0, dtype=e.dtype, device=e.params[0].device))
        with _cuda_scope(e.params[0].device):
            r._ensure_state(_arr.namespace(like), like)  # m, v, f on the parameters' device, to publish views of
        self._publish(e)

    def _publish(self, e):
        """Point each parameter's torch state at the core's state (views of m, v, f and the error
        buffers; the per-tensor numbers as Python floats, which torch's load keeps exactly)."""
        r, lay, ex = e.rule, e.comm.layout, e.rule.exchange
        for i, (p, (o, n), shape) in enumerate(zip(e.params, lay.segments(), lay.shapes)):
            st = self.state[p]
            st["step"] = torch.tensor(float(r.t))
            st["exp_avg"] = _tensor_of(r.m[o:o + n]).view(shape)
            st["exp_avg_sq"] = _tensor_of(r.v[o:o + n]).view(shape)
            st["exp_avg_sq_fresh"] = _tensor_of(r.f[o:o + n]).view(shape)
            st["lamb_coeff_freeze"] = float(r.kappa[i])
            st["last_factor"] = float(r.phi[i])
            st["scaling_coeff"] = 0.0 if r.gamma is None else float(r.gamma[i])
            if i == 0 and ex.worker_error is not None:
                st["worker_error"] = _tensor_of(ex.worker_error)
                st["server_error"] = _tensor_of(ex.server_error)
                st["exchange_rank"], st["exchange_size"] = ex.rank, ex.size
            self._published[p] = dict(st)

    def _pull(self, e):
        """Before a step: re-import bucket ``e`` if its torch state was replaced since the last
        step (``hvd.broadcast_optimizer_state`` writes the tensors in place and replaces the
        numbers), apply the groups' options to the core and return the bucket's lr."""
        for p in e.params:
            st, pub = self.state[p], self._published.get(p, {})
            if st.keys() != pub.keys() or any(st[k] is not v for k, v in pub.items()) \
                    or int(float(st["step"])) != e.rule.t:
                if self._onebit_transport is not None and int(float(st.get("step", 0))) != e.rule.t:
                    _log.warning("slamb_comm: OneBitLAMB state of bucket %s was replaced from outside (e.g. "
                                 "hvd.broadcast_optimizer_state after rank 0 loaded a checkpoint): this rank "
                                 "continues from it, at step %d", e.names[0], int(float(st.get("step", 0))))
                self._import_state(e, {q: self.state[q] for q in e.params})
                break
        knobs = _onebit_knobs(e.groups[0])
        if any(_onebit_knobs(g) != knobs for g in e.groups[1:]):
            raise ConfigError("parameter groups that share a OneBitLAMB bucket now disagree on an option other than "
                              "lr; change it for every group at once")
        if knobs != e.key[2]:
            self._check_options(e.groups[0])
            for k, val in zip(_ONEBIT_KEYS, knobs):
                setattr(e.rule, k, val)
            e.key = e.key[:2] + (knobs,) + e.key[3:]
        return self._lr(e)

    @staticmethod
    def _lr(e):
        lrs = {float(g["lr"]) for g in e.groups}
        if len(lrs) != 1:
            raise ConfigError(f"parameter groups that share a OneBitLAMB bucket ask for different lr {sorted(lrs)}")
        return lrs.pop()

    def _status(self):
        """This rank's view of the step before anything changes: its first problem (a parameter,
        the set of parameters or a bucket's groups changed), whether a gradient is not finite
        (checked only with several buckets, so that they skip together; one bucket's core checks
        its own), and per bucket whether it has a gradient and a fingerprint of its options, lr
        and step count."""
        problem = _changed_set(self, self._params)
        bad, have, prints = False, [], []
        for e in self._engines:
            lr = None
            try:
                lr = self._pull(e)
            except ValueError as err:  # ConfigError, LayoutError, a mixed state
                problem = problem or err
            for i, p in enumerate(e.params):
                problem = problem or _changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
            grads = [p.grad for p in e.params if p.grad is not None]
            have.append(bool(grads))
            if len(self._engines) > 1 and grads and problem is None and not bad:
                bad = not bool(torch.stack([torch.isfinite(g.to_dense() if g.is_sparse else g).all()
                                            for g in grads]).all())
            h = hashlib.blake2b(repr((e.key[1:], lr, e.rule.t)).encode(), digest_size=6).digest()
            prints.append(float(int.from_bytes(h, "big")))  # < 2**48: exact in a float64
        return problem, bad, have, prints

    def _apply(self, nonfinite, have):
        """Step every bucket that has a gradient on some rank, unless some rank's is not finite."""
        if nonfinite:
            err = NonFiniteError(f"OneBitLAMB: non-finite gradient (NaN/Inf) on rank(s) {list(nonfinite)}; the step "
                                 "was skipped on every rank and nothing was changed", nonfinite)
            if any(e.rule.on_nonfinite == "raise" for e in self._engines):
                raise err
            for e in self._engines:
                e.rule.skipped_steps += 1
            _log.warning("slamb_comm: %s", err)
            return
        for e, h in zip(self._engines, have):
            if not h:  # no gradient on any rank: the bucket does not step
                continue
            x, g, n = _Params(e), _Grads(e), len(e.params)
            xs = [x[i] for i in range(n)]
            with _cuda_scope(e.params[0].device):
                e.rule.step(xs, [g[i] for i in range(n)], lr=self._lr(e))
            for i in range(n):
                x.written(i)
            self._publish(e)

    @torch.no_grad()
    def step(self, closure=None):
        """One 1-bit LAMB step of every bucket (in a single process: P = 1)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        problem, bad, have, _ = self._status()
        if problem is not None:
            raise problem
        self._apply([0] if bad else [], have)
        return loss

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output exactly (moments and error buffers in their saved precision)."""
        raw = _saved_state_by_param(self, state_dict)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            self._check_options(g)
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for e in self._engines:  # torch's load made new group dicts: read options from those
            e.groups = [group_of[p] for p in e.params]
            self._import_state(e, {p: raw[p] for p in e.params if p in raw})

    @property
    def skipped_steps(self):
        """Steps skipped (on every rank alike) for non-finite gradients, with ``on_nonfinite='skip'``."""
        return max((e.rule.skipped_steps for e in self._engines), default=0)

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every parameter bucket (for statistics)."""
        return [e.comm for e in self._engines]

    step_traffic = SLAMB.step_traffic


# ---------------------------------------------------------------------------- shared mixin parts
_TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
             "Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
              "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


@contextlib.contextmanager
def _skip_synchronize(self):
    """``step()`` inside this context does not synchronize (call ``synchronize()`` first)."""
    self._should_synchronize = False
    try:
        yield
    finally:
        self._should_synchronize = True


def _add_param_group_before_wrapping(self, param_group):
    """Only during construction: the hooks and buckets of a wrapped optimizer are fixed once
    ``_init_common`` has run (it sets ``_coll``)."""
    if getattr(self, "_coll", None) is not None:
        base = self.__class__.__mro__[1].__name__
        raise NotImplementedError(f"add parameter groups to the {base} optimizer before wrapping it in "
                                  "DistributedOptimizer")
    super(self.__class__, self).add_param_group(param_group)


def _set_backward_passes_per_step(self, passes):
    """Change the number of backward passes accumulated per step (as in Horovod)."""
    self.backward_passes_per_step = passes
    for p in self._allreduce_delay:
        self._allreduce_delay[p] = passes


def _register_hooks(opt, params=None):
    """Gradient hooks on ``params`` (default: every trainable parameter), as Horovod registers
    them: only on ranks inside the process set."""
    if not hasattr(opt, "_hook_handles"):
        opt._hook_handles = []
    if params is None:
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        opt._requires_update.append(p)
        opt._allreduce_delay[p] = opt.backward_passes_per_step
        if opt._member:
            opt._hook_handles.append(p.register_post_accumulate_grad_hook(opt._make_hook(p)))


_OPTIMIZERS = itertools.count()


def _init_common(opt, coll):
    """What both distributed optimizers share: the framework's collectives, membership, the flag."""
    opt._coll = coll
    opt._member = coll.member
    coll.recognise(opt)
    opt._flag = None  # this step's "trainable set grew" allreduce: None, (handle, buf), or False (consumed)
    opt._flag_name = f"slamb_comm.trainable.{next(_OPTIMIZERS)}"
    opt._requires_update = []
    opt._allreduce_delay = {}


def _launch_trainable_flag(self, extra=None):
    """Once per step (from the first gradient hook, or from synchronize()): how many ranks have a
    parameter that became trainable after the optimizer was built (``requires_grad`` set later).
    One bit per rank (P / 31 int32 words, summed: distinct bits add up to their OR), asynchronous,
    so Horovod fuses it with the step's other tensors. ``extra``: further int32 values to sum
    alongside (their sums are left in ``self._flag_extra``); by default ``self._flag_words()``."""
    if self._flag is not None:
        return
    if extra is None:
        extra = self._flag_words()
    known = self._known()
    self._grown = [p for p in self._all_params if p.requires_grad and p not in known]
    nw = (self._coll.size + 30) // 31
    buf = torch.zeros(nw + len(extra), dtype=torch.int32, device=self._coll.device)
    if len(extra):
        buf[nw:] = torch.tensor(list(extra), dtype=torch.int32)
    if self._grown:
        r = self._coll.rank
        buf[r // 31] = 1 << (r % 31)
    handle = self._coll.allreduce_async(buf, self._flag_name)
    self._flag = (handle, buf)


def _wait_trainable_flag(self):
    """The parameters to adopt at this step: those that became trainable, when every rank has them;
    [] when no rank has. If only some ranks do, the caller's ``abandon()`` runs and every rank
    raises: LayoutError where the set grew, PeerError elsewhere."""
    _launch_trainable_flag(self)
    handle, _ = self._flag
    self._flag = False
    words = self._coll.wait(handle).tolist()
    self._flag_extra = words[(self._coll.size + 30) // 31:]
    ranks = [r for r in range(self._coll.size) if words[r // 31] >> (r % 31) & 1]
    if not ranks:
        return []
    if len(ranks) == self._coll.size:
        return self._grown
    self._abandon()
    if self._grown:
        raise LayoutError(f"parameter(s) {[self._names.get(id(p), '?') for p in self._grown][:5]} became trainable "
                          f"(requires_grad) after the optimizer was built on rank(s) {ranks} but not on every rank; "
                          "set requires_grad alike everywhere; the step was abandoned on every rank")
    raise PeerError(f"rank(s) {ranks} have parameters that became trainable after the optimizer was built, the "
                    "others do not (see their error); the step was abandoned on every rank", ranks)


# ---------------------------------------------------------------------------- distributed SLAMB
class _DistributedSlamb(torch.optim.Optimizer):
    """Methods of the class :func:`DistributedOptimizer` builds around a :class:`SLAMB`.

    Per step, each parameter's gradient hook (after ``backward_passes_per_step`` passes)
    updates that parameter's local moments and launches an asynchronous Average
    of its momentum entries on the shared mask M_t, so the exchange overlaps the rest of the
    backward pass. ``synchronize()`` waits for them (submitting zeros for parameters that got
    no gradient on this rank, so no rank waits forever) and writes the means back;
    ``step()`` applies freshness, trust ratios, the update and the periodic parameter sync.

    Gradient clipping between ``synchronize()`` and ``step()`` (under ``skip_synchronize()``)
    works: if any rank changed its gradients after its hooks consumed them, every rank
    recomputes its moments from the changed gradients and redoes the exchange (one more
    masked allreduce on such steps; a 1-element allreduce decides it on steps with an
    explicit ``synchronize()``). Unlike Horovod, ``p.grad`` is not replaced by a mean: SLAMB
    exchanges momenta, and each rank's gradients stay local.
    """

    def __init__(self, params, names, compression, backward_passes_per_step, coll, sum_op=False,
                 gradient_predivide_factor=1.0):
        # A rank outside the process set optimises alone (P = 1), as Horovod's non-members do.
        self._slamb_transport = coll.transport()
        self._slamb_names = self._names = names
        self._slamb_defer_build = True
        super(self.__class__, self).__init__(params)
        _init_common(self, coll)
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = gradient_predivide_factor
        self._options_agreed = False  # update options are checked before the first step (after a broadcast)
        self._ddp = False  # True once a SlambHookState took this optimizer (DDP launches the exchange)
        self._build_engines()
        self._where = {p: (e, i) for e in self._engines for i, p in enumerate(e.params)}
        self._consumed = {}
        self._synchronized = False
        self._should_synchronize = True
        self._nonfinite = None
        self._layout_problem = None  # this rank's LayoutError of the open step, sent as a NaN status
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._exchanges = itertools.count()
        _register_hooks(self)

    def _known(self):
        return self._where

    def _flag_words(self):
        """Sent with the per-step flag: whether this rank's groups ask for a new ratio."""
        def asks(e):
            try:
                return self._requested_ratio(e) != e.comm.ratio
            except ConfigError:
                return True  # groups of a bucket disagree: the change fails collectively, with this error
        return [int(any(asks(e) for e in self._engines))]

    def _change_ratios(self):
        """Some rank asked for a new ratio: every rank moves every bucket to its groups' ratio,
        collectively (each bucket one 3-word agreement); if the ranks disagree, ConfigError on
        those that changed it, PeerError on the others, and nothing changes."""
        for e in self._engines:
            self._set_ratio(e)

    add_param_group = _add_param_group_before_wrapping

    # -------------------------------------------------------------- hooks
    set_backward_passes_per_step = _set_backward_passes_per_step

    def _make_hook(self, p):
        def hook(param):
            if self._ddp:  # slamb_hook launches the exchange from DDP's buckets instead
                return
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_TOO_MANY)
            self._allreduce_delay[p] -= 1
            self._synchronized = False  # a new backward pass (e.g. after a step GradScaler skipped)
            self._nonfinite = None
            if self._allreduce_delay[p] == 0:
                self._launch(p)
        return hook

    def _begin(self, e):
        if isinstance(self._engines, str):
            raise RuntimeError("parameter groups changed after DistributedOptimizer was built")
        _launch_trainable_flag(self)
        if self._layout_problem is None:
            self._layout_problem = _changed_set(self, self._all_params)
        try:
            self._pull(e)
        except ConfigError as err:  # an option fixed at construction changed on this rank: send it as a status
            if self._layout_problem is None:
                self._layout_problem = err
        e.rule.begin_step()
        e.open = True
        e.launched = {}
        e.encode_s = 0.0
        e.payload = 0
        e.means = None
        e.counts = None if e.key[3][1] == "topk" else e.rule.counts()
        e.wire = e.comm.value_dtype

    def _launch_once(self, p):
        """``_launch(p)`` unless this step already launched it (DDP's hook, once per bucket)."""
        e, _ = self._where[p]
        if not (e.open and p in e.launched):
            self._synchronized = False
            self._nonfinite = None
            self._launch(p)

    def _launch(self, p, redo=False):
        """Local moments of ``p`` from its gradient, and (except for the topk mask) the async
        Average of its momentum entries on M_t."""
        e, i = self._where[p]
        if not e.open:
            self._begin(e)
        t0 = time.perf_counter()
        if self._layout_problem is None:
            self._layout_problem = _changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
        changed = self._layout_problem is not None
        if not changed:
            g, _ = self._grad_array(p, e)
            self._consumed[p] = None if p.grad is None else (id(p.grad), p.grad._version)
        if e.counts is None:  # topk mask: pick now, exchange fused after every gradient is in
            if not changed:
                with _cuda_scope(p.device):
                    e.rule.accumulate(i, g)
            e.launched[p] = None
            return
        buf = torch.empty(e.counts[i] + 1, dtype=_torch_dtype(e.wire), device=p.device)
        # Status slot: 0, or -1 where this rank has no gradient for p (the Average is then -1 only
        # if no rank has one: p is left as it is), or inf if this rank's gradient is not finite (or
        # its square would overflow v), computed on the device without a host read; NaN if a
        # parameter of this rank no longer fits its bucket (it still takes part, with zeros). The
        # Average spreads inf/NaN.
        if changed:
            buf.zero_()[-1] = math.nan
        else:
            fine = -1.0 if p.grad is None else 0.0
            with _cuda_scope(p.device):
                bad = e.rule.accumulate(i, g, out=_array(buf)[:-1])  # this rank's new momentum on M_t
            if isinstance(bad, (bool, np.bool_)):
                buf[-1] = math.inf if bad else fine
            else:
                buf[-1:].copy_(torch.where(torch.from_dlpack(bad), math.inf, fine).reshape(1))
        pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        name = f"slamb_comm.momentum.{e.names[i]}" + (".redo" if redo else "")
        handle = self._coll.allreduce_async(buf, name, average=True, prescale=pre, postscale=post)
        e.launched[p] = (handle, buf)
        e.payload += buf.numel() * buf.element_size()
        e.encode_s += time.perf_counter() - t0

    def _finish_exchange(self):
        """Wait for every launched exchange and write the means back.

        Non-finite values on any rank (seen by every rank alike, through the status slot or
        the averaged values) abandon the step on every rank, fill the affected gradients
        with NaN -- as Horovod's averaged gradients would be -- so that an AMP GradScaler
        skips the step on every rank, and make the next ``step()`` raise NonFiniteError.
        A parameter that no longer fits its bucket on some rank (NaN status slot, or a
        rejected fused exchange) abandons the step too, and raises on every rank at once.
        """
        t1 = time.perf_counter()
        flags, results, failed, changed = [], [], [], None
        absent = -1.0 + 0.5 / self._coll.size  # an averaged status at most this: no rank had a gradient
        for e in self._engines:
            e.skip = set()
            if e.open and e.counts is not None:
                for p, (handle, buf) in e.launched.items():
                    out = self._coll.wait(handle)
                    results.append((e, p, out))
                    flags.append(torch.isfinite(out).all())
        for e in self._engines:
            if e.open and e.counts is None:  # topk mask: the core's fused exchange, after all moments
                try:
                    with _cuda_scope(e.params[0].device):
                        # which parameters have a gradient on some rank (every rank takes part)
                        have = torch.tensor([p.grad is not None for p in e.params], dtype=torch.int32,
                                            device=self._coll.device)
                        self._coll.allreduce(have, f"slamb_comm.have.{next(self._exchanges)}")
                        e.skip = {i for i, c in enumerate(have.tolist()) if c == 0}
                        if self._layout_problem is not None:  # input the core rejects, collectively
                            e.comm.masked_allreduce([], e.rule.t + 1)
                        else:
                            e.rule.exchange(_Grads(e))
                except NonFiniteError as err:  # raised on every rank; the core abandoned the step
                    e.open = False
                    failed.append((e, err))
                except (LayoutError, PeerError) as err:  # also raised on every rank
                    changed = err
                    break
        t2 = time.perf_counter()
        bad, gone = [], []
        if flags:  # one host read: every exchange's finiteness, and which parameters no rank had a gradient for
            words = torch.stack([torch.stack(flags).all()] + [out[-1] <= absent for _, _, out in results]).tolist()
            finite, gone = words[0], words[1:]
        if flags and not finite:
            bad = [(e, p) for e, p, out in results if not bool(torch.isfinite(out).all())]
            if changed is None and any(bool(torch.isnan(out[-1])) for _, _, out in results):
                changed = True
        if changed is not None:
            self._raise_changed(None if changed is True else changed)
        if bad or failed:
            bad += [(e, p) for e, _ in failed for p in e.params]
            names = [e.names[e.index[p]] for e, p in bad]
            self._abort()
            with torch.no_grad():
                for _, p in bad:
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
            self._nonfinite = NonFiniteError(
                f"SLAMB momentum exchange: non-finite values (NaN/Inf) from some rank in {names[:5]}; "
                "the step was abandoned on every rank and no state was changed", (), names)
            return
        for (e, p, _), nobody in zip(results, gone):
            if nobody:
                e.skip.add(e.index[p])
        for e, p, out in results:  # the means, applied by step() (m is not touched before then)
            if e.means is None:
                e.means = [None] * len(e.params)
            e.means[e.index[p]] = _array(out[:-1])
        t3 = time.perf_counter()
        for e in self._engines:
            if e.open and e.counts is not None:
                lay = e.comm.layout
                dense = lay.total * lay.dtype.itemsize
                sent = sum(e.counts)
                e.comm.stats.record("masked_allreduce", Traffic(
                    1, e.payload, allreduce_wire(e.payload, e.comm.size), dense, allreduce_wire(dense, e.comm.size),
                    sent, lay.total, e.encode_s, t2 - t1, t3 - t2))
                e.launched = {}

    def _raise_changed(self, peer_err):
        """On every rank alike: abandon the step; this rank's error (LayoutError: a parameter
        changed; ConfigError: a fixed option changed) if it has one, else a PeerError naming the
        ranks that do (``peer_err``, or asked for here)."""
        problem = self._layout_problem
        self._abort()
        if peer_err is None:  # which ranks: one more collective, on this failure path only
            flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=self._coll.device)
            codes = self._coll.allgather(flag, f"slamb_comm.changed.{next(self._exchanges)}")
            ranks = [r for r, c in enumerate(codes.tolist()) if c]
            peer_err = PeerError(f"SLAMB momentum exchange: rank(s) {ranks} have a parameter or an option that "
                                 "changed after the optimizer was built (see their error); the step was abandoned "
                                 "on every rank and nothing was changed", ranks)
        raise problem if problem is not None else peer_err

    def _abandon(self):
        """Wait for whatever this step launched (Horovod needs every handle collected), then abort."""
        for e in self._engines:
            for launched in e.launched.values():
                if launched is not None:
                    self._coll.wait(launched[0])
        self._abort()

    def _abort(self):
        if self._flag:
            self._coll.wait(self._flag[0])
        self._flag = None
        for e in self._engines:
            if e.open:
                e.rule.abort_step()
                e.open = False
                e.launched = {}
                e.means = None
        self._consumed = {}
        self._layout_problem = None
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = False

    def synchronize(self):
        """Finish this step's momentum exchange (every rank submits every tensor).

        Outside the process set there is nothing to exchange (the rank optimises alone)."""
        if not self._member:
            self._synchronized = True
            return
        self._launch_missing()
        grown = _wait_trainable_flag(self)
        rerate = self._flag_extra[0] > 0  # some rank's groups ask for a new ratio (a schedule)
        if grown or rerate:  # both collective decisions: abandon this exchange and redo it after
            self._abandon()
            if rerate:  # every rank alike, from this step on (or an error on every rank)
                self._change_ratios()
            if grown:  # every rank unfroze the same parameters: adopt them (collectively)
                self._build_engines()  # keeps the state; the new parameters get a bucket of their own, at step 0
                self._where = {p: (e, i) for e in self._engines for i, p in enumerate(e.params)}
                _register_hooks(self, grown)
                self._options_agreed = False
            self._flag = False
            self._launch_missing()
        self._finish_exchange()
        if not self._options_agreed:  # the update options, as broadcast_optimizer_state left them
            try:
                for e in self._engines:
                    e.rule.agree_options(*self._lr_wd(e))
            except ConfigError:
                self._abort()
                raise
            self._options_agreed = True
        self._flag = None
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    def _launch_missing(self):
        missing = [p for p in self._requires_update
                   if not (self._where[p][0].open and p in self._where[p][0].launched)]
        for p in missing:  # a parameter without a gradient takes part with zeros (its status says so)
            self._launch(p)

    skip_synchronize = _skip_synchronize

    def _redo_if_grads_changed(self):
        """After an explicit synchronize(): if any rank changed a gradient its hooks had used
        (clipping, unscaling), every rank recomputes its moments and redoes the exchange."""
        changed = any(
            (None if p.grad is None else (id(p.grad), p.grad._version)) != self._consumed.get(p)
            for p in self._requires_update
        )
        flag = torch.tensor([1 if changed else 0], dtype=torch.int32, device=self._coll.device)
        self._coll.allreduce(flag, f"slamb_comm.regrad.{next(self._exchanges)}")
        if int(flag[0]) == 0:
            return
        for e in self._engines:
            e.launched = {}
            e.payload = 0
        for p in self._requires_update:
            self._launch(p, redo=True)
        self._finish_exchange()

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the exchange (unless already synchronized) and apply the SLAMB update.

        Outside the process set: the single-process SLAMB step (P = 1), as Horovod's non-members
        step their optimizer on the local gradient."""
        if not self._member:
            return super(self.__class__, self).step(closure)
        explicit = self._synchronized
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC)
        if not self._synchronized:
            self.synchronize()
        elif explicit and self._nonfinite is None:
            self._redo_if_grads_changed()
        self._synchronized = False
        if self._nonfinite is not None:
            err, self._nonfinite = self._nonfinite, None
            if any(e.rule.on_nonfinite == "raise" for e in self._engines):
                raise err
            for e in self._engines:
                e.rule.skipped_steps += 1
            _log.warning("slamb_comm: step skipped on every rank: %s", err)
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for e in self._engines:
            if not e.open:
                continue
            e.open = False
            if len(e.skip) == len(e.params):  # no gradient anywhere in the bucket: no step at all
                e.rule.abort_step()
                e.means = None
                continue
            lr, wd = self._lr_wd(e)
            x = _Params(e)
            with _cuda_scope(e.params[0].device):
                e.rule.apply(x, _Grads(e), means=e.means, lr=lr, weight_decay=wd, written=x.written, skip=e.skip)
            e.means = None
            self._publish(e)
        self._consumed = {}
        return loss

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``, when exchanges are in flight."""
        if any(d != self.backward_passes_per_step for d in self._allreduce_delay.values()):
            raise AssertionError(_ZERO_GRAD)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        """Abandon any step in flight, then restore the SLAMB state exactly."""
        if any(e.open for e in self._engines):
            self._abort()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(state_dict)
        self._where = {p: (e, i) for e in self._engines for i, p in enumerate(e.params)}


# ---------------------------------------------------------------------------- distributed 1-bit LAMB
class _DistributedOneBit(torch.optim.Optimizer):
    """Methods of the class :func:`DistributedOptimizer` builds around a :class:`OneBitLAMB`.

    ``synchronize()`` (or ``step()``) agrees on the step in one small allgather: whether some
    rank's parameter or options changed (then LayoutError/ConfigError there, PeerError
    elsewhere, and nothing changes), whether some rank's gradient is not finite (with several
    buckets), which buckets have a gradient anywhere, and that every rank has the same options,
    lr and step count. ``step()`` then runs the core's step per bucket: the dense gradient
    allreduce (warm-up) or the 1-bit momentum exchange, and the update. Nothing overlaps the
    backward pass; the gradient hooks only count backward passes (``backward_passes_per_step``,
    and ``zero_grad()`` refused before the step, as Horovod does). ``p.grad`` is never
    replaced: each rank's gradient stays its own.
    """

    def __init__(self, params, names, compression, backward_passes_per_step, coll, sum_op=False,
                 gradient_predivide_factor=1.0):
        if gradient_predivide_factor != 1.0:
            raise ValueError("OneBitLAMB averages gradients and momenta itself: gradient_predivide_factor must be 1")
        # A rank outside the process set optimises alone (P = 1), as Horovod's non-members do.
        self._onebit_transport = coll.transport()
        self._onebit_names = self._names = names
        super(self.__class__, self).__init__(params)
        _init_common(self, coll)
        self.backward_passes_per_step = backward_passes_per_step
        self._pending = self._synchronized = False
        self._should_synchronize = True
        self._plan = None
        _register_hooks(self)

    add_param_group = _add_param_group_before_wrapping

    set_backward_passes_per_step = _set_backward_passes_per_step
    skip_synchronize = _skip_synchronize

    def _make_hook(self, p):
        def hook(param):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_TOO_MANY)
            self._allreduce_delay[p] -= 1
            self._pending = True
            self._synchronized = False  # a new backward pass
        return hook

    def synchronize(self):
        """Agree on this step with every rank (one allgather of a few numbers per bucket); the
        exchange itself happens in ``step()``. Raises on every rank alike (nothing changes):
        LayoutError/ConfigError on a rank whose parameter or options changed, PeerError on the
        others; ConfigError if the ranks' options, lr or step counts differ."""
        if not self._member:
            self._synchronized = True
            return
        try:
            try:
                problem, bad, have, prints = self._status()
            except Exception as err:  # noqa: BLE001 -- still take part, then raise it here
                k = len(self._engines)
                problem, bad, have, prints = err, False, [False] * k, [0.0] * k
            row = torch.tensor([float(problem is not None), float(bad)] + [float(h) for h in have] + prints,
                               dtype=torch.float64, device=self._coll.device)
            rows = self._coll.allgather(row, self._flag_name + ".onebit").reshape(self._coll.size, -1).tolist()
        finally:
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
            self._pending = False
        failed = [r for r, w in enumerate(rows) if w[0]]
        if problem is not None:
            raise problem
        if failed:
            raise PeerError(f"OneBitLAMB: rank(s) {failed} have a parameter or an option that changed after the "
                            "optimizer was built (see their error); the step was abandoned on every rank and nothing "
                            "was changed", failed)
        k = len(have)
        differ = [r for r, w in enumerate(rows) if w[2 + k:] != rows[0][2 + k:]]
        if differ:
            raise ConfigError(f"OneBitLAMB: rank(s) {differ} differ from rank 0 in the options, lr or step count of a "
                              "bucket; set them alike on every rank (nothing was changed)")
        self._plan = ([r for r, w in enumerate(rows) if w[1]], [any(w[2 + b] for w in rows) for b in range(k)])
        self._synchronized = True

    @torch.no_grad()
    def step(self, closure=None):
        """Agree (unless already synchronized), then exchange and update every bucket.

        Outside the process set: the single-process step (P = 1)."""
        if not self._member:
            return super(self.__class__, self).step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize and self._synchronized:
            warnings.warn(_STEP_AFTER_SYNC)
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        plan, self._plan = self._plan, None
        self._apply(*plan)
        return loss

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``."""
        if self._pending:
            raise AssertionError(_ZERO_GRAD)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        """Forget any step in progress, then restore the state exactly (this rank's own error
        buffers; another rank's are reset to zero, with a warning)."""
        self._pending = self._synchronized = False
        self._should_synchronize = True
        self._plan = None
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(state_dict)


# ---------------------------------------------------------------------------- distributed top-k
class _DistributedTopK(torch.optim.Optimizer):
    """Methods of the class :func:`DistributedOptimizer` builds for ``compression=TopK(...)``.

    At ``synchronize()`` (or ``step()``), the gradients of each (device, dtype) bucket go
    through one fused error-feedback top-k allgather (:meth:`slamb_comm.Communicator.sparse_allgather`);
    ``p.grad`` becomes the mean over ranks of everyone's decoded top-k (times the number of
    ranks for a Sum), then the wrapped optimizer steps. The error buffers are part
    of ``state_dict()`` (under the extra key ``'slamb_comm_topk'``) and restore exactly.
    """

    def __init__(self, params, names, compression, backward_passes_per_step, coll, sum_op=False,
                 gradient_predivide_factor=1.0):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._names = names
        _init_common(self, coll)
        self.backward_passes_per_step = backward_passes_per_step
        self._sum = bool(sum_op)
        self.gradient_predivide_factor = gradient_predivide_factor
        self._synchronized = False
        self._should_synchronize = True
        self._pending = False
        _register_hooks(self)
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._transport = coll.transport()  # None outside the process set: nothing exchanged
        self._topk = []
        self._bucketed = set()
        self._add_buckets(self._requires_update if self._member else [])

    def _flag_words(self):
        return []

    def _add_buckets(self, params):
        """One fused top-k Communicator per (device, dtype) of ``params`` (collective). Parameters
        that become trainable later get buckets of their own, so no error buffer is remapped."""
        c = self._compression
        buckets = {}
        for p in params:
            buckets.setdefault((str(p.device), str(_state_dtype(p.dtype)), len(self._topk)), []).append(p)
        for key, ps in buckets.items():
            dt = _state_dtype(ps[0].dtype)
            layout = Layout([tuple(p.shape) for p in ps], _np_dtype(dt), names=[self._names[id(p)] for p in ps],
                            dense_threshold=c.dense_threshold or 0)
            comm = Communicator(self._transport, layout, ratio=c.ratio, value_dtype=c.value_dtype, seed=0,
                                topk_dense=c.dense_threshold is not None)
            self._topk.append((key, ps, dt, comm))
            self._bucketed.update(ps)

    def _known(self):
        return self._bucketed

    def _abandon(self):
        self._flag = None
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._pending = False

    set_backward_passes_per_step = _set_backward_passes_per_step

    def _make_hook(self, p):
        def hook(param):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_TOO_MANY)
            self._allreduce_delay[p] -= 1
            self._pending = True
        return hook

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every gradient bucket (for statistics)."""
        return [c for _, _, _, c in self._topk]

    def step_traffic(self):
        """Bytes of the step just finished, summed over buckets (see :meth:`SLAMB.step_traffic`)."""
        total = Traffic()
        for c in self.communicators:
            total = total + c.stats.new_step()
        return total

    def synchronize(self):
        """Exchange every gradient (zeros where a rank has none) and set ``p.grad`` to the mean.

        All buckets or none: every bucket is exchanged before any error buffer or ``p.grad``
        is written, and if a bucket fails (on every rank alike: NaN/Inf, or a parameter that
        changed on some rank) no bucket commits, so the step changes no state.

        Outside the process set nothing is exchanged: the wrapped optimizer steps on this rank's
        own gradients, as with Horovod."""
        if not self._member:
            self._synchronized = True
            return
        # One small Sum tells both which ranks have newly trainable parameters and, per parameter,
        # how many ranks have a gradient for it: none means it is left exactly as it is.
        before = list(self._requires_update)
        _launch_trainable_flag(self, extra=[int(p.grad is not None) for p in before])
        grown = _wait_trainable_flag(self)
        self._flag = None
        nowhere = {p for p, c in zip(before, self._flag_extra) if c == 0}
        if grown:  # unfrozen alike on every rank: exchanged from this step on, with zero error buffers
            self._add_buckets(grown)
            _register_hooks(self, grown)
        problem = _changed_set(self, self._all_params)
        means = []
        try:
            for b, (_, ps, dt, comm) in enumerate(self._topk):
                lay = comm.layout
                for i, p in enumerate(ps):
                    problem = problem or _changed(p, lay.names[i], lay.shapes[i], dt)
                if problem is not None:  # input the core rejects: it still takes part, the others raise PeerError
                    comm.sparse_allgather([])
                grads = []
                for p in ps:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(_array(_as_compute(p.grad, dt)))
                # A later bucket may still fail: commit the error buffers only once all succeeded.
                with _cuda_scope(ps[0].device):
                    means.append((comm, grads, comm.sparse_allgather(grads, commit=False)))
        except Exception as err:  # raised on every rank, at the same bucket: start afresh
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
            self._pending = False
            if problem is not None:
                raise problem from None
            if isinstance(err, NonFiniteError) and self._compression.on_nonfinite == "skip":
                self._skip_nonfinite(err)
                return
            raise
        for (_, ps, _, _), (comm, _, _) in zip(self._topk, means):
            with _cuda_scope(ps[0].device):  # from the local gradients, still in p.grad
                comm.commit_residual(skip={i for i, p in enumerate(ps) if p in nowhere})
        for (_, ps, _, comm), (_, _, mean) in zip(self._topk, means):
            for p, m in zip(ps, mean):
                if p in nowhere:  # no rank had a gradient: the wrapped optimizer leaves it alone
                    p.grad = None
                    continue
                out = _tensor_of(m)
                if self._sum:
                    out = out * comm.size
                out = out.to(p.grad.dtype)
                if p.grad.is_sparse:
                    p.grad = out.to_sparse()
                else:
                    p.grad.copy_(out)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._pending = False
        self._synchronized = True

    skip_synchronize = _skip_synchronize

    def _skip_nonfinite(self, err):
        """On every rank alike: NaN gradients (so an AMP GradScaler skips too), and the next
        ``step()`` does not step the wrapped optimizer. Logged and counted."""
        for _, ps, _, _ in self._topk:
            for p in ps:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        self._synchronized = True
        self._skip_next = True
        self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
        _log.warning("slamb_comm: top-k step skipped on every rank (%d so far): %s", self.skipped_steps, err)

    def step(self, closure=None):
        """Synchronize (unless under ``skip_synchronize()``), then the wrapped optimizer's step
        (skipped, on every rank, after a non-finite gradient under ``on_nonfinite='skip'``)."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC)
            self.synchronize()
        self._synchronized = False
        if getattr(self, "_skip_next", False):
            self._skip_next = False
            return None
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``."""
        if self._pending:
            raise AssertionError(_ZERO_GRAD)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state, plus this rank's error buffers under ``'slamb_comm_topk'``."""
        sd = super(self.__class__, self).state_dict()
        sd["slamb_comm_topk"] = [
            {"residual": None if c.residual is None else torch.from_numpy(_arr.to_host(c.residual).copy()),
             "seed": int(c.seed), "digest": c.state_dict()["digest"]}
            for _, _, _, c in self._topk
        ]
        return sd

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output, error buffers included, exactly."""
        state_dict = dict(state_dict)
        mine = state_dict.pop("slamb_comm_topk", None)
        self._synchronized = False
        self._should_synchronize = True
        self._pending = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(state_dict)
        if mine is not None:
            if len(mine) != len(self._topk):
                raise ValueError("the saved top-k state has a different number of buckets")
            for (_, ps, _, c), s in zip(self._topk, mine):
                st = c.state_dict()
                st.update(seed=s["seed"], digest=s["digest"],
                          residual=None if s["residual"] is None else s["residual"].numpy())
                c.load_state_dict(st)  # the error buffer moves to the gradients' device at the next exchange



# ---------------------------------------------------------------------------- building the distributed classes
def _wrap(optimizer, names, compression, backward_passes_per_step, coll, sum_op=False, gradient_predivide_factor=1.0):
    """The distributed optimizer around ``optimizer`` on the collectives ``coll``: a class built
    with ``type(name, (optimizer.__class__,), ...)`` sharing the optimizer's ``param_groups``."""
    slamb, onebit = isinstance(optimizer, SLAMB), isinstance(optimizer, OneBitLAMB)
    mixin = _DistributedSlamb if slamb else _DistributedOneBit if onebit else _DistributedTopK
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(mixin.__dict__))
    dist_opt = cls(optimizer.param_groups, names, compression, backward_passes_per_step, coll, sum_op,
                   gradient_predivide_factor)
    if (slamb or onebit) and any(e.rule.t > 0 for e in (optimizer._ensure_engines() if slamb else optimizer._engines)):
        dist_opt.load_state_dict(optimizer.state_dict())  # keep what the optimizer had (e.g. a loaded checkpoint)
    return dist_opt


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         process_group=None):
    """SLAMB, 1-bit LAMB or top-k exchange over ``torch.distributed``, in the form of Horovod's optimizer.

    For ``torchrun`` jobs that do not use DDP (a process group and your own loop), and together
    with :func:`slamb_hook` for DDP. Call ``torch.distributed.init_process_group`` first.

    * ``optimizer`` is a :class:`SLAMB`: SLAMB over the group -- each parameter's gradient hook
      (or, under DDP, :func:`slamb_hook`) updates its local moments and starts the asynchronous
      average of its momentum on the shared mask M_t; ``step()`` waits and applies the update
      and the periodic parameter sync.
    * ``optimizer`` is a :class:`OneBitLAMB`: 1-bit LAMB over the group -- at ``step()`` the
      dense gradient allreduce of the warm-up, then the 1-bit momentum exchange, and the update.
    * ``compression`` is a :class:`slamb_comm.TopK`: any optimizer; at ``step()`` (or
      ``synchronize()``) the gradients go through the error-feedback top-k exchange of
      ALGORITHM.md section 2 and the optimizer steps on their mean.

    Otherwise ValueError: for dense gradient averaging use ``DistributedDataParallel``.
    ``synchronize()`` / ``skip_synchronize()`` (gradient clipping), ``backward_passes_per_step``,
    ``zero_grad()``, checkpoints (``state_dict``), a NaN on one rank (the step is skipped on
    every rank) and process groups behave as in :mod:`slamb_comm.adapters.horovod`.

    Args:
        optimizer: a :class:`SLAMB` or :class:`OneBitLAMB`, or any torch optimizer with
            ``compression=TopK(...)``.
        named_parameters: ``(name, parameter)`` pairs naming every parameter (for errors and
            checkpoints); default names ``allreduce.noname.<group>.<index>``.
        compression: ``None`` or a :class:`slamb_comm.TopK`.
        backward_passes_per_step: gradients are accumulated locally over this many backward
            passes before the exchange.
        process_group: the group to exchange in (default: all ranks). Ranks outside it
            optimise alone, as Horovod's non-members do.
    """
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    slamb = isinstance(optimizer, (SLAMB, OneBitLAMB))
    topk = isinstance(compression, TopK)
    if slamb and compression is not None:
        raise ValueError(f"{type(optimizer).__name__} compresses momenta itself: pass no compression "
                         "(use SLAMB(mask='topk') for a top-k mask)")
    if not slamb and not topk:
        raise ValueError("DistributedOptimizer needs a SLAMB or OneBitLAMB optimizer or "
                         f"compression=slamb_comm.TopK(...); got {type(optimizer).__name__} with compression={compression!r}. For dense gradient "
                         "averaging use torch.nn.parallel.DistributedDataParallel")
    names = _check_named_parameters(named_parameters, optimizer.param_groups)
    return _wrap(optimizer, names, compression, backward_passes_per_step, _TorchCollectives(process_group))


# ---------------------------------------------------------------------------- DDP communication hooks
def _done(tensor):
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class SlambHookState:
    """State of :func:`slamb_hook`: the distributed SLAMB optimizer whose exchange the hook starts.

    Usage (two lines of a stock DDP script change)::

        opt = DistributedOptimizer(SLAMB(ddp.parameters(), lr=1e-3, ratio=0.1, beta3=0.9),
                                   named_parameters=ddp.module.named_parameters())
        ddp.register_comm_hook(SlambHookState(opt), slamb_hook)

    Tuning guide (SLAMB's knobs live on the optimizer):

    * ``ratio`` (k): the fraction of each large tensor's momentum averaged per step. The paper
      uses 0.1; the bytes per step are about ``k * N * value_bytes + 4 N / H``.
    * ``value_dtype='float16'`` halves the payload (values beyond +-65504 skip the step).
    * ``sync_interval`` (H): parameters are averaged every H steps (paper: 100).
    * ``beta3``: sweep it with the learning rate (0.9-0.999); it matters as much as lr at short
      budgets (ALGORITHM.md section 5).
    * DDP's ``bucket_cap_mb`` sets how soon a bucket's exchange starts; smaller buckets start
      earlier.

    The hook keeps the gradients local (SLAMB never averages gradients): DDP writes back each
    rank's own gradient. Gradient clipping then clips the local gradient, as with the Horovod
    adapter. The state pickles without the optimizer or its process group (it holds no state
    of its own: checkpoint ``opt.state_dict()``).
    """

    __slots__ = ("optimizer",)

    def __init__(self, optimizer):
        if not hasattr(optimizer, "_launch"):
            raise TypeError("SlambHookState takes the DistributedOptimizer(SLAMB(...)) that you step, "
                            f"got {type(optimizer).__name__}")
        optimizer._ddp = True  # the hook launches the exchange; the parameters' own hooks stand down
        optimizer._coll.immediate = True  # DDP's buckets come in the same order on every rank
        self.optimizer = optimizer

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.optimizer = None


def slamb_hook(state, bucket):
    """DDP communication hook for SLAMB: start the masked momentum exchange of the bucket's
    parameters (asynchronously) and return the bucket's local gradients unchanged."""
    opt = state.optimizer
    if opt is None:
        raise RuntimeError("this SlambHookState was unpickled without its optimizer; build a new one")
    for p in bucket.parameters():
        if p in opt._where:
            opt._launch_once(p)
    return _done(bucket.buffer())


class TopKHookState:
    """State of :func:`topk_hook`: top-k with error feedback for DDP, under any optimizer.

    Args:
        named_parameters: the model's ``(name, parameter)`` pairs (``ddp.module.named_parameters()``):
            error buffers are kept per parameter name, so they survive DDP's bucket rebuild
            after the first iteration and go into a checkpoint (:meth:`state_dict`).
        compression: a :class:`slamb_comm.TopK` (ratio, payload dtype, non-finite policy,
            always-dense rule).
        process_group: the group DDP uses (default: all ranks).

    Tuning guide: the allgather's bytes grow with the number of ranks P, so top-k beats a
    dense allreduce only while ``P * ratio * (value + 4 index bytes) < 8`` (fp32): ratio 0.01
    or below for tens of ranks. ``value_dtype='float16'`` saves a third of the payload.
    Error feedback keeps what is not sent, so nothing is lost, only delayed. A non-finite
    gradient on any rank makes every rank's bucket NaN (so an AMP GradScaler skips the step
    everywhere) with ``on_nonfinite='skip'``; with ``'raise'`` the hook's future carries
    :class:`slamb_comm.NonFiniteError`. Either way no error buffer changes.

    Pickling keeps the compression and the error buffers (host copies), not the process group.
    """

    __slots__ = ("compression", "names", "process_group", "residuals", "_comms")

    def __init__(self, named_parameters, compression, process_group=None):
        if not isinstance(compression, TopK):
            raise TypeError(f"compression must be a slamb_comm.TopK, got {compression!r}")
        self.compression = compression
        self.names = {id(p): n for n, p in named_parameters}
        self.process_group = process_group
        self.residuals = {}  # parameter name -> its error buffer (a view into its bucket's, or a host copy)
        self._comms = {}

    def step_traffic(self):
        """Bytes of the step just finished, summed over the buckets' exchanges (a
        :class:`slamb_comm.Traffic`), and start counting anew."""
        total = Traffic()
        for comm in self._comms.values():
            total = total + comm.stats.new_step()
        return total

    def state_dict(self):
        """The error buffers, per parameter name, as CPU tensors."""
        return {n: torch.from_numpy(_arr.to_host(r).copy()) for n, r in self.residuals.items()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output (the buffers move to the gradients' device at the next exchange)."""
        self.residuals = {n: np.asarray(t.numpy(), copy=True) for n, t in state.items()}
        self._comms = {}

    def __getstate__(self):
        return {"compression": self.compression, "names": {}, "residuals": self.state_dict()}

    def __setstate__(self, state):
        self.compression = state["compression"]
        self.names, self.process_group, self._comms = state["names"], None, {}
        self.load_state_dict(state["residuals"])

    def _comm(self, params, dtype):
        names = tuple(self.names.get(id(p), f"param{i}") for i, p in enumerate(params))
        key = (names, str(dtype))
        comm = self._comms.get(key)
        if comm is None:  # collective: every rank meets the same bucket at the same point
            for k in [k for k in self._comms if set(k[0]) & set(names)]:  # DDP rebuilt its buckets
                del self._comms[k]
            c = self.compression
            layout = Layout([tuple(p.shape) for p in params], _np_dtype(dtype), names=list(names),
                            dense_threshold=c.dense_threshold or 0)
            comm = Communicator(TorchTransport(self.process_group), layout, ratio=c.ratio,
                                value_dtype=c.value_dtype, seed=0, topk_dense=c.dense_threshold is not None)
            if any(n in self.residuals for n in names):  # error buffers from an earlier bucket or a checkpoint
                res = np.zeros(layout.total, layout.dtype)
                for n, (o, k) in zip(names, layout.segments()):
                    if n in self.residuals:
                        res[o:o + k] = _arr.to_host(self.residuals[n]).reshape(-1)
                comm.load_state_dict(dict(comm.state_dict(), residual=res))
            self._comms[key] = comm
        return comm, names


def topk_hook(state, bucket):
    """DDP communication hook: the bucket becomes the mean over ranks of every rank's decoded
    top-k of (gradient + error buffer), ALGORITHM.md section 2."""
    buf = bucket.buffer()
    params = bucket.parameters()
    dt = _state_dtype(buf.dtype)
    comm, names = state._comm(params, dt)
    grads = [_array(_as_compute(g, dt)) for g in bucket.gradients()]
    try:
        with _cuda_scope(buf.device):
            mean = comm.sparse_allgather(grads)
    except NonFiniteError as err:  # on every rank alike; no error buffer changed
        if state.compression.on_nonfinite == "raise":
            fut = torch.futures.Future()
            fut.set_exception(err)
            return fut
        _log.warning("slamb_comm: top-k step made NaN on every rank (an AMP GradScaler skips it): %s", err)
        buf.fill_(float("nan"))
        return _done(buf)
    for g, m in zip(bucket.gradients(), mean):
        g.copy_(_tensor_of(m).view(g.shape))
    lay = comm.layout
    for n, v in zip(names, lay.flat_views(comm.residual)):
        state.residuals[n] = v
    return _done(buf)
