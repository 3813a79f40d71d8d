"""Checkpoints forged on purpose, shared by the bad-input and checkpoint-trust tests: a run's step folders, a
checksum manifest recomputed after an edit (as whoever forges a checkpoint can), and pickles that run code."""

from __future__ import annotations

import json
from pathlib import Path

STEP2, STEP4 = "checkpoints/step_00000002", "checkpoints/step_00000004"


def reseal(run: Path, step: str = STEP4) -> None:
    """Recompute checkpoint.json's checksums after an edit, as whoever forges a checkpoint can."""
    folder = run / step
    marker = folder / "checkpoint.json"
    data = json.loads(marker.read_text())
    from hftrain.checkpoint.manager import file_checksum

    data["files"] = {
        str(p.relative_to(folder)): file_checksum(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "checkpoint.json"
    }
    marker.write_text(json.dumps(data))


class Planted:
    """Unpickling it runs a shell command that leaves a file PWNED in the working directory."""

    def __reduce__(self):
        import os

        return (os.system, ("touch PWNED",))


def planted_bytes(kind: str = "torch") -> bytes:
    """A pickle that runs code: in torch's zip format (what torch.load reads) or as a bare pickle."""
    import io
    import pickle

    import torch

    if kind == "bare":
        return pickle.dumps(Planted(), protocol=2)
    buffer = io.BytesIO()
    torch.save({"state": Planted()}, buffer)
    return buffer.getvalue()


def symlinked_planted_dcp(run: Path, step: str = STEP4) -> Path:
    """The symlink attack: the checkpoint's ``.distcp`` files moved to ``dcpx/`` beside ``state/``, a ``.metadata``
    whose ``planner_data`` holds a pickle that runs code written there, ``state/dcp`` replaced by the relative
    symlink ``../dcpx`` (which survives ``cp -a`` and tar), and the checksums recomputed. A walk of ``state/`` that
    does not enter symlinked folders never sees the ``.metadata`` that torch's DCP reader unpickles. Returns the
    checkpoint folder."""
    import os
    import pickle
    import shutil

    folder = run / step
    dcp, moved = folder / "state" / "dcp", folder / "dcpx"
    shutil.move(str(dcp), str(moved))
    metadata = pickle.loads((moved / ".metadata").read_bytes())  # the test's own, just written by a real run
    metadata.planner_data = Planted()
    (moved / ".metadata").write_bytes(pickle.dumps(metadata))
    os.symlink("../dcpx", dcp)
    reseal(run, step)
    return folder
