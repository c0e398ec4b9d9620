"""Batch normalisation over the global batch, on any device: what CLAP's audio tower needs for a
step on W ranks to be the step of one process.

HTSAT (CLAP's audio encoder) normalises its mel input with a `BatchNorm2d` over the mel bins. In
training, BatchNorm uses the statistics of the batch it sees: under data parallelism each rank's
own rows, so 2 ranks of b rows normalise differently from one process of 2b rows (LAION-CLAP
trains so unless `--use-bn-sync`). PyTorch's `SyncBatchNorm` fixes that on GPUs only (it refuses
CPU tensors). `GlobalBatchNorm2d` sums each channel's count, sum and sum of squares over the ranks
(one all-gather, in float64, ranks of any batch size), then normalises every rank's rows with the
global mean and (biased) variance and updates the running statistics with the unbiased one, as
BatchNorm does. Same parameters, buffers and state-dict keys as `BatchNorm2d`: the saved model
is a plain `ClapModel`. In evaluation, or without a process group, it is `BatchNorm2d`.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class GlobalBatchNorm2d(torch.nn.BatchNorm2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        dims = [0, 2, 3]
        values = input.double()
        count = torch.tensor([input.numel() / input.shape[1]], dtype=torch.float64, device=input.device)
        local = torch.cat([count.expand(input.shape[1]), values.sum(dims), (values * values).sum(dims)])
        # differentiable (the input's gradient, where it has one, sees every rank's rows)
        gathered = funcol.all_gather_single_autograd(local[None], 0, dist.group.WORLD)
        total, sums, squares = gathered.sum(0).reshape(3, -1)
        mean = sums / total
        variance = squares / total - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
                unbiased = variance * total / (total - 1).clamp(min=1)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        shape = (1, -1, 1, 1)
        normalised = (values - mean.reshape(shape)) * torch.rsqrt(variance.reshape(shape) + self.eps)
        normalised = normalised.to(input.dtype)
        if self.affine:
            normalised = normalised * self.weight.reshape(shape) + self.bias.reshape(shape)
        return normalised


def globalise_batch_norms(module: torch.nn.Module) -> int:
    """Make every `BatchNorm2d` in `module` a `GlobalBatchNorm2d` (in place); returns how many."""
    norms = [child for child in module.modules() if type(child) is torch.nn.BatchNorm2d]
    for norm in norms:
        norm.__class__ = GlobalBatchNorm2d
    return len(norms)
