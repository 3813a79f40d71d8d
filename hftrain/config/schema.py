"""The job config's schema: one dataclass per config-file section, each field with a docstring, and validation.

Each section's ``validate()`` checks its own fields (ranges, and megatron-only options set under another strategy)
and raises a ``ConfigError`` naming the field and the fix; checks that need the model, the batch or the process
count are the strategy's. Loading, overrides and type coercion are in ``hftrain.config.loader``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from hftrain.errors import ConfigError
from hftrain.tasks import DEFAULT_TASK, task_of


@dataclass
class ModelConfig:
    """What model is fine-tuned."""

    model_name_or_path: str = "embedded:minilm"
    """A local model folder, or an embedded model (``embedded:minilm``, ``embedded:smollm2``)."""
    task: str = DEFAULT_TASK
    """What is fine-tuned, one of ``hftrain.tasks.TASKS``: ``sequence_classification``, a
    ``*ForSequenceClassification`` head on labelled texts (``problem_type`` says which kind), or ``causal_lm``, a
    ``*ForCausalLM`` language model on text packed into blocks of ``data.max_seq_length`` tokens (next-token cross
    entropy; prompt/response data trains on the responses only)."""
    num_labels: int = 2
    """Outputs of the sequence-classification head: the number of classes (``1`` for regression)."""
    problem_type: Literal["auto", "single_label_classification", "multi_label_classification", "regression"] = "auto"
    """The task, transformers' ``problem_type``: one class per text (cross entropy), several (BCE; the label column
    holds lists of class ids or multi-hot rows), or a number (MSE, ``num_labels: 1``). ``auto``: the model folder's
    ``config.json`` says, else the data (lists: multi-label; ``num_labels: 1``: regression; else single-label)."""
    trust_remote_code: bool = False
    """Run the Python code a model folder's ``config.json`` or ``tokenizer_config.json`` names in its ``auto_map``
    (transformers' ``trust_remote_code``). ``false``: a folder with an ``auto_map`` is refused in one line before
    transformers reads it (no prompt, no code run). Only for the folder in ``model_name_or_path`` that you wrote or
    checked yourself: a checkpoint, a run's saved config and ``hftrain convert``/``export`` never run model code,
    whatever this says."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers' attention kernel (its ``attn_implementation``). On CPU, eager measured no faster in the default
    job (length-grouped batches: 0.210 vs 0.201 s/step; random order: 2-4% faster), so sdpa stays the default."""

    def validate(self) -> None:
        task = task_of(self.task)
        _require(self.num_labels >= 1, "model.num_labels", "must be at least 1 (1: regression)")
        _require(
            self.num_labels <= MAX_NUM_LABELS,
            "model.num_labels",
            f"must be at most {MAX_NUM_LABELS:,}, got {self.num_labels:,}: the head holds hidden_size × num_labels "
            "weights, allocated before any label is read (model.num_labels is the number of classes)",
        )
        _require(
            task.takes_problem_type or self.problem_type == "auto",
            "model.problem_type",
            f"is a classification setting and model.task is {self.task}; remove model.problem_type",
        )
        if self.problem_type != "auto":
            from hftrain.data.labels import check_problem_type

            check_problem_type(self.problem_type, self.num_labels, "model.problem_type")


@dataclass
class DataConfig:
    """Where the labelled text comes from and how it is cut."""

    dataset_name: str | None = None
    """An embedded dataset (``embedded:rotten_tomatoes``, ``embedded:chinese_reviews``); the default
    when no ``train_file`` is given is ``embedded:rotten_tomatoes``."""
    train_file: str | None = None
    """A local CSV / JSON(L) / Parquet file with a text and an integer label column."""
    validation_file: str | None = None
    """Optional; without it ``validation_split_percentage`` of the training rows are held out."""
    text_column: str = "text"
    label_column: str = "label"
    prompt_column: str = "prompt"
    """``model.task: causal_lm``: a file with this column and ``response_column`` is prompt/response data, trained on
    the responses only; without them it is plain text (``text_column``)."""
    response_column: str = "response"
    validation_split_percentage: float = 10.0
    """Percent of training rows held out for validation (seeded, identical on every process)."""
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    max_seq_length: int = 128
    """Texts are truncated to this many tokens; batches are padded to their bucket (``pad_to_multiple_of``).
    ``model.task: causal_lm``: the length of the packed blocks."""
    pad_to_multiple_of: int | Literal["auto"] | None = "auto"
    """Length buckets, for every strategy, training and evaluation alike: each batch is padded to the next multiple
    of this (at most ``max_seq_length``), so batches come in a few shapes (padding is masked: the results do not
    change). ``auto`` chooses per device (``hftrain.strategies.platform``): on CUDA the smallest power of two ≥ 64
    giving at most 8 lengths (64 up to ``max_seq_length`` 512, so 2 lengths at 128; 256 at 2048), because every new
    shape costs cuDNN attention a new plan and ``torch.compile`` a recompile; on CPU none (each batch to its longest
    example), the fastest in the default job (median step 2.50 s against 3.40 s with a multiple of 8 and 3.62 s with
    64, on a 2-core machine under heavy load: benchmarks/README.md). null: no buckets. The megatron strategy's own
    multiple (``tp`` under sequence parallelism, ``2·cp`` under context parallelism) combines with it (their lcm).
    ``model.task: causal_lm``: blocks are already of one length; only the strategy's multiple applies."""
    long_documents: Literal["continue", "truncate"] = "continue"
    """``model.task: causal_lm``: a document longer than a block ``continue``s in the next blocks (its positions go on,
    each of its tokens is trained on once; transformers' ``group_texts``), or is ``truncate``d to its first block."""
    streaming: bool = False
    """``model.task: causal_lm``: read the training file as a stream (a ``datasets`` IterableDataset), packed on the
    fly and split over the data-parallel ranks, for a corpus larger than memory or disk; needs
    ``training.max_steps``. Its position is saved in every checkpoint, so a resume continues where it stopped. The
    validation split stays a fixed set."""
    cache_dir: str | None = None
    """Where tokenized and packed data is cached, keyed by the data files' content, the tokenizer and the packing
    rules (a second run, a resume and an export reuse it). Default: ``$HFTRAIN_CACHE``, else
    ``~/.cache/hftrain/data``."""
    overwrite_cache: bool = False
    """Tokenize again even when the cache holds this data (as run_clm's ``overwrite_cache``)."""
    preprocessing_num_workers: int | None = None
    """Processes that tokenize (``datasets.map``'s ``num_proc``); null: one per core for a large corpus, one for a
    small one."""

    def validate(self) -> None:
        _require(
            not (self.dataset_name and self.train_file),
            "data.dataset_name",
            "and data.train_file are both set; set one (dataset_name: null to use your files)",
        )
        if not self.train_file and not self.dataset_name:
            self.dataset_name = "embedded:rotten_tomatoes"
        _require(0 < self.validation_split_percentage < 100, "data.validation_split_percentage", "must be in (0, 100)")
        _require(self.max_seq_length > 0, "data.max_seq_length", "must be positive")
        buckets = self.pad_to_multiple_of
        _require(
            buckets is None or buckets == "auto" or buckets >= 1,
            "data.pad_to_multiple_of",
            "must be at least 1, auto (chosen per device) or null (no buckets)",
        )
        _require(
            self.max_seq_length <= MAX_SEQ_LENGTH,
            "data.max_seq_length",
            f"must be at most {MAX_SEQ_LENGTH:,} tokens, got {self.max_seq_length:,}: a causal LM packs blocks of "
            "this length in memory before any model limit applies; give the model's context length",
        )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"data.{name}", "must be positive or null")
        _require(
            self.preprocessing_num_workers is None or 1 <= self.preprocessing_num_workers <= MAX_WORKERS,
            "data.preprocessing_num_workers",
            f"must be between 1 and {MAX_WORKERS} or null (one per core for a large corpus)",
        )


