"""Stands in for ``scripts/train.py`` in launcher tests: the same CLI entry, and each rank records its weights.

After the export (which every rank runs), each rank writes a SHA-256 of its full parameters (gathered first
under ZeRO-3) to ``$HFTRAIN_TEST_DIGESTS/rank<R>.txt``, so a test can check that all ranks end identical.
This wraps ``hftrain.job.export_model`` from test code; the product has no test hook.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import hftrain.job
from hftrain.cli import main

_export_model = hftrain.job.export_model


def _full_parameters(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):  # ZeRO-3: gather every partition on every rank
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: v.detach().clone() for k, v in params.items()}
    from torch.distributed.tensor import DTensor

    # FSDP2: each parameter's whole tensor (a collective over its mesh, every rank in the same order)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in params.items()}


def export_and_record(trainer, *args, **kwargs):
    result = _export_model(trainer, *args, **kwargs)
    digest = hashlib.sha256()
    for name, tensor in sorted(_full_parameters(trainer).items()):
        digest.update(name.encode())
        digest.update(tensor.float().contiguous().numpy().tobytes())
    out = Path(os.environ["HFTRAIN_TEST_DIGESTS"])
    out.mkdir(parents=True, exist_ok=True)
    meshes = {tuple(p.device_mesh.shape) for p in trainer.model.parameters() if hasattr(p, "device_mesh")}
    if meshes:  # FSDP2: the mesh its parameters are sharded over (a 2-D one under hybrid sharding)
        (out / f"mesh{os.environ.get('RANK', '0')}.txt").write_text(json.dumps(sorted(meshes)))
    (out / f"rank{os.environ.get('RANK', '0')}.txt").write_text(digest.hexdigest())
    return result


hftrain.job.export_model = export_and_record

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
