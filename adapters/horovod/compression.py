"""Horovod's own compressions for bfloat16: :class:`Bf16Safe` (Horovod's collectives carry no bfloat16)."""

import torch

__all__ = ["Bf16Safe"]


class Bf16Safe:
    """Wraps a Horovod compressor so bfloat16 gradients travel as float32 (Horovod has no bf16)."""

    def __init__(self, inner):
        self.inner = inner

    def compress(self, tensor):
        if tensor.dtype == torch.bfloat16:
            t, ctx = self.inner.compress(tensor.float())
            return t, (ctx, torch.bfloat16)
        t, ctx = self.inner.compress(tensor)
        return t, (ctx, None)

    def decompress(self, tensor, ctx):
        inner, dt = ctx
        out = self.inner.decompress(tensor, inner)
        return out.to(dt) if dt is not None else out
