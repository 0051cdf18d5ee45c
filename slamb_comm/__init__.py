"""slamb_comm: sparse communication for data-parallel training.

The core works on NumPy (CPU) and CuPy (GPU) arrays over MPI (mpi4py), NCCL, or a
single process, and imports neither torch nor horovod:

>>> import numpy as np, slamb_comm as sc
>>> x = [np.ones((64, 200), np.float32), np.zeros(10, np.float32)]
>>> comm = sc.Communicator(None, x, ratio=0.1)     # None: one process
>>> _ = comm.sync(x)                                  # dense mean over ranks, in place
>>> mean = comm.sparse_allgather(x)                  # top-k + error feedback
>>> comm.stats.total.calls
2

See :class:`Communicator` for the exchanges, :mod:`slamb_comm.wire.codecs` for the codecs,
:mod:`slamb_comm.wire.masks` for the masks, :mod:`slamb_comm.exchange.transports` for the transports.
"""

from .wire.codecs import Layout, TopK, k_elems, topk_indices
from .exchange.communicator import Communicator
from .wire.masks import BernoulliMask, CyclicMask, TopKUnionMask
from .errors import (
    ConfigError,
    DTypeError,
    LayoutError,
    LayoutMismatchError,
    NonContiguousError,
    NonFiniteError,
    PeerError,
    SlambCommError,
)
from .wire.stats import Stats, Traffic
from .exchange.transports import LocalTransport, MPITransport, NCCLTransport, Transport

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "Layout",
    "CyclicMask",
    "BernoulliMask",
    "TopKUnionMask",
    "TopK",
    "k_elems",
    "topk_indices",
    "Transport",
    "MPITransport",
    "NCCLTransport",
    "LocalTransport",
    "Stats",
    "Traffic",
    "SlambCommError",
    "ConfigError",
    "DTypeError",
    "LayoutError",
    "LayoutMismatchError",
    "NonContiguousError",
    "NonFiniteError",
    "PeerError",
]
