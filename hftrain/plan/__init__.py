"""``hftrain plan``: which strategy, with numbers, for DDP, ZeRO-1/2/3 (+ offload), FSDP and TP × PP × DP.

From Python::

    from hftrain.plan import Hardware, Workload, model_from_config, plan
    result = plan(model_from_config("embedded:smollm2"), Hardware(gpus_per_node=8, gpu_memory=24e9), Workload())
    result.choice.label, result.choice.total, [(r.label, r.fits) for r in result.rows]

The modules: ``formulas`` (the arithmetic, each formula stated), ``model`` and ``hardware`` (the inputs),
``data_parallel`` and ``model_parallel`` (one estimator each, strategies as data; ``model_parallel`` composes the
terms of the axes beyond tp and pp: ``axis_term`` (the interface), ``terms`` (the registry), ``context_parallel``,
``expert_parallel``), ``recommend`` (the choice),
``report`` (table / JSON), ``configs`` (``--write-configs``), ``measure`` (the measured counterparts).
"""

from __future__ import annotations

from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec, model_from_config, model_from_sizes
from hftrain.plan.recommend import plan
from hftrain.plan.rows import Plan, Row, Workload

__all__ = ["Hardware", "ModelSpec", "Plan", "Row", "Workload", "model_from_config", "model_from_sizes", "plan"]
