"""``training.loss_chunk_tokens`` without a process group: the ``auto`` size, the config's bounds, and the head left as
it was found (the trainings, whole logits against chunks under every strategy, are in ``tests/test_causal_lm.py``)."""

from __future__ import annotations

import pytest
import torch

from hftrain.trainers.chunked_head import AUTO_LOGITS, ChunkedHead, auto_chunk


def test_auto_keeps_a_chunk_near_its_logits_budget():
    assert auto_chunk(49_152) == 64  # SmolLM2's vocabulary
    assert auto_chunk(128_256) == 32 and auto_chunk(262_144) == 16  # Llama-3, Gemma-3
    assert auto_chunk(64) == 16384  # a tiny vocabulary: at most 16,384 positions
    assert auto_chunk(49_152, "cuda") == 1024  # fewer, larger chunks on an accelerator
    for device, budget in (("cpu", AUTO_LOGITS["cpu"]), ("cuda", AUTO_LOGITS["accelerator"])):
        for rows in (1_000, 32_000, 50_257, 151_936):
            chunk = auto_chunk(rows, device)
            assert chunk & (chunk - 1) == 0 and chunk * rows <= budget
            assert chunk == 16384 or budget < 2 * chunk * rows  # the largest, unless at the cap


def test_the_config_takes_auto_null_or_a_positive_count():
    from hftrain.config import TrainingConfig
    from hftrain.errors import ConfigError

    for value in ("auto", None, 1, 512):
        TrainingConfig(loss_chunk_tokens=value).validate()
    with pytest.raises(ConfigError, match=r"^training\.loss_chunk_tokens must be positive, or null"):
        TrainingConfig(loss_chunk_tokens=0).validate()


def test_the_chunked_losses_equal_the_whole_logits_and_the_head_is_restored():
    """A bare head and a model that only calls it: losses per position equal the whole logits' cross entropy (and their
    gradients the whole logits' gradients), over chunks of 5 with a short last one; afterwards the head's forward is
    its class's again."""
    from hftrain.trainers.language import IGNORE_INDEX, token_losses

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 40, bias=False)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = head

        def forward(self, hidden):
            return type("Output", (), {"logits": self.lm_head(hidden)})()

    model = Model()
    hidden = torch.randn(2, 13, 8, requires_grad=True)
    targets = torch.randint(0, 40, (2, 13))
    targets[0, 3] = targets[1, -1] = IGNORE_INDEX
    lines: list[str] = []
    chunked = ChunkedHead(head, 5, token_losses, lines.append)
    got = chunked.losses(model, {"hidden": hidden}, targets)
    assert chunked.checked is True and lines[0].startswith(
        "loss: the output projection and cross entropy in chunks of 5"
    )
    assert "forward" not in head.__dict__
    got.sum().backward()
    got_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    want = token_losses(head, model(hidden).logits, targets)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[0, 3] == 0 and got[1, -1] == 0
    torch.testing.assert_close(got_grads[0], hidden.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grads[1], head.weight.grad, rtol=0, atol=1e-6)
