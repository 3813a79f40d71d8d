"""The CPU net for NCCL: every host-side collective path of hftrain in a group that has no CPU backend.

Under NCCL the default group (and every group built like it) takes no CPU tensor: a flag, count or shape sent as a
CPU tensor raises ``No backend type associated with device type cpu`` at the first optimizer step. A 2-process
``cuda:gloo`` group on this CPU-only machine is exactly such a group (the test checks that first), so each path
here runs the real hftrain function in it and must not raise: the agreements of ``parallel.host``, the checkpoint
manager's phase agreement, the multi-machine storage check, the tensor-parallel replica check, the RNG streams'
gather into a checkpoint, the pipeline's shape broadcast and the zero-bubble-V evaluation's activation hand-off.
Before ``parallel.host`` each of the real call sites raised here (checked on the code of 7b4f349).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tests.distributed import run_distributed


class _Chunk:
    """A pipeline chunk that adds one (the first turns token ids into floats)."""

    def __new__(cls, index: int):
        import torch

        class Chunk(torch.nn.Module):
            def forward(self, x, *rest):
                return x.float() + 1

        chunk = Chunk()
        chunk.index = index
        return chunk


def _host_paths_without_a_cpu_backend(output_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("cuda:gloo")
    rank = dist.get_rank()
    out: dict = {}
    try:
        dist.all_reduce(torch.ones(1))
        out["default group takes a CPU tensor"] = True
    except RuntimeError:
        out["default group takes a CPU tensor"] = False

    from hftrain.parallel import host

    out["any_rank"] = host.any_rank(rank == 1)
    out["all_sum"] = host.all_sum([1.0, float(rank)])
    out["all_max"] = host.all_max([float(rank), -float(rank)])
    out["broadcast_ints"] = host.broadcast_ints([4, 7, 1] if rank == 0 else None, 3)
    out["broadcast_object"] = host.broadcast_object({"token": "abc"} if rank == 0 else None)
    out["once_per_machine"] = host.once_per_machine("the same error", local_rank=rank)
    host.barrier()

    # The checkpoint manager's agreement: a failure on rank 1 is raised on both ranks.
    from hftrain.checkpoint.manager import _AgreedWrite
    from hftrain.errors import WriteError

    staging = Path(output_dir) / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    agreed = _AgreedWrite(types.SimpleNamespace(is_main_process=rank == 0), "a test write", staging, last=None)
    agreed.phase(lambda: None)

    def fail_on_rank_1() -> None:
        if rank == 1:
            raise OSError(28, "No space left on device")

    try:
        agreed.phase(fail_on_rank_1)
        out["agreed failure"] = None
    except WriteError as error:
        out["agreed failure"] = type(error).__name__

    # The multi-machine storage check (collective over every rank).
    from hftrain.launch.storage import check_shared_output_dir

    check_shared_output_dir(rank, 2, Path(output_dir) / "run")
    out["storage check"] = "ok"

    # The tensor-parallel replica check at build time: same seed, same weights.
    from hftrain.parallel.tensor_parallel import _check_replicated

    torch.manual_seed(0)
    _check_replicated(torch.nn.Linear(4, 4), dist.group.WORLD)
    out["replica check"] = "ok"

    # The RNG streams into a checkpoint (one all-gather of every rank's states; rank 0 writes).
    from hftrain.parallel.dims import ParallelDims, build_groups
    from hftrain.parallel.random import FILE, RNGTracker, save_streams

    groups = build_groups(ParallelDims(world_size=2, tp=2), rank)
    tracker = RNGTracker(seed=5, tp_rank=groups.tp_rank, pp_rank=0).seed_streams()
    streams = Path(output_dir) / "streams"
    streams.mkdir(exist_ok=True)
    save_streams(streams, tracker, groups=groups)
    host.barrier()
    out["streams written"] = (streams / FILE).is_file()

    # A whole model split on the host (megatron moves only the shards to the GPU afterwards): no collective of the
    # split may take the CPU weights. Llama and a mixture of experts (tp × ep over the two ranks' groups).
    from transformers import AutoModelForSequenceClassification

    from hftrain.parallel import parallelize_model
    from tests.tiny import tiny_config

    for kind, dims in (("llama", ParallelDims(world_size=2, tp=2)), ("mixtral", ParallelDims(world_size=2, ep=2))):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(tiny_config(kind))
        split_groups = groups if dims.tp == 2 else build_groups(dims, rank)
        parallelize_model(model, split_groups)
        out[f"{kind} split on the host"] = all(p.device.type == "cpu" for p in model.parameters())

    # The pipeline: the first stage's shape broadcast, and ZBV's forward-only evaluation down and up the V.
    from hftrain.parallel.schedules import SCHEDULES

    pp_groups = build_groups(ParallelDims(world_size=2, pp=2), rank)
    chunks = [_Chunk(rank), _Chunk(3 - rank)]  # the V: rank r holds chunks r and 2p-1-r
    schedule = SCHEDULES["zbv"](
        chunks, pp_group=pp_groups.pp_group, pp_rank=rank, pp=2, num_microbatches=2, device="cpu"
    )
    inputs = {"input_ids": torch.arange(6).view(2, 3)} if rank == 0 else None
    out["shape"] = schedule._first_stage_args(inputs)[1]
    logits = schedule.eval_step(inputs)
    out["zbv logits"] = None if logits is None else logits.tolist()
    return out


@pytest.mark.distributed
def test_every_host_side_collective_runs_in_a_group_without_a_cpu_backend(tmp_path):
    results = run_distributed(_host_paths_without_a_cpu_backend, 2, output_dir=str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        assert out["default group takes a CPU tensor"] is False  # the group is what NCCL's is
        assert out["any_rank"] is True
        assert out["all_sum"] == [2.0, 1.0]
        assert out["all_max"] == [1.0, 0.0]
        assert out["broadcast_ints"] == [4, 7, 1]
        assert out["broadcast_object"] == {"token": "abc"}
        assert out["once_per_machine"] is (rank == 0)
        assert out["agreed failure"] == "WriteError", rank
        assert out["storage check"] == "ok" and out["replica check"] == "ok"
        assert out["shape"] == (2, 1, 0, 2, 3)  # 2 rows: one int64 tensor of 2 dims, 3 columns
        assert out["llama split on the host"] and out["mixtral split on the host"]
    assert results[0]["streams written"]
    expected = (__import__("torch").arange(6).view(2, 3).float() + 4).tolist()  # four chunks, each adding one
    assert results[0]["zbv logits"] == expected and results[1]["zbv logits"] is None


def _who_prints(cases: dict[str, list[str | None]]) -> dict[str, bool]:
    """Each case's lines (one per rank) through ``once_per_machine``, on two machines of two processes each."""
    import torch.distributed as dist

    from hftrain.parallel import host

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return {name: host.once_per_machine(lines[rank], local_rank=rank % 2) for name, lines in cases.items()}


@pytest.mark.distributed
def test_an_error_every_rank_meets_is_printed_once_per_machine():
    """Two ranks of a machine that fail alike (a damaged shared checkpoint file) print one line, not two; a line
    that only one rank has (its own RNG file) is printed by that rank; each machine prints its own."""
    same, own = "checkpoint 'c': its files are damaged", "checkpoint 'c': state/random_states_1.pkl is missing"
    cases = {
        "alike everywhere": [same, same, same, same],
        "rank 1 its own": [same, own, same, same],
        "only rank 1": [None, own, None, None],
        "only the second machine": [None, None, same, same],
    }
    results = run_distributed(_who_prints, 4, cases=cases, timeout=300)
    printed = {name: [results[rank][name] for rank in range(4)] for name in cases}
    assert printed == {
        "alike everywhere": [True, False, True, False],
        "rank 1 its own": [True, True, True, False],
        "only rank 1": [False, True, False, False],
        "only the second machine": [False, False, True, False],
    }
