"""Pipeline stages: split an unchanged HF model (a sequence or token classifier, a decoder's causal LM, or a model
whose task names its own head) into contiguous layer chunks.

A chunk maps the pipeline's activation tuple to the next one without opening it
(:class:`~hftrain.parallel.stages.PipelineChunk`). Its model's adapter (:class:`~hftrain.parallel.stages.ModelStages`)
joins the family's *trunk* (embedding, layers, final norm: ``hftrain.parallel.families``) and the task's *head*
(:class:`~hftrain.parallel.heads.StageHead`, named by its kind: ``hftrain.parallel.heads.HEADS``): the head names
the batch columns the first chunk reads, what travels beside the hidden states, and what the last chunk returns.
The tuple is ``(hidden [b, s, h] float, trunk_input [b, s], *carries)``:

* ``hidden`` is the only tensor that carries gradient;
* ``trunk_input`` is the 2-D attention mask as given, from which every chunk rebuilds the 4-D mask with transformers'
  own ``create_causal_mask``/``create_bidirectional_mask``, exactly as the unsharded model does; or, for a causal
  LM's packed blocks (:class:`~hftrain.parallel.heads.CausalLMHead`), the position ids the masks are built from;
* ``carries`` are the head's: a classifier's ``pool`` ``[b, s]``, the float one-hot of the token it classifies
  (:class:`~hftrain.parallel.heads.SequenceClassificationHead`); a token classifier carries none.

Position ids are otherwise ``arange(s)`` (as in the families' ``forward`` without a cache), so each chunk recomputes
them (and rotary embeddings) instead of sending them. Parameters keep their HF names through
``PipelineChunk.hf_name``, so checkpoints and export can merge stages.

Chunk ``c`` of ``pp · virtual_stages`` lives on pipeline rank ``c % pp`` (the ``"loop"`` style: Megatron's
interleaved assignment) or, for ZBV, down the ranks and back up (the ``"v"`` style); see
:func:`chunk_ids_of_rank`.

A PEFT model (LoRA) is cut the same way: the family's paths are its HF model's (``hftrain.parallel.lora.hf_model_of``),
whose layers hold PEFT's ``lora.Linear`` modules (``y = x Wᵀ + s · B A x``, split with their base under tp) and whose
head is PEFT's ``modules_to_save`` wrapper (the classifier's trainable copy); so each chunk keeps its own layers'
adapters and the last one the head's copy, and every parameter keeps its PEFT name (``base_model.model.…``) for the
checkpoint and the adapter export. Nothing crosses the stages that the full model's pipeline does not send: the
activations ``hidden`` and their gradients. Frozen base weights take no gradient, so they need no optimizer state and
no gradient completion (``hftrain.parallel.placement.complete_grads`` skips them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hftrain.errors import AxisError, ConfigError
from hftrain.parallel.axis_ops import AxisOps
from hftrain.parallel.lora import hf_model_of

if TYPE_CHECKING:
    import torch

    from hftrain.parallel.stages import PipelineChunk

BALANCES = ("layers", "parameters")


def _check_split(num_layers: int, pp: int, virtual_stages: int, balance: str) -> int:
    """Validate a split request and return the number of chunks."""
    if pp < 1:
        raise AxisError("pp", f"pp must be >= 1, got {pp}")
    if virtual_stages < 1:
        raise AxisError("virtual_stages", f"virtual_stages must be >= 1, got {virtual_stages}")
    if virtual_stages > 1 and pp == 1:
        raise AxisError("virtual_stages", "virtual_stages > 1 needs pp > 1 (an interleaved schedule with one stage)")
    if balance not in BALANCES:
        raise ConfigError(f"pipeline balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    chunks = pp * virtual_stages
    if chunks > num_layers:
        raise AxisError(
            "pp",
            f"pp × virtual_stages = {chunks} pipeline stages but the model has only {num_layers} layers; "
            "use fewer stages",
        )
    if virtual_stages > 1 and num_layers % chunks:
        raise AxisError(
            "virtual_stages",
            f"virtual_stages={virtual_stages} with pp={pp} needs the {num_layers} layers to divide into "
            f"{chunks} equal chunks; choose virtual_stages so that pp × virtual_stages divides {num_layers}",
        )
    return chunks


def _split_by_count(num_layers: int, chunks: int) -> list[int]:
    """Layer counts differing by at most one; the extra layers go to the last chunks (the first embeds)."""
    base, extra = divmod(num_layers, chunks)
    return [base + (1 if c >= chunks - extra else 0) for c in range(chunks)]


def _split_by_size(sizes: list[int], chunks: int) -> list[int]:
    """Contiguous partition of ``sizes`` into ``chunks`` non-empty parts minimising the largest part's sum.

    Classic linear-partition dynamic programme: ``best[k][i]`` is the smallest possible maximum when the first
    ``i`` layers form ``k`` chunks. O(chunks · n²), fine for the few hundred layers of real models.
    """
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0
    for k in range(1, chunks + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(chunks, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def stage_layer_ranges(
    num_layers: int,
    *,
    pp: int,
    virtual_stages: int = 1,
    balance: str = "layers",
    layer_sizes: list[int] | None = None,
) -> list[range]:
    """Split ``num_layers`` transformer layers into ``pp · virtual_stages`` contiguous chunks.

    Chunk ``c`` gets layers ``ranges[c]``; which rank holds it is :func:`chunk_ids_of_rank`'s business.

    Args:
        num_layers: number of transformer layers.
        pp: pipeline-parallel size (ranks).
        virtual_stages: chunks per rank (interleaved schedules); must split the layers evenly when > 1.
        balance: ``"layers"`` (equal layer counts) or ``"parameters"`` (equal sums of ``layer_sizes``).
        layer_sizes: per-layer cost (e.g. parameter count) for ``balance="parameters"``.

    Raises:
        ConfigError: more chunks than layers, virtual stages that do not divide the layers, bad sizes.
    """
    chunks = _check_split(num_layers, pp, virtual_stages, balance)
    if balance == "layers" or virtual_stages > 1:
        # interleaving needs equal chunks (every rank runs v of them in lock step)
        counts = _split_by_count(num_layers, chunks)
    else:
        if layer_sizes is None or len(layer_sizes) != num_layers:
            raise ConfigError(f"balance='parameters' needs layer_sizes with one entry per layer ({num_layers})")
        counts = _split_by_size(list(layer_sizes), chunks)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


STYLES = ("loop", "v")


def chunk_ids_of_rank(pp_rank: int, *, pp: int, virtual_stages: int = 1, style: str = "loop") -> list[int]:
    """The chunk (global stage) indices pipeline rank ``pp_rank`` owns, in execution order.

    Args:
        pp_rank: this rank's index in the pipeline group.
        pp: pipeline-parallel size.
        virtual_stages: chunks per rank.
        style: ``"loop"`` (chunk ``c`` on rank ``c % pp``: Megatron's interleaving) or ``"v"`` (the chunks go
            down the ranks and back up, so rank ``r`` holds ``r`` and ``2p-1-r``: zero-bubble ZBV's style).
    """
    if style not in STYLES:
        raise ConfigError(f"pipeline chunk style must be one of {', '.join(STYLES)}, got {style!r}")
    if style == "v":
        return [k * pp + (pp_rank if k % 2 == 0 else pp - 1 - pp_rank) for k in range(virtual_stages)]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def _numel(modules: dict[str, Any]) -> int:
    return sum(p.numel() for m in modules.values() for p in m.parameters())


def stage_ranges(
    model: torch.nn.Module,
    *,
    pp: int,
    virtual_stages: int = 1,
    balance: str = "layers",
    head: Any = "sequence_classification",
) -> list[range]:
    """The layer range of every chunk of ``model`` (``balance="parameters"``: the embedding counts towards the
    first layer and the head towards the last, with the parameters' logical sizes, so a ``meta`` model works).

    Args:
        model: a model of a family the registry splits (whole, possibly on ``meta``).
        pp: pipeline-parallel size.
        virtual_stages: chunks per rank.
        balance: ``"layers"`` or ``"parameters"``.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``) or its own
            :class:`~hftrain.parallel.heads.StageHead`; None: ``"sequence_classification"``.
    """
    from hftrain.parallel.families import stages_of

    model = hf_model_of(model)
    family = stages_of(model, head)
    layers = family.layers(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    sizes[0] += _numel(family.embed_modules(model))
    sizes[-1] += _numel(family.head_modules(model))
    return stage_layer_ranges(len(layers), pp=pp, virtual_stages=virtual_stages, balance=balance, layer_sizes=sizes)


def other_stages_modules(
    model: torch.nn.Module,
    ranges: list[range],
    *,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    style: str = "loop",
    head: Any = "sequence_classification",
) -> list[str]:
    """Dotted paths of the layers and embedding modules no chunk of ``pp_rank`` holds: what its build can leave
    unmaterialized. The head is not among them: it is small, and the whole model initialises it from the random
    stream, which every rank must advance alike (:func:`release_other_stages` frees it after the cut).

    Args:
        model: the whole model (on ``meta`` while it is built).
        ranges: :func:`stage_ranges`.
        pp_rank: this rank's index in the pipeline group.
        pp: pipeline-parallel size.
        virtual_stages: chunks per rank.
        style: ``"loop"`` or ``"v"`` (:func:`chunk_ids_of_rank`).
        head: the task's head kind (``hftrain.parallel.heads.HEADS``) or its own
            :class:`~hftrain.parallel.heads.StageHead`; None: ``"sequence_classification"``.
    """
    from hftrain.parallel.families import stages_of

    outer, model = model, hf_model_of(model)  # a PEFT model's paths carry its prefix
    family = stages_of(model, head)
    owned = chunk_ids_of_rank(pp_rank, pp=pp, virtual_stages=virtual_stages, style=style)
    kept = {i for c in owned for i in ranges[c]}
    layers = family.layers(model)
    kept_modules = {id(layers[i]) for i in kept}  # a layer module several layers run (ALBERT's group) is kept whole
    others = list({id(m): m for i, m in enumerate(layers) if i not in kept and id(m) not in kept_modules}.values())
    paths = {id(module): name for name, module in model.named_modules()}
    if 0 not in owned:
        # an embedding whose weight the head shares (tied input/output embeddings) is built where the head is
        tied = _tied_to_head(model, family, paths) if len(ranges) - 1 in owned else set()
        others += [m for m in family.embed_modules(model).values() if id(m) not in tied]
    outer_paths = {id(module): name for name, module in outer.named_modules()}
    return [outer_paths[id(module)] for module in others if any(True for _ in module.parameters())]


def _tied_to_head(model: torch.nn.Module, family: Any, paths: dict[int, str]) -> set[int]:
    """Ids of the embedding modules that share a weight with the head: the same parameter, or (a model on ``meta``
    before transformers ties its weights) a pair of ``all_tied_weights_keys``."""
    ties = dict(getattr(model, "all_tied_weights_keys", None) or {})
    ties.update({target: source for source, target in list(ties.items())})

    def names(module: torch.nn.Module) -> set[str]:
        return {f"{paths[id(module)]}.{name}" for name, _ in module.named_parameters()}

    heads = list(family.head_modules(model).values())
    head_ids = {id(p) for m in heads for p in m.parameters()}
    head_names = {ties[n] for m in heads for n in names(m) if n in ties}
    return {
        id(m)
        for m in family.embed_modules(model).values()
        if any(id(p) in head_ids for p in m.parameters()) or names(m) & head_names
    }


def build_stage_modules(
    model: torch.nn.Module,
    *,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    balance: str = "layers",
    style: str = "loop",
    ranges: list[range] | None = None,
    example_group: Any = None,
    head: Any = "sequence_classification",
) -> list[PipelineChunk]:
    """The chunks of ``model`` that pipeline rank ``pp_rank`` owns, in order; they share the model's modules.

    The first chunk embeds, the last ends in the task's head (:func:`~hftrain.parallel.families.stages_of`). The
    weights several pipeline ranks hold a copy of are recorded as such (:func:`place_stage_copies`).

    Args:
        model: a model of a family the registry splits, with its task's head (possibly already tensor-parallel).
        pp_rank: this rank's index in the pipeline group.
        pp: pipeline-parallel size.
        virtual_stages: chunks per rank (interleaved schedules).
        balance: ``"layers"`` or ``"parameters"`` (:func:`stage_ranges`).
        style: which chunks a rank holds, ``"loop"`` or ``"v"`` (the schedule's ``style``; see
            :func:`chunk_ids_of_rank`).
        ranges: the split, when it was decided before (on the whole model, before tensor parallelism split its
            layers); None computes it from ``model``.
        example_group: the ranks a micro-batch's examples are split over (dp): a mixture of experts' router loss
            is taken over them (:class:`~hftrain.parallel.expert_parallel.StageRouting`).
        head: the task's head kind (``hftrain.parallel.heads.HEADS``) or its own
            :class:`~hftrain.parallel.heads.StageHead` (the Trainer's ``stage_head``); None:
            ``"sequence_classification"``.
    """
    from hftrain.parallel.expert_parallel import StageRouting, moe_layer_indices
    from hftrain.parallel.families import expert_plan_for, stages_of
    from hftrain.parallel.stages import PipelineChunk

    hf_names = {id(p): name for name, p in model.named_parameters()}  # a PEFT model's names (its prefix)
    model = hf_model_of(model)  # the family's paths are the HF model's
    family = stages_of(model, head)
    layers = family.layers(model)
    experts = expert_plan_for(model.config)  # a mixture of experts: its router loss spans the stages
    moe_layers = [] if experts is None else moe_layer_indices(model, experts)
    embed, head_modules = family.embed_modules(model), family.head_modules(model)
    if ranges is None:
        ranges = stage_ranges(model, pp=pp, virtual_stages=virtual_stages, balance=balance, head=head)
    chunks = []
    for c in chunk_ids_of_rank(pp_rank, pp=pp, virtual_stages=virtual_stages, style=style):
        first, last = c == 0, c == len(ranges) - 1
        chunk = PipelineChunk(
            family,
            model.config,
            embed=embed if first else None,
            layers={str(i): layers[i] for i in ranges[c]},
            head=head_modules if last else None,
            aux=family.aux_modules(model),
        )
        chunk.attach_hf_names(hf_names)
        chunk.index = c  # its global stage index: schedules check it against their style
        chunk.context_split = getattr(model, "context_split", None)  # set by apply_context_parallel
        if experts is not None:
            chunk.routing = StageRouting(
                {i: layers[i] for i in ranges[c]}, moe_layers, experts, model.config, group=example_group
            )
        chunks.append(chunk)
    missing = [n for chunk in chunks for n, p in chunk.named_parameters() if p.device.type == "meta"]
    if missing:
        raise RuntimeError(f"pipeline rank {pp_rank}'s stages hold unbuilt (meta) parameters, e.g. {missing[0]}")
    place_stage_copies(model, family, ranges, pp_rank=pp_rank, pp=pp, virtual_stages=virtual_stages, style=style)
    return chunks


def place_stage_copies(
    model: torch.nn.Module,
    family: Any,
    ranges: list[range],
    *,
    pp_rank: int,
    pp: int,
    virtual_stages: int,
    style: str,
) -> None:
    """Record the weights that more than one pipeline rank holds a copy of (``Placement.copies``), each copy from the
    same initial values (every rank builds the same model); the copy on the rank holding the first chunk is the
    primary (counted in the gradient norm, written to checkpoints):

    - tied input/output embeddings, when the first chunk (the embedding) and the last (the output projection) are on
      different ranks: copies over Megatron's ``embedding`` group, the first and last stage of each pipeline (one
      rank holds both under the V style: one weight, nothing recorded);
    - the parameters of the modules every chunk reads (the family's ``aux_modules``: DeBERTa's relative embeddings),
      and of a layer module every rank's layers run (ALBERT's shared layer group): copies over the pipeline group. A
      layer module only some of the ranks run is refused (``AxisError``, pp): it would need a group of its own.

    ``hftrain.parallel.placement`` then sums their gradients, counts and writes them.

    Args:
        model: the model the chunks were cut from (its tie intact).
        family: its pipeline adapter (:func:`~hftrain.parallel.families.stages_of`).
        ranges: every chunk's layer range.
        pp_rank: this rank's index in the pipeline group.
        pp: pipeline-parallel size.
        virtual_stages: chunks per rank.
        style: ``"loop"`` or ``"v"``.
    """
    from hftrain.parallel.placement import place

    if pp == 1:
        return
    owner = {c: r for r in range(pp) for c in chunk_ids_of_rank(r, pp=pp, virtual_stages=virtual_stages, style=style)}
    primary = owner[0] == pp_rank
    copies = {id(p): "pp" for module in family.aux_modules(model).values() for p in module.parameters()}
    layers, runs = family.layers(model), {}  # a layer module -> the ranks whose chunks run it
    for chunk, layer_range in enumerate(ranges):
        for index in layer_range:
            runs.setdefault(id(layers[index]), (layers[index], set()))[1].add(owner[chunk])
    for module, ranks in runs.values():
        if 1 < len(ranks) < pp:
            raise AxisError("pp", f"a layer module is run by pipeline ranks {sorted(ranks)} of {pp} only; use pp 1")
        if len(ranks) == pp:
            copies |= {id(p): "pp" for p in module.parameters()}
    tied = tied_embedding(model)
    if tied is not None and owner[0] != owner[pp * virtual_stages - 1]:
        copies[id(tied)] = "embedding"
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in copies:
                place(module, name, copies=copies[id(param)], primary=primary)


def tied_embedding(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The weight a model's input embedding and output projection share (GPT-2's, SmolLM2's), else None."""
    model = hf_model_of(model)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is None or head is None or getattr(head, "weight", None) is not getattr(embed, "weight", 0):
        return None
    return head.weight


