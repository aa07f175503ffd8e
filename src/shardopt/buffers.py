"""Contiguous param and grad buffers, one of each per model dtype.

Every trainable param becomes a view into its dtype's param buffer (``param.data`` is
rebound; values, dtype, device and the Parameter object are kept), so a bucket of params is
one slice of one tensor, communicated in one collective without packing. Backward
accumulates into the grad buffers, in ``grad_dtype``, and the reductions carry them. With
``param_grads`` each ``p.grad`` views a tensor of the param's dtype: the grad buffer where it
has that dtype, else a second buffer holding the gradient rounded once, which the step then
reads (``step_grads``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import Bucket, Layout


class FlatBuffers:
    """Param and grad buffers laid out by ``layout``; owns no optimizer state."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], layout: Layout,
                 device: torch.device, grad_dtype: torch.dtype, param_grads: bool = False
                 ) -> None:
        self.layout, self.device = layout, device
        self.param_buffers = [torch.zeros(b.numel, dtype=b.dtype, device=device)
                              for b in layout.buffers]
        # bf16 grads: each buffer's own dtype (fp16 params keep fp16 grads, fp32 fp32)
        self.grad_buffers = [torch.zeros(b.numel, device=device, dtype=torch.float32
                                         if grad_dtype == torch.float32 else b.dtype)
                             for b in layout.buffers]
        self.param_grad_buffers = [
            g if g.dtype == buf.dtype or not param_grads
            else torch.zeros(buf.numel, dtype=buf.dtype, device=device)
            for g, buf in zip(self.grad_buffers, layout.buffers)]
        self.step_grads = self.param_grad_buffers
        params = dict(named_params)
        self.param_views: dict[str, torch.Tensor] = {}
        self.grad_views: dict[str, torch.Tensor] = {}
        self.param_grad_views: dict[str, torch.Tensor] = {}  # p.grad: the param's dtype
        with torch.no_grad():
            for fqn, slot in layout.slots.items():
                p, where, i = params[fqn], slot.range_global.as_slice(), slot.buffer_index
                flat = self.param_buffers[i][where]
                flat.copy_(p.detach().reshape(-1))
                p.data = flat.view(slot.shape)
                self.param_views[fqn] = flat
                self.grad_views[fqn] = self.grad_buffers[i][where].view(slot.shape)
                self.param_grad_views[fqn] = self.param_grad_buffers[i][where].view(slot.shape)

    def mirrored(self, buffer_index: int) -> bool:
        """Whether buffer ``buffer_index``'s ``p.grad`` lives apart from its grad buffer."""
        return self.param_grad_buffers[buffer_index] is not self.grad_buffers[buffer_index]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every distinct grad tensor (grad buffers, then the param-dtype copies)."""
        return self.grad_buffers + [m for i, m in enumerate(self.param_grad_buffers)
                                    if self.mirrored(i)]

    def bucket_params(self, bucket: Bucket) -> torch.Tensor:
        return self.param_buffers[bucket.buffer_index][bucket.range_global.as_slice()]

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        return self.grad_buffers[bucket.buffer_index][bucket.range_global.as_slice()]

    def packed_params(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's params back to back: a view where they lie so in the buffer, else
        (8-bit moments start each param on a block boundary, leaving gaps) a copy."""
        slots = [self.layout.slots[fqn] for fqn in bucket.param_fqns]
        numel = sum(s.range_global.size for s in slots)
        if slots[-1].range_global.end - bucket.range_global.start == numel:
            return self.bucket_params(bucket).narrow(0, 0, numel)
        return torch.cat([self.param_views[s.fqn] for s in slots])

    def num_bytes(self) -> dict[str, int]:
        return {"params": sum(t.numel() * t.element_size() for t in self.param_buffers),
                "grads": sum(t.numel() * t.element_size() for t in self.grad_tensors())}
