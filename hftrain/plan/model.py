"""What is planned for: a model described by its config (parameters counted exactly) or by its sizes.

Mixture-of-experts models (Mixtral, Qwen2-MoE, ...) are read from their config: E routed experts per MoE layer
(``num_local_experts`` / ``num_experts``), top-k (``num_experts_per_tok``), the expert width I (Mixtral's
``intermediate_size``, Qwen2-MoE's ``moe_intermediate_size``), Qwen2-MoE's shared expert
(``shared_expert_intermediate_size``) and its dense layers (``mlp_only_layers``, ``decoder_sparse_step``), through
the family's expert plan (``hftrain.parallel.families``, the registry the trainer routes and splits with). A
MoE layer's routed experts hold ``E · 3·h·I`` parameters (``gate_up_proj [E, 2I, h]`` and ``down_proj [E, h, I]``);
they are counted from the model built on the meta device (exactly, as Ψ). Which parallel axes a family takes
(``axes``) comes from the same registry, so a row the trainer would refuse is marked formula-only.

A language model (``model.task: causal_lm``, its record's ``vocabulary_head``) is counted as the
``AutoModelForCausalLM`` model that training builds: its output projection (``lm_head``) counted once when tied to the
input embedding, ``V·h`` more when untied (``lm_head_parameters``). The megatron axes that do not run a language model
together yet (``hftrain.parallel.LANGUAGE_MODEL_LAYOUTS_NOT_BUILT``: none since pp × cp trains one) are
``refused_layouts``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.errors import ConfigError, reading
from hftrain.models.checks import FIELD, _auto_config, config_errors, read_config_file
from hftrain.models.remote_code import check_remote_code
from hftrain.parallel.dims import AXIS_SIZES
from hftrain.tasks import DEFAULT_TASK, task_of
from hftrain.tasks import TASKS as TASK_RECORDS

# The largest size (layers, hidden, heads, vocabulary, MLP width) a model given by hand may have: far beyond any
# real model, and small enough that every formula's product stays a finite float.
MAX_SIZE = 10**8

TASKS = tuple(TASK_RECORDS)
"""What ``model.task`` trains (``hftrain.tasks``): each task's model is counted from its record."""


