"""A mixture-of-experts run's router statistics: the load-balancing loss, the per-expert token counts, their picture.

transformers' ``*ForSequenceClassification`` heads of MoE families return the cross-entropy only (their causal-LM
heads add ``router_aux_loss_coef ×`` the load-balancing loss); the Trainer adds it here, over the global batch of
the runtime's ``example_group`` (``hftrain.parallel.expert_parallel.load_balancing_loss``), under every strategy,
so the loss is the same whatever the layout. The tokens routed to each expert are counted by hooks on the routers,
summed over the examples' ranks at each logging step (``expert_load_max``: the most loaded expert's tokens over
the mean, the worst layer, 1.0 being perfect balance, in ``log_history``; each expert's share of the tokens,
``expert_share/<e>``, in the trackers) and drawn into ``output_dir/expert_load.png`` (the share of
tokens of each expert in each MoE layer since the start; ``hftrain.pictures.render_expert_load``) at every
checkpoint and at the end.
"""

from __future__ import annotations

from typing import Any

import torch

EXPERT_LOAD_PNG = "expert_load.png"


class ExpertLoad:
    """Router statistics of one MoE model in training (see the module docstring).

    Args:
        model: the prepared model (wrappers allowed).
        example_group: the ranks a global batch's examples are split over (None: one process).
    """

    def __init__(self, model: torch.nn.Module, example_group: Any) -> None:
        from hftrain.parallel.expert_parallel import RouterMonitor

        # a pipeline's chunks record their own routers and compute the router loss on the last stage
        self.pipeline = hasattr(model, "take_router_counts")
        self.monitor = None if self.pipeline else RouterMonitor(model)
        self.group = example_group
        self.model = model
        counts = model.take_router_counts() if self.pipeline else self.monitor.counts
        self.total = torch.zeros_like(counts, device="cpu")  # tokens per (layer, expert) since the start, all ranks

    @staticmethod
    def for_model(model: torch.nn.Module, example_group: Any) -> ExpertLoad | None:
        """The statistics of ``model`` if it is a mixture of experts hftrain routes, else None."""
        from hftrain.parallel.families import is_moe
        from hftrain.parallel.lora import hf_model_of

        inner = hf_model_of(getattr(model, "module", model))
        config = getattr(inner, "config", None)  # a pipeline stage's wrapper has none
        return ExpertLoad(model, example_group) if config is not None and is_moe(config) else None

    def aux_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``router_aux_loss_coef ×`` the load-balancing loss of the forward that just ran, over the global batch (a
        pipeline's: of the micro-batch its last stage just ran, summed over the stages' layers)."""
        if self.pipeline:
            loss = self.model.take_router_loss()
            assert loss is not None, "the last pipeline stage computes the router loss of every micro-batch"
            return loss
        return self.monitor.aux_loss(batch.get("attention_mask"), group=self.group)

    def close_window(self) -> tuple[dict[str, float], dict[str, float]]:
        """Sum the counts since the last call over the examples' ranks (collective, on the routers' device); the
        figures for ``log_history`` (``expert_load_max``, dropped assignments) and for the trackers (each expert's
        share of the window's tokens over all MoE layers)."""
        import torch.distributed as dist

        from hftrain.parallel.expert_parallel import dropped_assignments

        counts = self.model.take_router_counts() if self.pipeline else self.monitor.take_counts()
        dropped = torch.tensor([float(dropped_assignments(self.model))], dtype=counts.dtype, device=counts.device)
        window = torch.cat([counts.reshape(-1), dropped])
        if self.group is not None:
            dist.all_reduce(window, group=self.group)
        if self.pipeline:  # each stage counted its own layers (and dropped its own assignments)
            window = self.model.sum_over_stages(window)
        window = window.cpu()
        counts, dropped = window[:-1].view(self.total.shape), window[-1].item()
        self.total += counts
        mean = counts.mean(dim=1, keepdim=True).clamp(min=1e-12)
        history = {"expert_load_max": (counts / mean).max().item()}
        if dropped:
            history["dropped_token_assignments"] = dropped
        per_expert = counts.sum(dim=0)
        shares = (per_expert / per_expert.sum().clamp(min=1)).tolist()
        return history, {f"expert_share/{e}": share for e, share in enumerate(shares)}

    def picture_data(self) -> list[list[float]]:
        """The counts since the start, per (MoE layer, expert) (``hftrain.pictures.render_expert_load``'s data)."""
        return self.total.tolist()
