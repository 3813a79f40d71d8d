"""The record of one model family (:class:`Family`): what each family module exports and the registry gathers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hftrain.parallel.plans import ExpertPlan, TensorParallelPlan


@dataclass(frozen=True)
class Family:
    """What hftrain knows of one model family.

    Args:
        name: how messages and the README name it (``"Qwen3"``).
        tp: its tensor-parallel plan, or a function of the config giving it (derived from transformers' plan); None
            where tp cannot split it (``refusals["tp"]`` says why).
        stages: its trunk's pipeline adapter (embedding, layers, final norm; in its module); None: no
            pp and no cp. Context parallelism also reads two optional members of it: ``context_parallel_attention(
            model, batch)``, which splits an attention module of the family's own (outside transformers' attention
            interface: DeBERTa's), and ``cp_comm_only``, ``(cp_comm, why)`` where one exchange alone splits it.
        classifier: its ``*ForSequenceClassification``'s head (a ``StageHead``: the pipeline's last chunk's pooling
            and classifier; the ``"sequence_classification"`` head kind, ``hftrain.parallel.heads.HEADS``).
        token_classifier: its ``*ForTokenClassification``'s head where it is not the generic one (dropout and
            ``classifier`` on every position: ``hftrain.parallel.heads.TokenClassificationHead``), or None.
        experts: its expert plan (a mixture of experts), or None.
        refusals: ``axis -> why`` for the axes it cannot take (one line each).
        config_refusals: ``axis -> function of the config`` giving why the axis cannot split a model of this config
            exactly (Gemma-2's soft-capped attention under cp), or None when it can.
        gated_mlp: its MLP is gated (three matrices: the planner's FLOPs and sizes).
    """

    name: str
    tp: TensorParallelPlan | Callable[[Any], TensorParallelPlan] | None = None
    stages: Any = None
    classifier: Any = None
    token_classifier: Any = None
    experts: ExpertPlan | None = None
    refusals: dict[str, str] = field(default_factory=dict)
    config_refusals: dict[str, Callable[[Any], str | None]] = field(default_factory=dict)
    gated_mlp: bool = False

    def tp_plan(self, config: Any) -> TensorParallelPlan | None:
        """This family's tensor-parallel plan for ``config`` (None: refused)."""
        return self.tp(config) if callable(self.tp) else self.tp