@dataclass(frozen=True)
class ModelSpec:
    """The sizes the estimates need.

    Args:
        name: what the user named (a folder, ``embedded:<name>``, or ``custom``).
        parameters: Ψ, all parameters (tied weights once).
        layers: transformer layers L.
        hidden: hidden size h.
        heads: attention heads a.
        kv_heads: key/value heads (grouped-query attention; = heads otherwise).
        intermediate: MLP width i.
        vocab: vocabulary size V.
        layer_parameters: parameters of one transformer layer (the mean over the layers where they differ, as
            Qwen2-MoE's dense and sparse layers do).
        largest_layer_parameters: the largest single module's parameters (DeepSpeed's ZeRO-3 estimator input).
        model_type: the transformers ``model_type`` (None for sizes given by hand).
        source: a local folder or ``embedded:<name>`` that a job config can load, or None.
        counted: ``"exact"`` (built on the meta device) or ``"formula"`` (12·L·h² + V·h).
        dropout: whether the config has dropout on (unknown for sizes given by hand: assumed on).
        head_parameters: what the last pipeline stage holds outside its layers (pooler, final norm,
            classifier: ``hftrain.parallel.stages``' head modules); 0 when unknown (all of it counted on stage 0).
        experts: routed experts E per MoE layer (0: a dense model).
        top_k: experts each token is routed to (k).
        moe_layers: layers with routed experts (the others are dense).
        expert_parameters: the routed experts' parameters over all MoE layers (split over ``ep``).
        replicated_mlp_parameters: the other parameters of a MoE model's ``mlp`` blocks (routers, shared experts
            and their gates, dense layers' MLPs), which tensor parallelism leaves whole on every tp rank.
        shared_intermediate: the shared expert's width (Qwen2-MoE; 0 when none).
        gated: a gated MLP (SwiGLU: three matrices), from the family's registry entry (False when unknown).
        axes: the model-parallel axes hftrain's trainer takes for this model (``tp``, ``pp``, ``cp``, ``ep``), from
            the family's registry entry; every axis for sizes given by hand (formula-only).
        task: ``model.task`` (``hftrain.tasks``): which model is counted, and whether the activations include the
            logits over the vocabulary (its record's ``vocabulary_head``; ``formulas.logits_activation_bytes``).
        lm_head_parameters: a language model's untied output projection (split over the vocabulary under tp, like
            the embedding); 0 when tied to the input embedding, and for a classifier.
        sequence_parallel: whether tp may also cut the sequence (the registry's answer: not for a mixture of experts
            nor ALBERT; assumed for sizes given by hand).
        layer_modules: the distinct layer modules when the layers run fewer of them (ALBERT's one group, run by every
            layer: its weights counted once, its activations, compute and tp traffic ``layers`` times); 0: one
            module per layer.
    """

    name: str
    parameters: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    layer_parameters: int
    largest_layer_parameters: int
    model_type: str | None = None
    source: str | None = None
    counted: str = "exact"
    dropout: bool = True
    head_parameters: int = 0
    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    expert_parameters: int = 0
    replicated_mlp_parameters: int = 0
    shared_intermediate: int = 0
    gated: bool = False
    axes: frozenset[str] = frozenset(AXIS_SIZES)
    task: str = DEFAULT_TASK
    lm_head_parameters: int = 0
    sequence_parallel: bool = True
    layer_modules: int = 0

    @property
    def held_layers(self) -> int:
        """The layer modules the model holds: ``layers``, or fewer where layers share one (ALBERT: 1)."""
        return self.layer_modules or self.layers

    @property
    def causal_lm(self) -> bool:
        """Whether a language model is trained (its logits are activations, its lm_head split over the vocabulary):
        the task record's ``vocabulary_head``."""
        return task_of(self.task).vocabulary_head

    @property
    def refused_layouts(self) -> tuple[tuple[str, ...], ...]:
        """Megatron axes the trainer refuses together for this model's task whatever the family: each axis its record
        does not run yet (``megatron_axes_not_built``), and for a per-token loss (a language model's, a token
        classifier's) the pairs not built yet (``LANGUAGE_MODEL_LAYOUTS_NOT_BUILT``, empty now); none for a
        sequence classifier."""
        record = task_of(self.task)
        alone = tuple((axis,) for axis in record.megatron_axes_not_built)
        if not record.per_token_loss:
            return alone
        from hftrain.parallel.parallelize import LANGUAGE_MODEL_LAYOUTS_NOT_BUILT

        return alone + LANGUAGE_MODEL_LAYOUTS_NOT_BUILT

    @property
    def gated_mlp(self) -> bool:
        return self.gated

    @property
    def moe(self) -> bool:
        """Whether the model has routed experts (a mixture of experts)."""
        return self.experts > 0

    @property
    def active_parameters(self) -> float:
        """Parameters each token runs through: Ψ − (1 − k/E) · the routed experts' (Ψ for a dense model; a shared
        layer counted once per layer that runs it)."""
        if not self.moe:
            return self.parameters + (self.layers - self.held_layers) * self.layer_parameters
        return self.parameters - self.expert_parameters * (1 - self.top_k / self.experts)

    @property
    def activation_intermediate(self) -> int:
        """The MLP width whose activations a token saves: I, or k·I (+ the shared expert's) for a MoE layer."""
        return self.top_k * self.intermediate + self.shared_intermediate if self.moe else self.intermediate

    @property
    def embedding_parameters(self) -> int:
        """Everything outside the layers (embeddings, final norm, head)."""
        return self.parameters - self.held_layers * self.layer_parameters

    def lora_parameters(self, rank: int) -> int:
        """Trainable parameters of LoRA r on the query and value projections of every layer (PEFT's default).

        Args:
            rank: the LoRA rank r.
        """
        head_dim = self.hidden // self.heads
        query = rank * (self.hidden + self.hidden)
        value = rank * (self.hidden + self.kv_heads * head_dim)
        return self.held_layers * (query + value)

    def check_parallel(self, tp: int, pp: int) -> None:
        """Refuse a tensor/pipeline split the model's sizes do not allow (one line, naming the size).

        Args:
            tp: tensor-parallel size.
            pp: pipeline-parallel size.
        """
        from hftrain.parallel.plans import kv_heads_split

        # As hftrain.parallel.plans: the vocabulary is padded to a multiple of tp (not a constraint), the query heads
        # split evenly, the key/value heads evenly or replicated (tp a multiple of them).
        # a MoE model's experts are not split by tp (its mlp blocks stay whole on every tp rank): no intermediate
        sizes = [("attention heads", self.heads), ("hidden size", self.hidden)]
        if not self.moe:
            sizes.append(("intermediate size", self.intermediate))
        for name, value in sizes:
            if value % tp:
                raise ConfigError(
                    f"--tp {tp} does not divide the {name} {value} of {self.name}; valid --tp: "
                    f"{', '.join(str(d) for d in divisors(value) if d <= 64)}"
                )
        if not kv_heads_split(self.kv_heads, tp):
            valid = [d for d in divisors(self.heads) if d <= 64 and kv_heads_split(self.kv_heads, d)]
            raise ConfigError(
                f"--tp {tp} neither divides nor is a multiple of the {self.kv_heads} key/value heads of {self.name} "
                f"(they are split evenly or replicated); valid --tp: {', '.join(map(str, valid))}"
            )
        if self.layers % pp:
            raise ConfigError(
                f"--pp {pp} does not divide the {self.layers} layers of {self.name}; valid --pp: "
                f"{', '.join(str(d) for d in divisors(self.layers))}"
            )

    def admits(self, tp: int, pp: int) -> bool:
        """Whether ``check_parallel(tp, pp)`` passes."""
        try:
            self.check_parallel(tp, pp)
        except ConfigError:
            return False
        return True


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(√n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def model_from_sizes(
    *,
    parameters: int | None,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    intermediate: int | None = None,
    kv_heads: int | None = None,
    task: str = DEFAULT_TASK,
) -> ModelSpec:
    """A model given by its sizes; Ψ defaults to the GPT formula 12·L·h² + V·h (weights of a 4h-MLP layer; for a
    language model, its output projection tied to the embedding).

    Args:
        parameters: Ψ, if known (otherwise computed).
        layers: transformer layers L.
        hidden: hidden size h.
        heads: attention heads a.
        vocab: vocabulary size V.
        intermediate: MLP width (4h by default).
        kv_heads: key/value heads (``heads`` by default).
        task: ``model.task`` (``TASKS``).
    """
    _check_task(task)
    for name, value in (("--layers", layers), ("--hidden", hidden), ("--heads", heads), ("--vocab", vocab)):
        if value is None or value < 1:
            raise ConfigError(f"{name} must be a positive integer when the model is given by its sizes")
        if value > MAX_SIZE:
            raise ConfigError(f"{name} {value}: larger than any model ({MAX_SIZE:,} at most); check the value")
    for name, value in (("--parameters", parameters), ("--intermediate", intermediate), ("--kv-heads", kv_heads)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value}: must be a positive integer (or left out for its default)")
    if intermediate is not None and intermediate > MAX_SIZE:
        raise ConfigError(f"--intermediate {intermediate}: larger than any model ({MAX_SIZE:,} at most); check it")
    if hidden % heads:
        raise ConfigError(f"--heads {heads} does not divide --hidden {hidden}; heads must divide the hidden size")
    if kv_heads is not None and (kv_heads > heads or heads % kv_heads):
        raise ConfigError(
            f"--kv-heads {kv_heads}: key/value heads must divide the {heads} attention heads (each serves a group "
            f"of query heads); valid: {', '.join(str(d) for d in divisors(heads))}"
        )
    intermediate = intermediate or 4 * hidden
    layer = 4 * hidden * hidden + 2 * hidden * intermediate
    psi = parameters or layers * layer + vocab * hidden
    if psi < layers * layer:
        raise ConfigError(
            f"--parameters {psi} is less than {layers} layers of {layer} parameters (12·h² each at "
            f"hidden {hidden}); check --parameters, --layers and --hidden"
        )
    return ModelSpec(
        "custom",
        int(psi),
        layers,
        hidden,
        heads,
        kv_heads or heads,
        intermediate,
        vocab,
        layer,
        max(layer // 2, vocab * hidden),
        counted="formula" if not parameters else "given",
        task=task,
    )


def model_from_config(name_or_path: str, task: str = DEFAULT_TASK) -> ModelSpec:
    """A model from a local folder, a ``config.json`` file or ``embedded:<name>``; Ψ counted on the meta device.

    Args:
        name_or_path: what ``hftrain.models.resolve_model_path`` accepts, or a config file.
        task: ``model.task``: the model its record's auto class builds is counted.
    """
    from hftrain.parallel.families import is_gated_mlp, takes_sequence_parallel, trainable_axes

    _check_task(task)
    with _as_option():
        config, where = _load_config(name_or_path)
        model = _meta_model(config, where, task)
    layers_module = _layers(model)
    runs = _layer_runs(config, model)  # the registry's trunk: the module each layer runs (ALBERT: one, L times)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers_module]
    mean = sum(per_layer) / len(per_layer)  # Qwen2-MoE's dense layers are smaller than its sparse ones
    layer_params = int(mean) if mean.is_integer() else mean
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum({id(p): p.numel() for p in model.parameters()}.values())  # tied weights once
    heads = config.num_attention_heads
    hidden = config.hidden_size
    return ModelSpec(
        name=name_or_path,
        parameters=total,
        layers=len(runs) if runs else len(layers_module),
        hidden=hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        # a MoE model's expert width (Qwen2-MoE's intermediate_size is its dense layers')
        intermediate=getattr(config, "moe_intermediate_size", None)
        or getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * hidden,
        vocab=config.vocab_size,
        layer_parameters=layer_params,
        largest_layer_parameters=largest,
        model_type=config.model_type,
        dropout=any(
            (getattr(config, key, 0) or 0) > 0
            for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "resid_pdrop")
        ),
        source=None if name_or_path.endswith(".json") else name_or_path,
        head_parameters=_head_parameters(model, task),
        gated=is_gated_mlp(config),
        axes=trainable_axes(config, head=task),  # the registry's answer for the task's head kind (parallel.families)
        task=task,
        lm_head_parameters=_lm_head_parameters(model) if task_of(task).vocabulary_head else 0,
        sequence_parallel=takes_sequence_parallel(config),
        layer_modules=len(layers_module) if runs else 0,
        **_moe_sizes(config, model),
    )


def _layer_runs(config: Any, model: Any) -> list[Any] | None:
    """The module each layer runs, by the family's trunk adapter (``hftrain.parallel.families``), where the layers
    share modules (ALBERT's group, run ``num_hidden_layers`` times); None when every layer is its own module."""
    from hftrain.parallel.families import family_of

    family = family_of(config)
    if family is None or family.stages is None:
        return None
    runs = list(family.stages.layers(model))
    return runs if len({id(m) for m in runs}) < len(runs) else None


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ConfigError(f"--task {task!r}: choose {', '.join(TASKS)}")


def _lm_head_parameters(model: Any) -> int:
    """A language model's output projection's parameters when it has its own weight (untied); 0 when it shares the
    input embedding's (tied: already counted once, with the embedding)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        return 0
    shared = {id(p) for p in embedding.parameters()}
    return sum(p.numel() for p in head.parameters() if id(p) not in shared)


def _moe_sizes(config: Any, model: Any) -> dict[str, int]:
    """A MoE model's ``ModelSpec`` fields (none for a dense model), read through the family's expert plan, the one
    the trainer routes with (``hftrain.parallel.families``): E and k from its config fields, the
    MoE blocks (Qwen2-MoE's dense ``mlp_only_layers`` skipped) and their routed experts' parameters from the model
    on the meta device, and the rest of every layer's ``mlp`` (routers, shared experts, dense MLPs: replicated
    over tp) beside them."""
    from hftrain.parallel.expert_parallel import moe_blocks
    from hftrain.parallel.families import expert_plan_for

    plan = expert_plan_for(config)
    if plan is None:
        return {}
    blocks = list(moe_blocks(model, plan))
    routed = sum(p.numel() for block in blocks for p in getattr(block, plan.experts).parameters())
    mlps = sum(p.numel() for layer in model.get_submodule(plan.layers) for p in getattr(layer, plan.block).parameters())
    return {
        "experts": getattr(config, plan.num_experts),
        "top_k": getattr(config, plan.top_k),
        "moe_layers": len(blocks),
        "expert_parameters": routed,
        "replicated_mlp_parameters": mlps - routed,
        "shared_intermediate": getattr(config, "shared_expert_intermediate_size", None) or 0,
    }


def _head_parameters(model: Any, task: str = DEFAULT_TASK) -> int:
    """Parameters of the modules hftrain's pipeline puts on the last stage (0 for a family it cannot split). A language
    model's: its untied output projection (its pipeline is not built: pp rows are formula-only; the final norm, a few
    h, is left on stage 0)."""
    from hftrain.parallel.families import stages_of

    if task_of(task).vocabulary_head:
        return _lm_head_parameters(model)
    try:
        family = stages_of(model)
    except ConfigError:
        return 0
    return sum(p.numel() for module in family.head_modules(model).values() for p in module.parameters())


@contextlib.contextmanager
def _as_option() -> Iterator[None]:
    """The job config's field name in a model check's message, said as this command's option (``--model``)."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(str(error).replace(f"{FIELD}:", "--model:")) from None


