"""DDP's gradient clipping folded into the fused AdamW step (``DDPRuntime``, issue 13).

Against torch's own ``clip_grad_norm_`` followed by the same optimizer: the same step to rounding when the clip
bites, the identical step when it does not, the scale consumed by that one step, and Accelerate's clipping kept
for an optimizer that cannot take a scale. The 2-process DDP parity and resume tests run the folded path too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hftrain.config import TrainingConfig
from hftrain.strategies import LaunchInfo, strategy_from_options
from hftrain.strategies.runtime import RuntimeTask
from tests.tiny import reset_accelerate_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(5, 8, generator=generator), torch.randint(0, 3, (5,), generator=generator)
    return torch.nn.functional.cross_entropy(model(inputs), targets) * 50.0  # large gradients: the clip bites


def _runtime_step(max_norm: float, *, fused: bool) -> tuple[torch.nn.Module, torch.Tensor, object]:
    """One step through the DDP strategy's runtime, as the Trainer takes it."""
    reset_accelerate_state()
    strategy = strategy_from_options("ddp", launch=LaunchInfo())
    accelerator = strategy.build_accelerator(TrainingConfig(mixed_precision="no", log_with="none"))
    runtime = strategy.build_runtime(accelerator, RuntimeTask())
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    model, optimizer, _, _ = runtime.prepare(model, optimizer, loader, None)
    runtime.forward_backward(model, {}, SimpleNamespace(compute_loss=lambda m, _: _loss(m)))
    norm = runtime.clip_grad_norm_(model, max_norm)
    optimizer.step()
    return model, norm, optimizer.optimizer


def _reference_step(max_norm: float, *, fused: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    _loss(model).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return model, norm


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_folded_clip_is_torch_clip_then_step():
    model, norm, inner = _runtime_step(1.0, fused=True)
    reference, reference_norm = _reference_step(1.0, fused=True)
    assert float(norm) > 10.0 and torch.equal(norm, reference_norm)  # the clip bites, same norm
    assert "grad_scale" not in inner.__dict__  # consumed by this step, never applied to the next
    for ours, theirs in zip(_params(model), _params(reference), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    unclipped, _ = _reference_step(1e9, fused=True)
    assert any(not torch.allclose(a, b) for a, b in zip(_params(model), _params(unclipped), strict=True))


def test_folded_clip_is_exact_when_nothing_is_clipped():
    model, _, _ = _runtime_step(1e9, fused=True)
    reference, _ = _reference_step(1e9, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(reference), strict=True))


@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_an_unfused_optimizer_keeps_accelerates_clipping(max_norm):
    model, _, inner = _runtime_step(max_norm, fused=False)
    reference, _ = _reference_step(max_norm, fused=False)
    assert not hasattr(inner, "grad_scale")
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(reference), strict=True))


def test_the_scale_of_a_step_is_not_reused():
    """A step taken without clipping after a clipped one applies no stale scale."""
    model, _, inner = _runtime_step(1.0, fused=True)
    before = _params(model)
    grads = [torch.ones_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    inner.step()  # a stale scale would have divided these gradients (the fused kernel writes them back)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
