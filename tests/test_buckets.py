"""Length buckets (``data.pad_to_multiple_of``) for every strategy; the SDPA kernel order (``training.sdpa_backend``).

- **Few shapes on CUDA, counted on CPU**: the default job's training epoch and evaluation, built as the trainer
  builds them (``EpochSampler`` over the global batch, ``SortedSampler``, ``build_dataloader``) with the bucket
  rule the CUDA platform chooses, yield at most 8 distinct batch shapes; with no buckets they yield dozens (the
  issue counted 55 lengths per epoch). The CUDA rule gives at most 8 lengths for any ``max_seq_length``.
- **The CPU rule** is the benchmark's (``benchmarks/length_buckets.py``): what ``auto`` resolves to on CPU.
- **Megatron's multiples combine** with the buckets (lcm): under tp=2 with sequence parallelism and buckets of 3,
  and under cp=2 with buckets of 6, the trainer's loaders (2 gloo processes, the real megatron plugin) yield lengths
  that are multiples of 6 and 12, or the top bucket (the longest text up to a multiple of tp or 2·cp), all of which
  the strategy can cut (before: a refusal).
- **Results unchanged**: one process, fp32, with buckets of 16 against none: every step's loss and the evaluation
  equal within 1e-5 (padding is masked), and the summary reports the padding.
- **The old field** ``parallelism.pad_to_multiple_of`` is refused in one line naming ``data.pad_to_multiple_of``.
- **SDPA order**: the config field, the platform's order per device, and the CUDA path's context manager run on CPU
  without changing a model's outputs, restoring torch's order on exit.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.tiny import tiny_config, tiny_tokenizer

CUDA_SHAPES_BOUND = 8


def _default_job_data():
    """The default job's tokenized splits and tokenizer (embedded MiniLM, Rotten Tomatoes, 128 tokens)."""
    import hftrain
    from hftrain.config import ModelConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.models import build_tokenizer

    tokenizer = build_tokenizer(ModelConfig())
    splits = hftrain.load_splits()  # the default job's, as its run sees them
    return tokenize_splits(splits, tokenizer, max_seq_length=128), tokenizer


def _shapes(device: str) -> tuple[set, set]:
    """Distinct (batch, length) shapes of the default job's training epoch and evaluation on ``device``'s rule."""
    from hftrain.config import DataConfig, TrainingConfig
    from hftrain.data.batching import EpochSampler, LengthBuckets, SortedSampler, build_dataloader, lengths_of
    from hftrain.strategies.platform import Platform

    tokenized, tokenizer = _default_job_data()
    data, training = DataConfig(), TrainingConfig()
    train, evaluation = tokenized["train"], tokenized["validation"]
    longest = max(lengths_of(train) + lengths_of(evaluation))
    platform = Platform(device=device, backend="nccl" if device == "cuda" else "gloo")
    multiple, rule = platform.resolve_length_buckets(data.pad_to_multiple_of, longest=longest)
    buckets = LengthBuckets.combine(multiple, None, longest=longest, rule=rule)
    sampler = EpochSampler(
        lengths_of(train),
        order=training.train_sampling_strategy,
        group_size=training.per_device_train_batch_size,
        seed=training.seed,
    )
    loaders = [
        build_dataloader(
            train, tokenizer, batch_size=training.per_device_train_batch_size, sampler=sampler, buckets=buckets
        ),
        build_dataloader(
            evaluation,
            tokenizer,
            batch_size=training.per_device_eval_batch_size,
            sampler=SortedSampler(lengths_of(evaluation)),
            buckets=buckets,
        ),
    ]
    train_shapes, eval_shapes = ({tuple(b["input_ids"].shape) for b in loader} for loader in loaders)
    return train_shapes, eval_shapes


def test_the_default_job_sees_at_most_8_shapes_under_the_cuda_rule():
    train, evaluation = _shapes("cuda")
    print(
        f"\ncuda rule: {len(train)} training shapes, {len(evaluation)} evaluation shapes: {sorted(train | evaluation)}"
    )
    assert len(train | evaluation) <= CUDA_SHAPES_BOUND
    # a multiple of 64, at most the longest review (78 tokens: the reviews are shorter than max_seq_length 128)
    assert len({length for _, length in train | evaluation}) == 2


