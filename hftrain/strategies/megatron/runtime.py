"""The Trainer's operations for tp × dp (``megatron`` with ``pp = 1``), and what the pipeline runtime shares.

:class:`MegatronRuntime` does what Accelerate cannot for a tensor-parallel model: DDP over the dp group only,
data sharded by dp rank, the TP-aware gradient norm, evaluation gathered over dp, its boxes in the sharded checkpoints
and the streamed export, all through the :class:`~hftrain.strategies.megatron.plugin.MegatronPlugin` adapter.
Accelerate still provides the process group, gradient accumulation (``accumulate``/``backward``), autocast and the
trackers.

Everything that does not depend on how the model is cut is here once, for both layouts: the parameters a rank
owns (``params``: all of them here, its stages' under pipeline parallelism), the optimizer rebuilt over them, the
clipping (``hftrain.parallel.clip_grad_norm_``, summed over pp too when there are stages), the checkpoint state
(``hftrain.strategies.megatron.state``), the export weights and the evaluation gather. The pipeline runtime
(``hftrain.strategies.megatron.pipeline_runtime``) overrides only ``prepare`` and ``forward_backward``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hftrain.strategies.runtime import AccelerateRuntime, Batch

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from hftrain.checkpoint.sharded import Snapshot
    from hftrain.models.weights import BlockLoading
    from hftrain.strategies.megatron.plugin import MegatronPlugin
    from hftrain.strategies.runtime import RuntimeTask


class MegatronRuntime(AccelerateRuntime):
    """The Trainer's operations for tp × dp, through the set-up plugin (its groups).

    Args:
        accelerator: gives the process group, accumulation, autocast and trackers.
        plugin: the set-up plugin.
        block_loading: the strategy's way to load a pretrained model's blocks (``MegatronStrategy.block_loading``:
            ``hftrain.strategies.megatron.loading``), or None (whole).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        plugin: MegatronPlugin,
        *,
        task: RuntimeTask,
        block_loading: Callable[[Accelerator], BlockLoading | None] | None = None,
    ) -> None:
        super().__init__(accelerator, task=task, block_loading=block_loading)
        self.plugin = plugin
        self._model: torch.nn.Module | None = None  # the tensor-parallel HF model, unwrapped
        self._params: dict[str, torch.nn.Parameter] = {}  # HF name -> the parameters this rank owns
        self._optimizer: Any = None

    @property
    def dp_size(self) -> int:
        return self.plugin.groups.dp_size

    @property
    def example_group(self) -> Any:
        # tp (and pp) ranks of a replica hold the same examples; the data replicas of a dense parameter (dp, and
        # the context-parallel ranks holding parts of the same examples) hold the others
        group, _, count = self.plugin.groups.data_replicas(None)
        return group if count > 1 else None

    @property
    def pad_to_multiple_of(self) -> int | None:
        # tp under sequence parallelism (it splits the sequence over tp), 2·cp under context parallelism
        return self.plugin.sequence_multiple

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: torch.utils.data.DataLoader,
        eval_loader: torch.utils.data.DataLoader | None,
    ) -> tuple[torch.nn.Module, Any, Any, Any]:
        plan = OptimizerPlan.take(optimizer, model)
        model = self.plugin.prepare_model(model, device=self.accelerator.device, head=self.stage_head)
        if self.mixed_precision != "no":
            autocast_forward(model, self.accelerator)
        self._model = self.plugin_unwrap(model)
        self._params = dict(self._model.named_parameters())
        return model, *self._prepare_rest(plan, train_loader, eval_loader)

    def _prepare_rest(
        self,
        plan: OptimizerPlan,
        train_loader: torch.utils.data.DataLoader,
        eval_loader: torch.utils.data.DataLoader | None,
    ) -> tuple[Any, Any, Any]:
        """The optimizer rebuilt over ``self._params`` and the loaders sharded by dp rank (both layouts)."""
        device = self.accelerator.device
        prepared = self.plugin.prepare_optimizer(plan.build(self._params))
        train_loader = self.plugin.prepare_data_loader(train_loader, device=device)
        eval_loader = self.plugin.prepare_data_loader(eval_loader, device=device) if eval_loader is not None else None
        self._optimizer = prepared.optimizer  # kept for save_state, as Accelerate keeps what it prepared
        return prepared, train_loader, eval_loader

    def apply_recomputation(self, model: torch.nn.Module, mode: str) -> str:
        # After the split (parallelize_model's last apply call), so that a full-layer checkpoint binds this rank's
        # RNG tracker and a selective one wraps the attention context parallelism installs.
        self.plugin.recompute = mode
        return f"gradient_checkpointing: {mode} (after the model is split; the RNG tracker's streams are replayed)"

    def apply_compile(self, model: torch.nn.Module, mode: str) -> str:
        # Before the split, as elsewhere: the compile is lazy, and the split replaces the linears and norms inside
        # each block (the block objects stay), so the first forward compiles the tensor-parallel block, its f/g
        # collectives (autograd functions around all-reduces over the tp group) inside the graph.
        from hftrain.parallel.axis_ops import not_built

        for axis, size, reason in not_built(self.plugin.groups.dims, "compile"):  # each axis's own refusal
            from hftrain.strategies.runtime import refuse_compile

            refuse_compile(f"parallelism.{axis}={size}: {reason}; use {axis}: 1")
        if self.plugin.recompute == "full":  # applied after the split, so the blocks do not say it yet
            from hftrain.strategies.runtime import refuse_full_recomputation

            refuse_full_recomputation()
        return super().apply_compile(model, mode)

    def plugin_unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from hftrain.strategies.megatron.plugin import unwrap

        return unwrap(model)

    def forward_backward(self, model: torch.nn.Module, batch: Batch, task: Any) -> torch.Tensor:
        loss = super().forward_backward(model, batch, task)
        if self.sync_gradients:  # the window's gradients are complete (DDP reduced them over dp in this backward)
            self.plugin.finalize_grads(model)
        return loss

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        from hftrain.parallel import clip_grad_norm_

        groups = self.plugin.groups
        return clip_grad_norm_(
            self._model,
            self._params,
            max_norm,
            groups=groups.cut_groups,
            pp_group=groups.pp_group,
        )

    def evaluation_step(self, model: torch.nn.Module, batch: Batch, task: Any) -> tuple[torch.Tensor, ...]:
        return self.plugin.gather_for_metrics(task.prediction_step(model, batch))

    # reduce_mean and any_rank stay Accelerate's world-wide reductions: tp (and pp) ranks of a replica hold the
    # same loss, so the world mean is the mean over dp.

    def save_extras(self, directory: str) -> None:
        from hftrain.parallel import check_replicas_agree
        from hftrain.parallel.random import save_streams

        groups = self.plugin.groups
        # Before anything is written: the checkpoint keeps one copy of every replicated parameter.
        # Bit-identical where kernels are deterministic (a CPU); on a GPU within a bound after one broadcast.
        check_replicas_agree(self._model, tp_group=groups.tp_group, exact=self.device.type == "cpu")
        # Scheduler and per-rank RNG as every strategy saves them, the RNG tracker's streams per mesh coordinate
        # beside them.
        super().save_extras(directory)
        save_streams(directory, self.plugin.rng_tracker, groups=groups)

    def snapshot(self) -> Snapshot:
        from hftrain.strategies.megatron.state import snapshot

        return snapshot(self._model, self._params, self._optimizer, groups=self.plugin.groups, info=self.layout_facts())

    def load_extras(self, directory: str) -> None:
        from hftrain.checkpoint.sharded import read_verified
        from hftrain.log import log_main
        from hftrain.parallel.random import load_streams

        super().load_extras(directory)
        # After Accelerate's per-rank RNG: on another layout those are other ranks' states, and the tracker's
        # deterministic rebuild replaces them, identical over each tp group.
        note = load_streams(directory, self.plugin.rng_tracker, groups=self.plugin.groups, read=read_verified)
        if note:
            log_main(note)

    def load_snapshot(self, directory: str) -> None:
        from hftrain.strategies.megatron.state import load_snapshot

        load_snapshot(directory, self._model, self._params, self._optimizer, groups=self.plugin.groups)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights gathered over tp (and merged over pp); collective."""
        from hftrain.strategies.megatron.state import merged_weights

        return merged_weights(self._model, self._params, self.plugin.groups)

    def iter_full_state(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The full tensors one at a time, gathered over tp by the stage holding each and sent to the main
        process (collective; see the base)."""
        from hftrain.strategies.megatron.state import iter_full_state

        return iter_full_state(self._model, self._params, self.plugin.groups)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._model if self._model is not None else self.plugin_unwrap(model)

    def layout_facts(self) -> dict[str, int]:
        """This run's layout, recorded in checkpoints."""
        dims = self.plugin.groups.dims
        return {**dims.sizes, "world_size": dims.world_size}


