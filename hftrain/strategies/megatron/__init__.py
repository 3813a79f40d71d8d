"""The ``megatron`` strategy's home: everything that adapts ``hftrain.parallel`` to the Trainer and to Accelerate.

=================  ==============================================================================================
``strategy.py``    ``MegatronStrategy``: config -> one validated ``ParallelDims``; preflight; which runtime runs
``checks.py``      pipeline input checks that need the batch geometry or the model (one line each, before any write)
``plugin.py``      ``MegatronPlugin``: the Accelerate adapter (groups, model preparation, data, optimizer, gather)
``runtime.py``     ``MegatronRuntime``: tp × dp for the Trainer, and what every layout shares (clipping, state,
                   export, evaluation)
``pipeline.py``    ``PipelineRuntime``: stages and schedules (pp > 1), on top of ``MegatronRuntime``
``state.py``       checkpoint state: this rank's boxes of each logical tensor (sharded format); streamed export
``loading.py``     ``MegatronLoading``: a pretrained model's blocks read by this rank's stages only, and under tp
                   only its slice of each split tensor, as ``prepare`` splits it
=================  ==============================================================================================

``hftrain.parallel`` below knows neither the Trainer, nor Accelerate; nothing outside this package imports from
it except the strategy registry.
"""

from hftrain.strategies.megatron.strategy import MegatronStrategy

__all__ = ["MegatronStrategy"]