def release_other_stages(model: torch.nn.Module, stages: list[torch.nn.Module]) -> int:
    """Free the parameters of ``model`` that none of this rank's ``stages`` holds; returns how many elements went.

    Each is replaced by a parameter of the same shape and dtype on the ``meta`` device (no storage), so the model
    object keeps its structure and names (checkpoint state and the export filter by the stage's own names) while
    the other stages' weights leave this rank's memory at once. Buffers are kept: they are small, and every stage
    may read them (position ids, rotary frequencies).

    Args:
        model: the whole (tensor-parallel) model the stages were cut from.
        stages: this rank's chunks.
    """
    import torch

    kept = {id(p) for stage in stages for p in stage.parameters()}
    released = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in kept or param.device.type == "meta":
                continue
            released += param.numel()
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
            )
    return released


# ----------------------------------------------------------------- the axis's interface (hftrain.parallel.axis_ops)
def _check_model(config: Any, dims: Any, options: Any, head: str) -> None:
    """The family's trunk and head kind, and the same split the stages will use (balance "layers" needs no parameter
    sizes and applies the same checks)."""
    from hftrain.parallel.families import check_family

    if dims.pp > 1:
        check_family(config, head=head)
        stage_layer_ranges(config.num_hidden_layers, pp=dims.pp, virtual_stages=options["virtual_stages"])


def _check_family(config: Any, head: str | None) -> None:
    from hftrain.parallel.families import check_family

    check_family(config, head=head)


AXIS = AxisOps(  # the stages wrap the model (the runtime cuts them): no apply here
    options={"virtual_stages": 1},
    check_model=_check_model,
    check_family=_check_family,
    not_built={
        "compile": "pipeline stages run their blocks through torch.distributed.pipelining's schedules, which compile "
        "per block does not reach yet",
    },
)
"""Pipeline parallelism behind the axes' one interface."""
