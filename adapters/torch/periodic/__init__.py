"""Wrappers that own any torch optimizer and average across the ranks periodically (as PyTorch's
``PostLocalSGDOptimizer`` owns its optimizer): DiLoCo, DES-LOC and the SparseLoCo family.

=====================  =========================================================================
module                 what it holds
=====================  =========================================================================
``diloco``             ``OuterLoop`` (the wrapper: the inner optimizer's groups and state, a core
                       object per bucket), :class:`DiLoCo`, :class:`DesLoc`
``sparseloco``         :class:`SparseLoCo`, :class:`SharedMaskSparseLoCo`, :class:`SharedTopKSparseLoCo`
=====================  =========================================================================

Each takes ``process_group=`` (a process group), or, for a model sharded by FSDP2, ``mesh=``.
"""

from .diloco import DesLoc, DiLoCo, OuterLoop
from .sparseloco import SharedMaskSparseLoCo, SharedTopKSparseLoCo, SparseLoCo

__all__ = ["OuterLoop", "DiLoCo", "DesLoc", "SparseLoCo", "SharedMaskSparseLoCo", "SharedTopKSparseLoCo"]
