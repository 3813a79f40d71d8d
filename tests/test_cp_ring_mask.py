"""Ring context parallelism passes causality, not a dense bias, where the kernel takes it (issue 55).

Real gloo processes, cp = 2, fp32. Every block kernel call is recorded (its bias, or None, and its ``is_causal``):

- plain causal attention (no padding key, one document per row): no block gets a bias, forward or backward; the
  diagonal blocks run the kernel's own ``is_causal``, the blocks wholly below the diagonal run unmasked, the ones
  above are skipped; the same sequences with a padding mask (``padded=True``, every block masked as before) and the
  unsplit attention give the same outputs and gradients;
- a causal sliding window (12 positions, blocks of 8): only the blocks across the window's edge get a bias;
- a causal LM (Llama) split by ``apply_context_parallel`` with no attention mask and no position ids: its ring builds
  no bias, and its logits are the unsplit model's at this rank's positions.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed


def _recording(kernel, calls: list):
    from hftrain.parallel.context_parallel import BlockKernel

    def forward(q, k, v, bias, scale, causal=False):
        calls.append(("forward", bias is not None, causal))
        return kernel.forward(q, k, v, bias, scale, causal)

    def backward(dout, q, k, v, bias, out, lse, scale, causal=False):
        calls.append(("backward", bias is not None, causal))
        return kernel.backward(dout, q, k, v, bias, out, lse, scale, causal)

    return BlockKernel(forward, backward)


def _ring_cases() -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hftrain.parallel import context_parallel
    from hftrain.parallel.context_parallel import Shard, apply_context_parallel, ring_attention, zigzag_positions
    from hftrain.parallel.families import stages_for
    from tests.test_cp_attention import _inputs, _reference
    from tests.tiny import tiny_config

    calls: list = []
    context_parallel.BLOCK_KERNELS["cpu"] = _recording(context_parallel.BLOCK_KERNELS["cpu"], calls)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    b, h, h_kv, seq, d = 2, 4, 2, 16 * cp, 8
    q, k, v, weights, keep = _inputs(0, b, h, h_kv, seq, d)
    keep = torch.ones_like(keep)  # no padding key
    pos = zigzag_positions(seq, cp, rank)
    runs = context_parallel.zigzag_runs(seq, cp)
    result: dict = {}
    for label, padded, window in (("plain", False, None), ("bias", True, None), ("window", False, 12)):
        expected = _reference(q, k, v, weights, keep, True, None, window)
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        calls.clear()
        shard = Shard(keep[:, pos], pos, True, d**-0.5, dist.group.WORLD, runs, None, window, padded=padded)
        out = ring_attention(*mine, shard)
        (out * weights[:, :, pos]).sum().backward()
        got = (out.detach(), *(t.grad for t in mine))
        result[label] = {
            "calls": list(calls),
            "error": max(
                ((g - e[:, :, pos]).abs().max() / e.abs().max()).item() for g, e in zip(got, expected, strict=True)
            ),
            "got": got,
        }
    # a causal LM without a mask or position ids: the model's own ring calls build no bias
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=128)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 128, (2, seq), generator=torch.Generator().manual_seed(3))
    expected = reference(input_ids=ids, use_cache=False).logits[:, pos]
    trunk = stages_for(model.config, head="causal_lm", axis="cp")
    apply_context_parallel(model, trunk=trunk, per_token=True, cp_group=dist.group.WORLD, comm="ring")
    calls.clear()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    result["model"] = {
        "calls": list(calls),
        "error": ((logits - expected).abs().max() / expected.abs().max()).item(),
        "layers": config.num_hidden_layers,
    }
    dist.destroy_process_group()
    return result


@pytest.mark.distributed
def test_the_ring_passes_causality_not_a_dense_bias():
    import torch

    for rank, got in enumerate(run_distributed(_ring_cases, nprocs=2, timeout=300)):
        plain, bias, window, model = got["plain"], got["bias"], got["window"], got["model"]
        # 4 chunks of 8 positions, 2 per rank (zigzag): each rank's 2 chunks on the diagonal, 3 pairs wholly below it
        assert plain["calls"] and not any(masked for _, masked, _ in plain["calls"]), plain["calls"]
        diagonal = [c for c in plain["calls"] if c[2]]
        assert len(diagonal) == 4, plain["calls"]  # this rank's two chunks against themselves, forward and backward
        assert all(masked for _, masked, _ in bias["calls"]) and len(bias["calls"]) == len(plain["calls"])
        assert plain["error"] < 1e-6 and bias["error"] < 1e-6, (rank, plain["error"], bias["error"])
        for a, b in zip(plain["got"], bias["got"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # a window of 12 over chunks of 8: the pairs across its edge are masked, the diagonal ones are not
        assert window["error"] < 1e-6, window["error"]
        assert any(masked for _, masked, _ in window["calls"]), window["calls"]
        assert any(causal and not masked for _, masked, causal in window["calls"]), window["calls"]
        # the model: every layer's ring ran, unmasked, and the logits are the unsplit model's
        assert len(model["calls"]) >= model["layers"] and not any(m for _, m, _ in model["calls"]), model["calls"]
        assert model["error"] < 1e-5, model["error"]
