"""Export a trained model as a standard ``save_pretrained`` folder under any strategy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase


def export_pretrained(
    accelerator: Accelerator, model: object, tokenizer: PreTrainedTokenizerBase, directory: str | Path
) -> Path:
    """Write config, tokenizer and safetensors weights; a collective call: every rank must enter it.

    ``get_state_dict`` gathers the full state (ZeRO-3 partitions, FSDP shards) before rank 0 writes it.

    Args:
        accelerator: the run's accelerator.
        model: the prepared (wrapped) model.
        tokenizer: saved beside the weights.
        directory: the export folder.
    """
    directory = Path(directory)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(directory)
    accelerator.wait_for_everyone()
    return directory
