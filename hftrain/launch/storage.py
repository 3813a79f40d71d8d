"""Is ``output_dir`` one folder for every machine of the job, or a node-local path on each?

hftrain's checkpoints are written collectively into one staging folder that the main process seals and
renames; on node-local storage the other machines' shards would land in folders nobody seals, and the
checkpoint could never be resumed. So a multi-machine run checks at start that all ranks see the same folder
(every rank writes a marker next to ``output_dir``, every rank looks for all markers) and refuses otherwise.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from hftrain.errors import ConfigError


def existing_anchor(path: Path) -> Path:
    """``path`` or its nearest existing ancestor: where markers can be written without creating ``path``."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path if path.is_dir() else path.parent


def check_shared_output_dir(rank: int, world_size: int, output_dir: str | Path) -> None:
    """Refuse a multi-process run whose ranks do not all see the same ``output_dir`` (collective, over the host
    group of ``parallel.host``: an NCCL default group takes no CPU tensor).

    Args:
        rank: this process's global rank.
        world_size: the number of processes.
        output_dir: the run's output folder (it need not exist yet).
    """
    from hftrain.parallel.host import all_sum, barrier, broadcast_object

    token = broadcast_object(secrets.token_hex(8) if rank == 0 else None)
    anchor = existing_anchor(Path(output_dir))
    pattern = f".hftrain-shared-{token}-rank"
    mine = anchor / f"{pattern}{rank}"
    try:
        mine.touch()
        problem = None
    except OSError as error:  # every rank still takes part in the collectives below, so none hangs
        problem = f"rank {rank} cannot write in '{anchor}' ({error.strerror})"
    barrier()
    seen = len(list(anchor.glob(f"{pattern}*")))
    (everyone,) = all_sum([float(problem is None and seen == world_size)])
    barrier()
    mine.unlink(missing_ok=True)
    if problem:
        raise ConfigError(f"training.output_dir: {problem}; choose a folder every rank can write")
    if everyone != world_size:
        raise ConfigError(
            f"training.output_dir '{output_dir}' is not shared by all machines: rank {rank} sees the markers of "
            f"{seen} of {world_size} ranks, so each machine would write checkpoints nobody can resume; put "
            "output_dir on a file system every machine mounts (e.g. NFS)"
        )