def test_the_cpu_rule_is_the_benchmarks_choice():
    from hftrain.strategies.platform import CPU_AUTO_BUCKETS, Platform

    multiple, rule = Platform(device="cpu", backend="gloo").resolve_length_buckets("auto", longest=128)
    assert multiple == CPU_AUTO_BUCKETS
    assert "benchmarks/length_buckets.py" in rule
    # set in the config, or null: the same on every device
    for device in ("cpu", "cuda"):
        platform = Platform(device=device, backend="gloo")
        assert platform.resolve_length_buckets(16, longest=128) == (16, "set in data.pad_to_multiple_of")
        assert platform.resolve_length_buckets(None, longest=128)[0] is None


def test_without_buckets_the_default_job_sees_dozens_of_shapes():
    from hftrain.strategies.platform import CPU_AUTO_BUCKETS

    if CPU_AUTO_BUCKETS is not None:
        pytest.skip("the CPU rule buckets; the CUDA-rule test bounds the shapes")
    train, evaluation = _shapes("cpu")
    assert len(train | evaluation) > 4 * CUDA_SHAPES_BOUND


@pytest.mark.parametrize("longest", [16, 100, 128, 500, 512, 514, 1000, 2048, 4096, 8192, 131072])
def test_the_cuda_rule_gives_few_lengths_for_any_max_seq_length(longest):
    from hftrain.data.batching import LengthBuckets
    from hftrain.strategies.platform import Platform

    multiple, _ = Platform(device="cuda", backend="nccl").resolve_length_buckets("auto", longest=longest)
    assert multiple >= 64 and multiple & (multiple - 1) == 0  # a power of two ≥ 64
    buckets = LengthBuckets.combine(multiple, None, longest=longest, rule="")
    lengths = {buckets.padded(n) for n in range(1, longest + 1)}
    assert len(lengths) <= CUDA_SHAPES_BOUND
    assert max(lengths) == longest  # never past the longest text allowed (514 stays 514, not 576)
    assert all(buckets.padded(n) >= n for n in range(1, longest + 1))


def test_buckets_combine_with_the_strategys_multiple():
    from hftrain.data.batching import LengthBuckets

    assert LengthBuckets.combine(3, 2, longest=32, rule="").multiple == 6  # tp=2 under sequence parallelism
    assert LengthBuckets.combine(6, 4, longest=32, rule="").multiple == 12  # cp=2
    assert LengthBuckets.combine(None, 4, longest=30, rule="").multiple == 4
    capped = LengthBuckets.combine(64, 4, longest=130, rule="")
    assert (capped.padded(70), capped.padded(129)) == (128, 132)  # the ceiling is a multiple of 4 too
    assert LengthBuckets.combine(None, None, longest=30, rule="").multiple is None


# ----------------------------------------------------------------- megatron, 2 gloo processes
def _megatron_lengths(root: str) -> dict:
    """Sequence lengths of the trainer's training and evaluation batches under megatron layouts with buckets."""
    from transformers import AutoModelForSequenceClassification

    from hftrain.cli import launch_info_from_environ
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.test_pp_loss import task_splits
    from tests.tiny import _fresh_output_dir, fp32_args, reset_accelerate_state

    seen = {}
    for label, options, buckets in (
        ("sp", {"tp": 2, "sequence_parallel": True}, 3),
        ("cp", {"cp": 2}, 6),
    ):
        reset_accelerate_state()
        tokenizer = tiny_tokenizer("bert")
        splits = tokenize_splits(task_splits("single", 40), tokenizer, max_seq_length=32)
        trainer = SequenceClassificationTrainer(
            fp32_args(_fresh_output_dir(), per_device_train_batch_size=8, max_steps=2),
            strategy=strategy_from_options("megatron", options, launch=launch_info_from_environ()),
            model_init=lambda: AutoModelForSequenceClassification.from_config(tiny_config("bert")),
            tokenizer=tokenizer,
            train_dataset=splits["train"],
            eval_dataset=splits["validation"],
            pad_to_multiple_of=buckets,
        )
        seen[label] = {
            "train": sorted({b["input_ids"].shape[1] for b in trainer.train_loader}),
            "eval": sorted({b["input_ids"].shape[1] for b in trainer.eval_loader}),
            "line": trainer.buckets.describe(),
        }
    return seen


