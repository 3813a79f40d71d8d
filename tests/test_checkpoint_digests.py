"""A checkpoint's checksums come from the ranks that wrote its shards: the main process never reads another rank's
shards back during a save (it read and hashed every rank's files before), and ``checkpoint.json`` still records the
checksum of every file, each equal to the file's bytes (2 gloo processes, FSDP2, a synchronous and a background
save)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import run_distributed


def _train_and_record_reads(async_save: bool) -> dict:
    import torch.distributed as dist

    from hftrain.checkpoint import manager
    from tests.tiny import run_tiny_training

    hashed: list[tuple[str, int]] = []
    checksum = manager._checksum

    def recorded(path, kind):
        hashed.append((Path(path).name, Path(path).stat().st_size))
        return checksum(path, kind)

    manager._checksum = recorded
    run = run_tiny_training(strategy="fsdp", strategy_options={"fsdp_version": 2}, steps=4, save_steps=2,
                            async_save=async_save)  # fmt: skip
    return {"rank": dist.get_rank(), "hashed": hashed, "checkpoints": str(Path(run["checkpoint"]).parent)}


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "background"])
def test_each_rank_hashes_its_own_shards_and_the_record_is_whole(async_save):
    from hftrain.checkpoint.manager import MARKER, file_checksum

    main, other = run_distributed(_train_and_record_reads, nprocs=2, async_save=async_save)
    main_read = {name for name, _ in main["hashed"]}
    other_read = {name for name, _ in other["hashed"]}
    assert any(name.startswith("__1_") for name in other_read), other_read  # rank 1 hashed its own shards
    assert not any(name.startswith("__1_") for name in main_read), main_read  # and the main process none of them
    assert not any(name.startswith("__0_") for name in other_read), other_read
    steps = sorted(Path(main["checkpoints"]).glob("step_*"))
    assert [p.name for p in steps] == ["step_00000002", "step_00000004"]
    for step in steps:
        record = json.loads((step / MARKER).read_text())["files"]
        on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != MARKER}
        assert set(record) == on_disk
        assert any("__1_" in name for name in record)
        for name, digest in record.items():
            assert digest == file_checksum(step / name), name
