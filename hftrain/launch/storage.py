"""Is ``output_dir`` one folder for every machine of the job, or a node-local path on each?

hftrain's checkpoints are written collectively into one staging folder that the main process seals and
renames; on node-local storage the other machines' shards would land in folders nobody seals, and the
checkpoint could never be resumed. So a multi-machine run checks at start that all ranks see the same folder
(every rank writes a marker next to ``output_dir``, every rank looks for all markers) and refuses otherwise.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.errors import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator


def existing_anchor(path: Path) -> Path:
    """``path`` or its nearest existing ancestor: where markers can be written without creating ``path``."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path if path.is_dir() else path.parent


def check_shared_output_dir(accelerator: Accelerator, output_dir: str | Path) -> None:
    """Refuse a multi-process run whose ranks do not all see the same ``output_dir`` (collective).

    Args:
        accelerator: the run's accelerator (its process group carries the check).
        output_dir: the run's output folder (it need not exist yet).
    """
    import torch
    from accelerate.utils import broadcast_object_list

    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    broadcast_object_list(token)
    anchor = existing_anchor(Path(output_dir))
    pattern = f".hftrain-shared-{token[0]}-rank"
    mine = anchor / f"{pattern}{accelerator.process_index}"
    try:
        mine.touch()
        problem = None
    except OSError as error:  # every rank still takes part in the collectives below, so none hangs
        problem = f"rank {accelerator.process_index} cannot write in '{anchor}' ({error.strerror})"
    accelerator.wait_for_everyone()
    seen = len(list(anchor.glob(f"{pattern}*")))
    sees_all = torch.tensor([float(problem is None and seen == accelerator.num_processes)])
    everyone = accelerator.reduce(sees_all, reduction="sum").item()
    accelerator.wait_for_everyone()
    mine.unlink(missing_ok=True)
    if problem:
        raise ConfigError(f"training.output_dir: {problem}; choose a folder every rank can write")
    if everyone != accelerator.num_processes:
        raise ConfigError(
            f"training.output_dir '{output_dir}' is not shared by all machines: rank {accelerator.process_index} "
            f"sees the markers of {seen} of {accelerator.num_processes} ranks, so each machine would write "
            "checkpoints nobody can resume; put output_dir on a file system every machine mounts (e.g. NFS)"
        )