@pytest.mark.distributed
def test_megatron_multiples_combine_with_the_buckets(tmp_path):
    ranks = run_distributed(_megatron_lengths, nprocs=2, timeout=600, root=str(tmp_path))
    for seen in ranks:  # the texts have at most 20 tokens: the top bucket is 20, a multiple of tp=2 and of 2·cp=4
        for label, multiple, required in (("sp", 6, 2), ("cp", 12, 4)):
            lengths = set(seen[label]["train"] + seen[label]["eval"])
            assert lengths and all(n % required == 0 for n in lengths), (label, lengths)
            assert lengths <= {*range(multiple, 20, multiple), 20}, (label, lengths)
            assert f"multiple of {multiple}, at most 20" in seen[label]["line"]
            assert "lcm with the strategy's multiple" in seen[label]["line"]


# ----------------------------------------------------------------- results unchanged, one process
def _one_process_runs(root: str) -> dict:
    """The same tiny job with buckets of 16 and without (fp32, no dropout)."""
    from transformers import AutoModelForSequenceClassification

    from hftrain.cli import launch_info_from_environ
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.test_pp_loss import task_splits
    from tests.tiny import _fresh_output_dir, fp32_args, reset_accelerate_state

    runs = {}
    for label, buckets in (("buckets", 16), ("none", None)):
        reset_accelerate_state()
        tokenizer = tiny_tokenizer("bert")
        splits = tokenize_splits(task_splits("single", 64), tokenizer, max_seq_length=32)
        trainer = SequenceClassificationTrainer(
            fp32_args(_fresh_output_dir(), per_device_train_batch_size=8, max_steps=8),
            strategy=strategy_from_options("ddp", None, launch=launch_info_from_environ()),
            model_init=lambda: AutoModelForSequenceClassification.from_config(tiny_config("bert")),
            tokenizer=tokenizer,
            train_dataset=splits["train"],
            eval_dataset=splits["validation"],
            pad_to_multiple_of=buckets,
        )
        lengths = sorted({b["input_ids"].shape[1] for b in trainer.train_loader})
        result = trainer.fit()
        runs[label] = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "metrics": result.metrics,
            "lengths": lengths,
            "padding": result.throughput["train_padding_fraction"],
        }
        trainer.close()
    return runs


@pytest.mark.distributed
def test_buckets_leave_the_results_unchanged(tmp_path):
    from hftrain.trainers.throughput import padding_words

    (runs,) = run_distributed(_one_process_runs, nprocs=1, timeout=600, root=str(tmp_path))
    buckets, none = runs["buckets"], runs["none"]
    assert buckets["lengths"] == [16, 20] and len(none["lengths"]) > 4  # 16, then the longest text (20 tokens)
    assert len(buckets["losses"]) == len(none["losses"]) == 8
    assert buckets["losses"] == pytest.approx(none["losses"], rel=1e-5, abs=1e-6)
    assert buckets["metrics"] == pytest.approx(none["metrics"], rel=1e-5, abs=1e-6)
    assert buckets["padding"] > none["padding"] >= 0
    assert padding_words({"train_padding_fraction": buckets["padding"]}).startswith("padding ")


# ----------------------------------------------------------------- config
def test_the_old_field_is_refused_in_one_line_naming_the_new_one(tmp_path):
    from hftrain.config import load_config
    from hftrain.errors import ConfigError

    config = tmp_path / "job.yaml"
    config.write_text("parallelism:\n  pad_to_multiple_of: 8\n")
    with pytest.raises(ConfigError, match=r"data\.pad_to_multiple_of") as raised:
        load_config(config)
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"data\.pad_to_multiple_of"):
        load_config(None, ["--parallelism.pad_to_multiple_of", "8"])
    # the bare name is the new field
    assert load_config(None, ["--pad_to_multiple_of", "8"]).data.pad_to_multiple_of == 8


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", "auto"), ("null", None), ("64", 64)], ids=["auto", "null", "int"]
)
def test_the_bucket_field_takes_auto_null_or_a_multiple(value, expected):
    from hftrain.config import load_config

    assert load_config(None, ["--pad_to_multiple_of", value]).data.pad_to_multiple_of == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("0", "data.pad_to_multiple_of must be at least 1"), ("256", "more than data.max_seq_length=128")],
)
def test_bad_buckets_are_one_line(value, fragment):
    from hftrain.config import load_config
    from hftrain.errors import ConfigError

    with pytest.raises(ConfigError, match=fragment):
        load_config(None, ["--pad_to_multiple_of", value])