MAX_SEQ_LENGTH = 2**21
"""``data.max_seq_length``'s bound: 2M tokens, beyond the longest context of the models hftrain trains (1M); a
causal LM's packed blocks are this long, built in memory before the model's own limit is known."""

MAX_NUM_LABELS = 2**20
"""``model.num_labels``' bound: a million classes (the largest extreme multi-label benchmarks have ~670k); the
head's ``hidden × num_labels`` weights are allocated before the labels are read (10⁹ asked for 1.5 TB)."""

MAX_LORA_R = 2**16
"""``lora.lora_r``'s bound before the model is known (the widest layers are ~2**16): each adapted layer allocates
``r × (in + out)`` weights; ``hftrain.models.lora`` then bounds it by the adapted layers' own sizes."""

MAX_WORKERS = 1024
"""``training.dataloader_num_workers``' and ``torch_num_threads``' bound: each worker is a process (each thread a
stack), started before the first batch."""

PEAK_TFLOPS_RANGE = (1e-3, 1e5)
"""``training.peak_tflops``'s plausible values: from 1 GFLOP/s (a single core without vector units) to 100,000
TFLOP/s (a hundred times an H100's dense bf16 989); outside them MFU is negative or absurd."""

MAX_VOCAB_MULTIPLE = 2**16
"""``parallelism.vocab_multiple``'s bound: Megatron pads to 128; the largest vocabularies are ~2**18 rows, so a larger
multiple only adds zero rows that every tensor-parallel rank stores and multiplies (1099511627776 asked the allocator
for 2**40 rows)."""


