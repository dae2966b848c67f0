"""torch.library custom ops of a user's, which the workers import by their path in tests."""

import torch


@torch.library.custom_op("dm_tests::scaled", mutates_args=())
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@scaled.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dm_tests::doubled_rows", mutates_args=())
def doubled_rows(x: torch.Tensor) -> torch.Tensor:
    """No fake kernel: its output has twice its input's rows."""
    return torch.cat([x, x])


def _keep(ctx, inputs, output) -> None:
    ctx.factor = inputs[1]


def _backward(ctx, grad: torch.Tensor) -> tuple:
    return grad * ctx.factor, None


scaled.register_autograd(_backward, setup_context=_keep)
