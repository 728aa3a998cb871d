"""Trainer callbacks of the training runner (the loss-step callback lives with the losses:
:class:`st_prompts.losses.LossStepCallback`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import TrainerCallback


class SyncLossParametersCallback(TrainerCallback):
    """Average the gradients of a loss's own trainable parameters (SimCSE's MLP, the MLM, CRTD and NLI heads) over the
    processes of a distributed run, before every optimizer step: ``DistributedDataParallel`` wraps only the model, so
    each process's copy would drift apart. Without ``torch.distributed`` it does nothing."""

    def __init__(self, loss, model) -> None:
        model_parameters = {id(p) for p in model.parameters()}
        self.parameters = [p for p in loss.parameters() if p.requires_grad and id(p) not in model_parameters]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.parameters or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        # One flat buffer (and a has-gradient flag per parameter) so that every process makes the same two calls.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        present = torch.tensor([p.grad is not None for p in self.parameters], dtype=torch.float32, device=flat.device)
        dist.all_reduce(flat)
        dist.all_reduce(present)
        flat /= dist.get_world_size()
        offset = 0
        for parameter, seen in zip(self.parameters, present.tolist()):
            size = parameter.numel()
            if seen:
                parameter.grad = flat[offset:offset + size].view_as(parameter).clone()
            offset += size
