"""Optimizers for models sharded by FSDP2 on HSDP's ``(replicate, shard)`` mesh, sparse across the replicas.

=====================  =========================================================================
module                 what it holds
=====================  =========================================================================
``mesh``               :class:`~.mesh.MeshSharding` (the mesh's and the parameters' checks, the
                       transports over each dimension), :class:`~.mesh.BackwardWatch`
``hybrid_slamb``       :class:`HybridSLAMB`, :class:`HybridSAdamW`
``overlap``            HybridSLAMB's exchange started during the backward pass
``state``              HybridSLAMB's state for ``torch.distributed.checkpoint``, resized on load
``hybrid_topk``        :class:`HybridTopK`: top-k with error feedback around any optimizer
=====================  =========================================================================
"""
