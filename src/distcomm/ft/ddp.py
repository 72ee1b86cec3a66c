"""torchft's ``DistributedDataParallel`` for torch modules: gradients averaged by a Manager.

Loaded only when used (it imports torch; a replica that does not use it never does).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DistInputError

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.Module):
    """``module`` whose gradients ``manager`` averages over the participating replicas.

    When a backward pass has accumulated the gradients of ``module``'s
    parameters, they are averaged with :meth:`~.manager.Manager.allreduce`
    (one call per dtype, over a flat copy; a parameter without a gradient
    on this replica contributes zeros and receives the average), so every
    replica calls the manager the same number of times whatever parameters
    its batch used.  The step must have been started (``manager.start_quorum()``,
    or :class:`~.wrappers.OptimizerWrapper`'s ``zero_grad()``) before the
    backward pass.  CPU tensors only; errors go to the manager, as for
    ``Manager.allreduce``.
    """

    def __init__(self, manager: Any, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise DistInputError(f"DistributedDataParallel wraps a torch.nn.Module, got {type(module).__name__}")
        if not callable(getattr(manager, "allreduce", None)):
            raise DistInputError(f"DistributedDataParallel needs a Manager, got {type(manager).__name__}")
        super().__init__()
        self.module = module
        self._manager = manager
        self._queued = False
        self._params = [p for p in module.parameters() if p.requires_grad]
        for p in self._params:
            if p.device.type != "cpu":
                raise DistInputError(f"DistributedDataParallel: a parameter is on {p.device}; distcomm averages "
                                     "CPU tensors only")
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _grad_ready(self, _: torch.Tensor) -> None:
        if not self._queued:  # once per backward pass: average when the engine is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    @torch.no_grad()
    def _average(self) -> None:
        self._queued = False
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self._params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for _, params in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):  # the same order everywhere
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            self._manager.allreduce(flat)
            offset = 0
            for p in params:
                part = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)