@dataclass(frozen=True)
class OptimizerPlan:
    """An optimizer's class and parameter groups by name: what is needed to rebuild it over split parameters.

    The Trainer builds the optimizer over the full model before the strategy splits it (as Accelerate expects);
    the split layers hold new parameters with the same names. Taking the plan empties the given optimizer, so that
    it no longer keeps the unsplit parameters alive: each unsplit weight is freed as soon as its layer is split
    (or its stage released), instead of the whole model staying resident beside its shards.

    Args:
        optimizer_class: the optimizer's class.
        groups: per parameter group, its hyper-parameters and the names of its parameters.
    """

    optimizer_class: type
    groups: list[tuple[dict[str, Any], list[str]]]

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> OptimizerPlan:
        """The plan of ``optimizer`` over ``model``'s named parameters; ``optimizer`` is left without parameters.

        Args:
            optimizer: the optimizer over the unsplit model (no state yet).
            model: the unsplit model.
        """
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [
            ({k: v for k, v in group.items() if k != "params"}, [names[id(p)] for p in group["params"]])
            for group in optimizer.param_groups
        ]
        for group in optimizer.param_groups:
            group["params"] = []
        return cls(type(optimizer), groups)

    def build(self, params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over the parameters this rank owns; every group kept, possibly empty, so that the groups
        line up across pipeline stages when checkpoint state is merged.

        Args:
            params: HF name -> this rank's (tensor-parallel) parameter.
        """
        groups = [
            {**options, "params": [params[name] for name in names if name in params]} for options, names in self.groups
        ]
        return self.optimizer_class(groups)


def autocast_forward(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Run ``model``'s forward under Accelerate's autocast with fp32 outputs, as ``prepare(model)`` would."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(forward_in_autocast)