@dataclass
class TrainingConfig:
    """The training loop, with transformers' ``TrainingArguments`` names."""

    output_dir: str = "outputs/minilm-rotten-tomatoes"
    overwrite_output_dir: bool = False
    """Allow reusing an ``output_dir`` that holds a run with a different config."""
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 64
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    num_train_epochs: float = 1.0
    max_steps: int = -1
    """Optimizer steps to run; overrides ``num_train_epochs`` when positive."""
    warmup_steps: int | float = 0
    """Warmup optimizer steps (int), or a ratio of the total steps (float < 1), as in transformers 5."""
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
    ] = "linear"
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = 42
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """Accelerate's mixed precision. ``auto``: bf16 where the device computes it natively (a CUDA GPU with bf16, a
    CPU with AMX or AVX512-BF16), else ``no`` (fp32); the choice and its reason are logged. ``no`` pins fp32."""
    optim: Literal["auto", "adamw_torch_fused", "adamw_torch"] = "auto"
    """The AdamW implementation (transformers' names). ``auto``: ``adamw_torch_fused`` (one kernel per step, the
    transformers ``Trainer``'s default) wherever the strategy steps a torch optimizer, else what the strategy brings
    (DeepSpeed's CPU Adam under optimizer offload)."""
    dropout_kernel: Literal["auto", "torch", "bits"] = "auto"
    """How dropout masks are drawn in training. ``bits``: 64 random bits per draw (``hftrain.models.dropout``: torch's
    distribution with p rounded to a multiple of 2^-16, reproducible and resumable alike; faster on CPU: the
    default job's ablation is in benchmarks/README.md); ``torch``: torch's own dropout and SDPA's in-kernel attention
    dropout. ``auto``: ``bits`` on CPU, whose ``bernoulli_`` draws one element at a time, ``torch`` on GPU (fused
    kernels)."""
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    """Which of ``scaled_dot_product_attention``'s CUDA kernels is tried first (the others follow, for the shapes it
    cannot run). ``auto``: flash, memory-efficient, cuDNN, math, in that order: torch ≥ 2.11 would try cuDNN first on
    sm90, which builds a plan per exact shape. Logged at startup; ignored on CPU (SDPA's own CPU kernels)."""
    packed_attention: Literal["auto", "varlen", "mask"] = "auto"
    """``model.task: causal_lm``: how attention keeps packed documents apart. ``varlen``: each document alone
    (``hftrain.models.packed_attention``: torch's flash ``varlen_attn`` on CUDA, an exact reference on CPU);
    ``mask``: SDPA over the whole block with a block-diagonal causal mask. ``auto``: ``varlen`` on CUDA, ``mask`` on a
    CPU. A model varlen cannot take (attention dropout, soft-capping, non-SDPA or non-causal attention; fp32 on CUDA,
    flash being 16-bit only) keeps the mask, said in one startup line with the reason."""
    gradient_checkpointing: bool | Literal["full", "selective"] = False
    """Activation recomputation (``hftrain.parallel.recompute``): ``true``/``full`` keeps only each transformer layer's
    input and recomputes the layer in the backward pass; ``selective`` recomputes only the attention core (scores,
    softmax, dropout: the part that grows with the sequence squared); ``false`` keeps everything. Dropout masks are
    recomputed identically (torch's and the RNG tracker's streams are restored)."""
    compile: bool = False
    """``torch.compile`` each transformer block in place (``block.compile()``, as torchtitan compiles per block: one
    short compile shared by every block of one shape, parameter names unchanged), with ``dynamic=False``: one graph
    per batch shape, so bucket the lengths (fixed-length causal-LM blocks, ``max_seq_length`` padding). Runs under
    DDP, FSDP2, ZeRO-1/2/3 and megatron tp, with ``gradient_checkpointing`` selective or off; refused in one line
    where it cannot run (FSDP1, pp, cp, ep, full recomputation: ``hftrain.strategies.runtime``'s ``apply_compile``)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """``torch.compile``'s mode when ``compile`` is on: ``reduce-overhead`` replays CUDA graphs (CUDA only: refused on
    a CPU), ``max-autotune`` also searches matmul kernels (longer compiles)."""
    loss_chunk_tokens: int | Literal["auto"] | None = "auto"
    """``model.task: causal_lm``: the output projection and the cross entropy run over this many positions at a
    time, each chunk's logits recomputed in the backward, so no step holds the whole ``[tokens, vocabulary]`` logits
    (``hftrain.trainers.chunked_head``); null builds them whole. ``auto``: a power of two with about 2^22 logits per
    chunk on a CPU (64 positions at 49,152 vocabulary rows), 2^26 on a GPU (1,024; ``chunked_head.auto_chunk``). A
    family that changes its logits after the projection (soft-capping, scaling) builds them whole, said in one line."""
    peak_tflops: float | None = None
    """One process's peak TFLOP/s for MFU, between 0.001 (1 GFLOP/s) and 100,000 (a hundred times a 2024 GPU's
    dense bf16 peak); null measures a matmul at the start (CPU) or takes a known GPU's datasheet figure
    (``hftrain.trainers.throughput``)."""
    train_sampling_strategy: Literal["group_by_length", "random", "sequential"] = "group_by_length"
    """``group_by_length`` batches texts of similar length (less padding), shuffled per epoch."""
    logging_steps: int = 10
    eval_steps: int | None = None
    """Evaluate every N optimizer steps; null evaluates at the end of each epoch."""
    save_steps: int | None = None
    save_total_limit: int | None = None
    async_save: bool = True
    """Write checkpoints in the background: training goes on once each rank's state is copied to CPU memory (at
    most one save in flight; preemption and the end of the run wait for it)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype of the exported weights (``output_dir/model``): the fp32 master weights, cast one tensor at a time
    when ``bfloat16``/``float16`` (the reload check then allows that dtype's rounding)."""
    resume_from_checkpoint: str | None = None
    """``latest`` or ``auto`` (latest complete checkpoint in ``output_dir``, ``auto`` also when there is none),
    or a checkpoint folder."""
    trust_external_checkpoint: bool = False
    """Allow resuming from a checkpoint outside ``output_dir`` (its optimizer/RNG files are unpickled)."""
    log_with: list[str] | str | None = "tensorboard"
    """Accelerate's trackers the run logs to (``hftrain.metrics.trackers``): one name or a list of ``tensorboard``,
    ``wandb``, ``mlflow``, ``trackio``, ``comet_ml``, ``aim``, ``clearml``, ``dvclive``, ``swanlab``; ``all`` (every
    one installed here) or ``none``. Each gets the job config, every scalar at its global step, the pictures and the
    topology (docs/tracking.md); a named tracker whose package is missing is refused with its install command
    (``pip install 'hftrain[wandb]'``). TensorBoard writes to ``output_dir/runs``."""
    dataloader_num_workers: int = 0
    torch_num_threads: int | None = None
    """Intra-op CPU threads per process; null divides the machine's cores among the local processes."""

    def validate(self) -> None:
        from hftrain.metrics.trackers import requested

        requested(self.log_with)  # known names; whether their packages are installed here is the strategy's check
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
        ):
            _require(getattr(self, name) > 0, f"training.{name}", "must be positive")
        _require(self.learning_rate > 0, "training.learning_rate", "must be positive")
        _require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0 (0 disables weight decay)")
        # numpy's and Python's generators take seeds in [0, 2**32); Accelerate's set_seed seeds all of them.
        _require(0 <= self.seed < 2**32, "training.seed", "must be in [0, 4294967295]")
        _require(self.max_steps > 0 or self.num_train_epochs > 0, "training.num_train_epochs", "must be positive")
        _require(self.max_grad_norm >= 0, "training.max_grad_norm", "must be >= 0 (0 disables clipping)")
        _require(
            self.loss_chunk_tokens in (None, "auto") or self.loss_chunk_tokens > 0,
            "training.loss_chunk_tokens",
            "must be positive, or null to build the whole logits",
        )
        if isinstance(self.warmup_steps, float):
            _require(0 <= self.warmup_steps < 1, "training.warmup_steps", "as a float is a ratio in [0, 1)")
        _require(self.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
        _require(self.dataloader_num_workers >= 0, "training.dataloader_num_workers", "must be >= 0")
        for name in ("eval_steps", "save_steps", "save_total_limit", "torch_num_threads"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"training.{name}", "must be positive or null")
        for name in ("dataloader_num_workers", "torch_num_threads"):
            value = getattr(self, name)
            if value is not None and value > MAX_WORKERS:
                raise ConfigError(
                    f"training.{name} must be at most {MAX_WORKERS}, got {value:,}: each is a process or thread "
                    "started up front; give at most the machine's cores"
                )
        low, high = PEAK_TFLOPS_RANGE
        _require(
            self.peak_tflops is None or low <= self.peak_tflops <= high,
            "training.peak_tflops",
            f"{self.peak_tflops} is not a process's peak: give TFLOP/s between {low} and {high:,.0f} (MFU divides by "
            "it), or null to measure it (CPU) or take the GPU's datasheet figure",
        )


@dataclass
class StrategyConfig:
    """How the model is distributed; see ``hftrain.strategies``."""

    name: str | None = None
    """``ddp`` (also one process), ``fsdp``, ``zero1``, ``zero2``, ``zero3``, ``megatron``; null takes it from
    ``accelerate launch --config_file`` or uses ``ddp``."""
    fsdp_version: int = 2
    """FSDP only: 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``)."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """FSDP only: what is sharded (parameters+gradients+optimizer state, or gradients+optimizer state)."""
    offload_params: bool = False
    """FSDP and ZeRO-3: keep parameters in CPU memory."""
    offload_optimizer: bool = False
    """ZeRO-2/3: keep optimizer state (and the optimizer step) on the CPU (DeepSpeed's CPU Adam)."""
    deepspeed_config: str | None = None
    """ZeRO only: a DeepSpeed JSON (``"auto"`` values are filled by hftrain); null builds one from these fields."""
    shard_optimizer: bool = False
    """megatron only: ZeRO-1-style sharding of the optimizer state over the data-parallel ranks
    (``torch.distributed.optim.ZeroRedundancyOptimizer``)."""

    def validate(self) -> None:
        _require(self.fsdp_version in (1, 2), "strategy.fsdp_version", "must be 1 or 2")
        _require(
            self.name == "megatron" or not self.shard_optimizer,
            "strategy.shard_optimizer",
            f"is a megatron option but strategy.name is {self.name or 'unset'}; set strategy.name: megatron or drop "
            "it (zero1 shards the optimizer state under DeepSpeed)",
        )


@dataclass
class ParallelismConfig:
    """How the model itself is split: one size per parallel axis and each axis's options, consumed whole by
    ``hftrain.parallel.ParallelDims`` (the sizes) and the strategy that splits models (``strategy.name: megatron``).
    Every other strategy refuses a value here that is not the default. The fields were in ``strategy`` before;
    ``strategy.tp`` and the others are still read, as ``parallelism.tp``, with one deprecation line. An axis's
    option names its axis in its metadata (``field(metadata={"axis": "cp"})``). Length buckets are
    ``data.pad_to_multiple_of``, for every strategy."""

    tp: int = 1
    """Tensor-parallel size (ranks that split each layer); must divide the world size and the
    model's heads, hidden and intermediate sizes, and divide or be a multiple of its key/value heads (then
    replicated over ``tp / kv`` ranks). The vocabulary is padded to a multiple of ``tp × vocab_multiple``."""
    sequence_parallel: bool = field(default=False, metadata={"axis": "tp"})
    """Megatron sequence parallelism (norm/dropout regions split along the sequence, which is
    padded to a multiple of ``tp``)."""
    pp: int = 1
    """Pipeline-parallel size (stages); ``tp × pp`` must divide the world size."""
    num_microbatches: int | None = field(default=None, metadata={"axis": "pp"})
    """``pp > 1``: micro-batches each per-device batch is split into by the schedule; null uses ``pp``."""
    schedule: str = field(default="1f1b", metadata={"axis": "pp"})
    """``pp > 1``: the pipeline schedule, a name in ``hftrain.parallel.SCHEDULES`` (``gpipe``, ``1f1b``,
    ``interleaved_1f1b``, and the zero-bubble ones); checked with the batch by the strategy."""
    virtual_stages: int = field(default=1, metadata={"axis": "pp"})
    """``schedule: interleaved_1f1b``: model chunks per pipeline rank."""
    balance: Literal["layers", "parameters"] = field(default="layers", metadata={"axis": "pp"})
    """``pp > 1``: split the layers into stages of equal layer count or equal parameter count."""
    cp: int = 1
    """Context-parallel size (ranks that split every sequence; ``tp × cp × pp`` must divide the world
    size); sequences are padded to a multiple of ``2·cp`` and attention dropout must be 0."""
    cp_comm: Literal["ring", "all_to_all"] = field(default="ring", metadata={"axis": "cp"})
    """``cp > 1``: ring attention (key/value blocks passed around the cp ranks) or all-to-all
    (DeepSpeed-Ulysses: heads, and key/value heads, per tp rank must divide by ``cp``)."""
    vocab_multiple: int = field(default=1, metadata={"axis": "tp"})
    """The vocabulary-parallel embedding pads the vocabulary to a multiple of ``tp ×`` this many
    rows (Megatron's ``make-vocab-size-divisible-by``, e.g. 128 for aligned GPU matmuls), 1 to 65536
    (``MAX_VOCAB_MULTIPLE``); the zero padding rows never receive gradient and never reach a checkpoint's logical
    tensors or an export."""
    ep: int = 1
    """Expert-parallel size for mixture-of-experts models (Mixtral, Qwen2-MoE): the experts of every
    MoE layer are split over ``ep`` data-parallel ranks and tokens reach them by all-to-all; ``ep`` divides the
    data-parallel size and the number of experts (Megatron-LM's expert parallelism)."""
    moe_capacity_factor: float | None = field(default=None, metadata={"axis": "ep"})
    """Mixture-of-experts models: null routes every token to its experts (dropless, the model's own
    result); a number > 0 caps each expert at ``factor × tokens × top_k / experts`` tokens per rank and batch, drops
    the rest (they keep their residual) and logs how many were dropped."""

    def validate(self) -> None:
        from hftrain.parallel.axes import AXIS_SIZES

        for axis in (*AXIS_SIZES, "virtual_stages"):
            _require(getattr(self, axis) >= 1, f"parallelism.{axis}", "must be at least 1")
        micro = self.num_microbatches
        _require(micro is None or micro >= 1, "parallelism.num_microbatches", "must be at least 1 or null")
        factor = self.moe_capacity_factor
        _require(
            factor is None or factor > 0,
            "parallelism.moe_capacity_factor",
            f"must be a number > 0 (e.g. 1.25) or null for dropless routing, got {factor}",
        )
        _require(
            self.vocab_multiple >= 1,
            "parallelism.vocab_multiple",
            f"must be a positive integer, got {self.vocab_multiple} (1: pad the vocabulary to a multiple of tp only; "
            "Megatron uses 128)",
        )
        _require(
            self.vocab_multiple <= MAX_VOCAB_MULTIPLE,
            "parallelism.vocab_multiple",
            f"must be at most {MAX_VOCAB_MULTIPLE}, got {self.vocab_multiple}: the vocabulary is padded with zero "
            "rows to a multiple of tp × vocab_multiple, and a larger multiple only adds rows (Megatron uses 128)",
        )

    def options(self, axes: set[str] | frozenset[str]) -> dict[str, Any]:
        """The options of the given axes (each field names its axis in its metadata), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("axis") in axes}

    def named(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The named fields as keyword arguments: how the section reaches ``hftrain.parallel`` (which knows no
        config). Each axis's module names the fields it reads (``hftrain.parallel.axis_ops``,
        ``hftrain.strategies.megatron.plugin.axis_options``): a name that is not a field (a field renamed here)
        fails here, instead of an option silently dropped.

        Args:
            names: fields of this section.
        """
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = [name for name in names if name not in fields]
        if unknown:
            raise AttributeError(f"ParallelismConfig has no option {', '.join(unknown)}")
        return {name: getattr(self, name) for name in names}

    def changed(self) -> list[str]:
        """The fields set to something other than their default (what a strategy that splits no model refuses)."""
        default = ParallelismConfig()
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)]


