"""slamb_comm: sparse communication for data-parallel training, on NumPy (CPU) and CuPy (GPU) arrays
over MPI (mpi4py), NCCL or a single process; it imports neither torch nor horovod.

>>> import numpy as np, slamb_comm as sc
>>> x = [np.ones((64, 200), np.float32), np.zeros(10, np.float32)]
>>> comm = sc.Communicator(None, x, ratio=0.1)     # None: one process
>>> _ = comm.sync(x)                                  # dense mean over ranks, in place
>>> mean = comm.sparse_allgather(x)                  # top-k + error feedback
>>> comm.stats.total.calls
2

The layers, from the bottom: :mod:`slamb_comm.device` (kernels), :mod:`slamb_comm.wire` (layout,
masks, codecs, statistics), :mod:`slamb_comm.exchange` (transports, :class:`Communicator`),
:mod:`slamb_comm.methods` (SLAMB and the other optimizers' rules); docs/core.md maps them.
"""

from .errors import (ConfigError, DTypeError, LayoutError, LayoutMismatchError, NonContiguousError, NonFiniteError,
                     PeerError, SlambCommError)
from .exchange.communicator import Communicator
from .exchange.transports import LocalTransport, MPITransport, NCCLTransport, Transport
from .wire.codecs import TopK, k_elems, topk_indices
from .wire.layout import Layout
from .wire.masks import BernoulliMask, CyclicMask, TopKUnionMask
from .wire.stats import Stats, Traffic

__version__ = "0.1.0"
__all__ = ["Communicator", "Layout", "CyclicMask", "BernoulliMask", "TopKUnionMask", "TopK", "k_elems",
           "topk_indices", "Transport", "MPITransport", "NCCLTransport", "LocalTransport", "Stats", "Traffic",
           "SlambCommError", "ConfigError", "DTypeError", "LayoutError", "LayoutMismatchError",
           "NonContiguousError", "NonFiniteError", "PeerError"]