# ----------------------------------------------------------------- SDPA kernel order
def test_the_sdpa_backend_field():
    from hftrain.config import load_config
    from hftrain.errors import ConfigError

    assert load_config(None, []).training.sdpa_backend == "auto"
    assert load_config(None, ["--sdpa_backend", "cudnn"]).training.sdpa_backend == "cudnn"
    with pytest.raises(ConfigError, match="training.sdpa_backend"):
        load_config(None, ["--sdpa_backend", "fastest"])


def test_the_platform_orders_sdpa_kernels_on_cuda_only():
    from hftrain.strategies.platform import Platform

    cuda, cpu = Platform(device="cuda", backend="nccl"), Platform(device="cpu", backend="gloo")
    assert cuda.resolve_sdpa_backend("auto")[0] == ("flash", "efficient", "cudnn", "math")
    assert cuda.resolve_sdpa_backend("cudnn")[0] == ("cudnn", "flash", "efficient", "math")
    assert cuda.resolve_sdpa_backend("math")[0][0] == "math"
    order, why = cpu.resolve_sdpa_backend("flash")
    assert order == () and "CPU" in why
    with cpu.sdpa_priority("auto") as line:
        assert line.startswith("sdpa_backend: not applied")


def test_the_cuda_kernel_order_runs_on_cpu_without_changing_results():
    import torch
    from transformers import AutoModelForSequenceClassification

    from hftrain.strategies.platform import Platform

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("bert", dropout=0.0))
    ids = torch.randint(3, 60, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0

    def forward_backward():
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    reference = forward_backward()
    from torch.nn.attention import SDPBackend

    first = {
        "auto": SDPBackend.FLASH_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    before = torch._C._get_sdp_priority_order()
    for setting, backend in first.items():
        with Platform(device="cuda", backend="nccl").sdpa_priority(setting) as line:
            assert line.startswith("sdpa_backend: ")
            assert torch._C._get_sdp_priority_order()[0] == int(backend)  # the order is in force
            logits, grads = forward_backward()
        torch.testing.assert_close(logits, reference[0], rtol=0, atol=0)
        for grad, expected in zip(grads, reference[1], strict=True):
            torch.testing.assert_close(grad, expected, rtol=0, atol=0)
        assert torch._C._get_sdp_priority_order() == before  # restored


@pytest.mark.parametrize("longest", [16, 128, 512, 2048])
def test_under_compile_the_cpu_rule_gives_few_lengths_too(longest):
    """``training.compile`` makes every batch shape a graph on any device: ``auto`` on a CPU then buckets as CUDA
    does (each batch to its longest example had the default job stop at dynamo's recompile limit), and
    ``LengthBuckets.lengths`` counts what the run can see."""
    from hftrain.data.batching import LengthBuckets
    from hftrain.strategies.platform import Platform

    multiple, rule = Platform(device="cpu", backend="gloo").resolve_length_buckets(
        "auto", longest=longest, compiled=True
    )
    assert "training.compile" in rule and multiple >= 8
    buckets = LengthBuckets.combine(multiple, None, longest=longest, rule=rule)
    lengths = {buckets.padded(n) for n in range(1, longest + 1)}
    assert len(lengths) == buckets.lengths() <= CUDA_SHAPES_BOUND


def test_buckets_beyond_the_recompile_limit_are_refused_before_training():
    from hftrain.errors import ConfigError
    from hftrain.strategies.runtime import check_compiled_shapes

    check_compiled_shapes(16, 128)  # 16 lengths x 4 graphs: at the limit
    with pytest.raises(
        ConfigError, match=r"^training\.compile: data\.pad_to_multiple_of allows 128 batch lengths.*at least 8\)"
    ):
        check_compiled_shapes(128, 128)