REMOVED_KEYS = {
    "parallelism.pad_to_multiple_of": "parallelism.pad_to_multiple_of was removed: length buckets are "
    "data.pad_to_multiple_of, for every strategy (megatron's tp or 2·cp multiple combines with it); write "
    "data.pad_to_multiple_of",
    "strategy.pad_to_multiple_of": "strategy.pad_to_multiple_of was removed: length buckets are "
    "data.pad_to_multiple_of, for every strategy; write data.pad_to_multiple_of",
}
"""Keys that no longer exist -> the one-line refusal that names the field to write instead (``hftrain.config.loader``
raises it as a ``ConfigError``)."""

PIPELINE_FIELDS = ("pp", "num_microbatches", "schedule", "virtual_stages", "balance")
"""The ``parallelism`` fields of the pipeline axis."""


@dataclass
class LoraConfig:
    """Parameter-efficient fine-tuning with PEFT's LoRA; the classification head is trained and saved in full."""

    use_lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    """Module names to adapt; null uses PEFT's default for the architecture."""
    merge_lora_on_export: bool = False
    """Also write the adapter merged into a full model (``output_dir/model_merged``)."""

    def validate(self) -> None:
        _require(self.lora_r > 0, "lora.lora_r", "must be positive")
        _require(
            self.lora_r <= MAX_LORA_R,
            "lora.lora_r",
            f"must be at most {MAX_LORA_R:,}, got {self.lora_r:,}: each adapted layer allocates r × (in + out) "
            "weights, and a rank above min(in, out) adds no capacity; typical ranks are 4 to 64",
        )
        _require(self.lora_alpha > 0, "lora.lora_alpha", "must be positive")
        _require(0 <= self.lora_dropout < 1, "lora.lora_dropout", "must be in [0, 1)")


