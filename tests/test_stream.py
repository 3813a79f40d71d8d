"""The streamed safetensors writer: what safetensors and transformers read back, tensor by tensor, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from hftrain.checkpoint.stream import (
    StreamedSafetensorsWriter,
    TensorSpec,
    parse_shard_size,
    saved_dtype,
    verify_written,
    write_streamed,
)
from hftrain.errors import ConfigError, HFTrainError


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 8, generator=generator),
        "steps": torch.arange(5),  # an integer buffer keeps its dtype
        "empty": torch.randn(0, 4),
        "scalar": torch.tensor(3.5),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(7, generator=generator).to(torch.bfloat16),
    }


def _specs(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(v.shape), saved_dtype(v.dtype, dtype)) for k, v in state.items()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_written_in_any_order_reads_back_as_save_file(tmp_path, dtype):
    from safetensors.torch import load_file, save_file

    state = _state()
    files = write_streamed(tmp_path / "ours", _specs(state, dtype), reversed(list(state.items())), verify=True)
    assert files == ["model.safetensors"]
    reference = {k: v.to(saved_dtype(v.dtype, dtype)) for k, v in state.items()}
    save_file(reference, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    ours, theirs = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "reference.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert verify_written(tmp_path / "ours", lambda name: state[name]) == len(state)


def test_shards_follow_transformers_layout(tmp_path):
    from transformers.utils.hub import get_checkpoint_shard_files

    state = _state()
    files = write_streamed(tmp_path, _specs(state), state.items(), max_shard_size=300)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert files == [*shards, "model.safetensors.index.json"] and len(shards) > 1
    assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(spec.nbytes for spec in _specs(state))  # bf16 saved as fp32 too
    found, _ = get_checkpoint_shard_files(str(tmp_path), str(tmp_path / "model.safetensors.index.json"))
    assert sorted(found) == [str(tmp_path / s) for s in shards]
    assert verify_written(tmp_path, lambda name: state[name]) == len(state)


def test_refusals(tmp_path):
    state = _state()
    writer = StreamedSafetensorsWriter(tmp_path, _specs(state))
    with pytest.raises(KeyError):
        writer.write("unknown", torch.zeros(1))
    with pytest.raises(ValueError, match="shape"):
        writer.write("embed.weight", torch.zeros(3))
    writer.write("steps", state["steps"])
    with pytest.raises(ValueError, match="already written"):
        writer.write("steps", state["steps"])
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    with pytest.raises(ConfigError, match="max_shard_size"):
        parse_shard_size("lots")
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2GiB") == 2 << 30


def test_verify_names_a_damaged_tensor(tmp_path):
    state = _state()
    write_streamed(tmp_path, _specs(state), state.items())
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # one bit of a value near the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(HFTrainError, match="differs"):
        verify_written(tmp_path, lambda name: state[name])
