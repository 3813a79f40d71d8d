"""``--write-configs DIR``: the chosen row as files that start a run.

Written: ``job.yaml`` (hftrain's job config: model (with ``task: causal_lm`` for a language model), micro-batch,
accumulation, precision, strategy, LoRA),
for ZeRO rows ``ds_config.json`` (hftrain's DeepSpeed defaults for the stage and offload, ``"auto"`` values
filled by hftrain at start), for DDP/ZeRO/FSDP rows ``accelerate.yaml`` (processes and machines of the
hardware), and ``launch.sh`` with the command for each launcher. Everything is checked before the first file
is written: a refused row or folder leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path
from typing import Any

from hftrain.errors import ConfigError, HFTrainError, writing
from hftrain.files import check_own, remove_quietly, write_file
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec
from hftrain.plan.rows import Row, Workload
from hftrain.tasks import DEFAULT_TASK

PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def job_config(row: Row, model: ModelSpec, work: Workload, ds_config: Path | None) -> dict[str, dict[str, Any]]:
    """hftrain's job config (sections ``model``, ``data``, ``training``, ``strategy``, ``parallelism``, ``lora``)
    for ``row``.

    Args:
        row: the chosen row.
        model: the model (its ``source`` becomes ``model.model_name_or_path``).
        work: the workload.
        ds_config: the DeepSpeed JSON written beside it (ZeRO rows).
    """
    from hftrain.config import nest_fields

    sections = nest_fields(row.strategy, source=f"plan row {row.label}")  # strategy, and parallelism if split
    strategy, parallelism = sections["strategy"], sections.get("parallelism")
    # A pipeline splits each per-device batch into its micro-batches: the plan's m micro-batches of b are one
    # per-device batch of m·b (parallelism.num_microbatches = m), not m accumulation steps.
    pipelined = row.pp > 1
    per_device = work.micro_batch * work.accumulation if pipelined else work.micro_batch
    if ds_config is not None:
        strategy["deepspeed_config"] = str(ds_config)
    job: dict[str, dict[str, Any]] = {
        "model": {"model_name_or_path": model.source, **({"task": model.task} if model.task != DEFAULT_TASK else {})},
        "data": {"max_seq_length": work.seq},
        "training": {
            "output_dir": f"outputs/{Path(str(model.source)).name.replace(':', '-')}-{row.label.split(' ')[0]}",
            "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": 1 if pipelined else work.accumulation,
            "mixed_precision": PRECISION[work.precision],
            **({"gradient_checkpointing": work.recompute} if work.recompute else {}),
        },
        "strategy": strategy,
        **({"parallelism": parallelism} if parallelism else {}),
    }
    if work.lora_rank:
        job["lora"] = {"use_lora": True, "lora_r": work.lora_rank, "lora_alpha": 2 * work.lora_rank}
    return job


def accelerate_config(row: Row, hw: Hardware, ds_config: Path | None) -> dict[str, Any] | None:
    """The ``accelerate launch --config_file`` contents for a data-parallel row (None for megatron: torchrun).

    Args:
        row: the chosen row.
        hw: the hardware (processes and machines).
        ds_config: the DeepSpeed JSON of a ZeRO row.
    """
    name = row.strategy["name"]
    if name == "megatron":
        return None
    common = {
        "compute_environment": "LOCAL_MACHINE",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": hw.nodes,
        "num_processes": hw.world,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if name == "ddp":
        return {**common, "distributed_type": "MULTI_GPU"}
    if name == "fsdp":
        return {
            **common,
            "distributed_type": "FSDP",
            "fsdp_config": {
                "fsdp_version": row.strategy.get("fsdp_version", 2),
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "fsdp_reshard_after_forward": True,
                "fsdp_offload_params": False,
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            },
        }
    return {
        **common,
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": str(ds_config), "zero3_init_flag": name == "zero3"},
    }


def write_configs(row: Row, model: ModelSpec, work: Workload, hw: Hardware, directory: str | Path) -> list[Path]:
    """Write the files that start ``row`` into ``directory`` (new or empty); returns their paths.

    Args:
        row: the chosen row (``Plan.choice`` or ``Plan.row(label)``).
        model: the model; it must name a loadable source (a folder or ``embedded:<name>``).
        work: the workload.
        hw: the hardware.
        directory: a new or empty folder.
    """
    import yaml

    from hftrain.config import from_dict
    from hftrain.strategies.deepspeed import default_ds_config

    if not row.runnable:
        raise ConfigError(
            f"--write-configs: {row.label} is formula-only (this hftrain cannot run it); choose another row with --row"
        )
    if model.source is None:
        raise ConfigError(
            "--write-configs needs a model that a job can load: --model <folder> or embedded:<name> "
            "(not sizes or a lone config file)"
        )
    folder = Path(directory).absolute()
    check_own(folder, "--write-configs", folder=True)  # a link to an empty folder would be written through
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"--write-configs: '{directory}' exists and is not an empty folder; give a new folder")
    name = row.strategy["name"]
    ds_path = folder / "ds_config.json" if name.startswith("zero") else None
    job = job_config(row, model, work, ds_path)
    from_dict(job, source=f"{folder / 'job.yaml'}").validate()  # what is written loads
    files: dict[str, str] = {"job.yaml": yaml.safe_dump(job, sort_keys=False)}
    if ds_path is not None:
        ds = default_ds_config(
            int(name[-1]),
            offload_optimizer=row.strategy.get("offload_optimizer", False),
            offload_params=row.strategy.get("offload_params", False),
        )
        files["ds_config.json"] = json.dumps(ds, indent=2) + "\n"
    launcher = accelerate_config(row, hw, ds_path)
    if launcher is not None:
        files["accelerate.yaml"] = f"# hftrain plan: {row.label}\n" + yaml.safe_dump(launcher, sort_keys=False)
    files["launch.sh"] = _launch_script(row, hw, folder, accelerate=launcher is not None)
    created = [folder, *folder.parents]
    created = [path for path in created if not path.exists()][::-1]  # the folders mkdir makes, outermost first
    try:
        with writing(f"the planned configs into --write-configs '{folder}'", location=folder):
            folder.mkdir(parents=True, exist_ok=True)
            for filename, text in files.items():  # each a new file renamed into place: a planted link is replaced
                write_file(folder / filename, text)
    except HFTrainError:  # a failed write leaves nothing behind: no partial set of files, no new folders
        for filename in files:  # a read-only file system refuses even removing what is not there: quietly
            remove_quietly(folder / filename)
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    return [folder / filename for filename in files]


def _launch_script(row: Row, hw: Hardware, folder: Path, *, accelerate: bool) -> str:
    job = shlex.quote(str(folder / "job.yaml"))
    lines = [
        "#!/bin/sh",
        f"# hftrain plan: {row.label}; run on every node (NODE_RANK 0..{hw.nodes - 1}), MASTER_ADDR = node 0",
        "set -e",
    ]
    if accelerate:
        config = shlex.quote(str(folder / "accelerate.yaml"))
        lines.append(
            f"accelerate launch --config_file {config} --machine_rank ${{NODE_RANK:-0}} "
            f"--main_process_ip ${{MASTER_ADDR:-127.0.0.1}} --main_process_port ${{MASTER_PORT:-29500}} "
            f"-m hftrain train --config {job}"
        )
    else:
        lines.append(
            f"torchrun --nnodes {hw.nodes} --nproc_per_node {hw.gpus_per_node} --node_rank "
            f"${{NODE_RANK:-0}} --master_addr ${{MASTER_ADDR:-127.0.0.1}} --master_port "
            f"${{MASTER_PORT:-29500}} -m hftrain train --config {job}"
        )
    return "\n".join(lines) + "\n"