@dataclass
class TrainConfig:
    """The whole job: one field per config-file section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> TrainConfig:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        buckets, longest = self.data.pad_to_multiple_of, self.data.max_seq_length
        if isinstance(buckets, int) and buckets > longest:  # 10⁹ was a 23.5 GB batch before any check
            raise ConfigError(
                f"data.pad_to_multiple_of is {buckets:,}, more than data.max_seq_length={longest:,}: every "
                f"batch would be padded past the longest text to {buckets:,} tokens; give at most {longest:,} (e.g. "
                "64), auto or null"
            )
        packed = task_of(self.model.task).packed_text
        for name in ("long_documents", "streaming"):
            if getattr(self.data, name) != getattr(DataConfig, name) and not packed:
                raise ConfigError(
                    f"data.{name} is a language-model setting and model.task is {self.model.task}; remove it"
                )
        if self.data.streaming and self.training.max_steps <= 0:
            raise ConfigError(
                "data.streaming: a stream has no known length, so training.num_train_epochs cannot end it; set "
                "training.max_steps"
            )
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """``{"section.field": value}`` for trackers and comparisons."""
        return {f"{s}.{k}": v for s, values in self.to_dict().items() for k, v in values.items()}


# Fields that may differ between invocations of one run (resuming, extending, moving it): they do not change
# what is trained. Everything else (model, data, optimisation, strategy, LoRA) defines the run. The global batch
# (micro-batch x accumulation x processes) is checked against the checkpoint, where the process count is known.
RUN_INVARIANT_EXEMPT = frozenset(
    {
        "training.output_dir",  # a moved or copied run directory resumes where it now lives
        "training.max_steps",  # extending a finished or interrupted run
        "training.num_train_epochs",
        "training.logging_steps",
        "training.eval_steps",
        "training.save_steps",
        "training.save_total_limit",
        "training.async_save",
        "training.export_dtype",
        "training.log_with",
        "training.per_device_train_batch_size",
        "training.gradient_accumulation_steps",
        "training.per_device_eval_batch_size",
        "training.dataloader_num_workers",
        "training.resume_from_checkpoint",
        "training.overwrite_output_dir",
        "training.torch_num_threads",
        "training.trust_external_checkpoint",
        "training.compile",  # how the same steps run: a compiled run resumes eager and back (tests/test_compile.py)
        "training.compile_mode",
        "training.loss_chunk_tokens",  # the same loss in chunks (within fp32 rounding)
        "lora.merge_lora_on_export",
        "model.trust_remote_code",  # each command says it again: a saved config never grants it (config.loader)
        "data.cache_dir",  # where the same tokenized data is kept, not what it is
        "data.overwrite_cache",
        "data.preprocessing_num_workers",
    }
)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {message}")