def _load_config(name_or_path: str) -> tuple[Any, Path]:
    """The transformers config of a folder, a config file or ``embedded:<name>``, and the file it came from.

    A folder (or its ``config.json``) gets ``train``'s checks of ``model.model_name_or_path``; any config file
    the same: valid JSON, a mapping with a ``model_type``, fields of the types transformers declares.
    """
    from transformers import AutoConfig

    from hftrain.models import resolve_model_path

    path = Path(name_or_path)
    if path.is_file():
        if path.suffix != ".json":
            raise ConfigError(
                f"--model: '{name_or_path}' is a file but not a config.json; give a model folder, "
                "its config.json, embedded:<name>, or the sizes (--parameters, --layers, ...)"
            )
        if path.name != "config.json":  # AutoConfig reads config.json from a folder; any other name: for_model
            raw = read_config_file(path, "--model")
            if raw.get("auto_map"):  # the classes it names would be imported from beside it
                raise ConfigError(
                    f"--model: {path} names Python code to run (auto_map), and hftrain plan runs no model code; "
                    "remove auto_map from it, or give the sizes (--parameters, --layers, ...)"
                )
            with reading(f"--model: {path}", "fix the config or save the model again with save_pretrained",
                         catch=config_errors()):  # fmt: skip
                return AutoConfig.for_model(**raw), path
        folder = path.parent
    else:
        folder = resolve_model_path(name_or_path)
    # Before transformers reads the folder: it would ask on stdin whether to run the code an auto_map names.
    check_remote_code(folder, "--model", fix="remove auto_map from it, or give the sizes (--parameters, --layers, ...)")
    read_config_file(folder / "config.json", "--model")
    with reading(f"--model: {folder / 'config.json'}", "fix the config or save the model again with save_pretrained",
                 catch=config_errors()):  # fmt: skip
        return _auto_config(folder), folder / "config.json"


