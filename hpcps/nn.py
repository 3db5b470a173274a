"""torch modules over hpcps tables: the autograd bridge.

``ShardedEmbeddingBag`` is a drop-in for ``torch.nn.EmbeddingBag``: forward
pulls the distinct rows a batch needs into a small leaf tensor and runs
``F.embedding_bag`` on it; autograd computes that leaf's gradient, and a hook
pushes it to the table (the PS applies the optimizer). No hand-written backward.
"""

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ShardedEmbeddingBag"]


class ShardedEmbeddingBag(torch.nn.Module):
    """``torch.nn.EmbeddingBag`` over an :class:`hpcps.EmbeddingTable`. Worker ranks; local.

    mode: ``"sum"`` or ``"mean"`` (``"max"`` has no useful sparse gradient here).
    grad_scale: multiplies the gradient pushed (the trainer uses ``1/num_workers``
    so that the sum over workers is the gradient of the global-batch mean loss).
    device: where the pulled rows go (``"cuda"`` for a model on the GPU); pushed
    gradients come back to the host.
    """

    def __init__(self, table, mode: str = "sum", grad_scale: float = 1.0, device=None):
        super().__init__()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if mode not in ("sum", "mean"):
            raise ValueError(f"ShardedEmbeddingBag: mode must be 'sum' or 'mean', got {mode!r}")
        self.table, self.mode, self.grad_scale = table, mode, float(grad_scale)
        self.embedding_dim = table.dim
        self.num_embeddings = table.num_rows
        self.pull_seconds = 0.0

    def forward(self, input, offsets=None, per_sample_weights=None):
        """``input``: 2-D ``(bags, bag_size)`` or 1-D with ``offsets``, as ``nn.EmbeddingBag``."""
        ids = torch.as_tensor(input)
        flat = ids.reshape(-1).cpu().numpy()
        uniq, inverse = np.unique(flat, return_inverse=True)
        rows = torch.from_numpy(self.table.pull(uniq))
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        weight = rows.requires_grad_(torch.is_grad_enabled())
        if weight.requires_grad:
            def push(grad, uniq=uniq):
                g = grad if self.grad_scale == 1.0 else grad * self.grad_scale
                self.table.push(uniq, g.detach().to("cpu", torch.float32).contiguous().numpy())
            weight.register_hook(push)
        local = torch.from_numpy(inverse.reshape(-1)).view(ids.shape).to(self.device)
        if offsets is not None:
            offsets = torch.as_tensor(offsets).to(self.device)
        return F.embedding_bag(local, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        return f"table={self.table.name!r}, {self.num_embeddings}x{self.embedding_dim}, mode={self.mode!r}"