def _meta_model(config: Any, where: Path, task: str = DEFAULT_TASK) -> Any:
    """The model hftrain trains for ``task``, built without memory (parameters on ``meta``) by its record's auto class:
    a 2-label classifier, or the ``AutoModelForCausalLM`` language model (tied weights stay one parameter).

    Args:
        config: the transformers config.
        where: the file it came from, for the message when the architecture refuses its sizes.
        task: ``model.task``.
    """
    import torch
    import transformers

    record = task_of(task)
    what, builder = record.human, getattr(transformers, record.auto_class)
    config.num_labels = 2
    with reading(
        f"--model: {where} does not describe a buildable {what}",
        "fix its sizes (e.g. hidden_size divisible by num_attention_heads, every size at least 1) or choose "
        "another model",
        catch=config_errors(),
    ):
        with torch.device("meta"):
            return builder.from_config(config, trust_remote_code=False)


def _layers(model: Any) -> Any:
    """The ``ModuleList`` of transformer layers (the longest one in the model)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        config = getattr(model, "config", None)
        count = getattr(config, "num_hidden_layers", None)
        said = f" (its config has num_hidden_layers {count})" if count is not None else ""
        raise ConfigError(
            f"--model: no transformer layers found in {type(model).__name__}{said}; fix the config's layer count "
            "or give the sizes instead"
        )
    return max(lists, key=len)
