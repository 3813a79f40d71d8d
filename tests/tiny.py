"""Tiny models, a tokenizer and learnable synthetic data, built locally (no hub) for fast tests."""

from __future__ import annotations

import csv
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = [f"w{i}" for i in range(40)]
POSITIVE = set(WORDS[:20])


def tiny_tokenizer(kind: str = "bert"):
    """A word-level fast tokenizer over ``WORDS``; GPT-style has no pad token (as real GPT models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]"] if kind == "bert" else ["<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[1]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if kind == "bert":
        return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def tiny_config(
    kind: str = "bert",
    num_labels: int = 2,
    vocab_size: int = 64,
    dropout: float = 0.0,
    num_layers: int = 2,
    max_positions: int = 64,
):
    """A 2-layer config (``num_layers`` for pipelines); dropout is off by default (per-rank dropout masks cannot
    match a 1-process reference).

    ``kind`` is ``"bert"``, ``"gpt2"``, ``"llama"`` (grouped-query attention: 4 heads, 2 key/value heads), or a
    mixture-of-experts family: ``"mixtral"`` (4 experts, top-2) or ``"qwen2_moe"`` (4 experts, top-2, a shared
    expert, the second layer dense: ``mlp_only_layers``), both with ``router_aux_loss_coef`` 0.02.
    """
    from transformers import BertConfig, GPT2Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    if kind in FAMILY_KINDS:
        return family_config(kind, num_labels, vocab_size, dropout, num_layers, max_positions)
    if kind == "bert":
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=max_positions,
            num_labels=num_labels,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            classifier_dropout=dropout,
        )
    moe = {  # what the two mixture-of-experts families share
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "max_position_embeddings": max_positions,
        "num_labels": num_labels,
        "attention_dropout": dropout,
        "pad_token_id": 0,
    }
    if kind == "mixtral":
        return MixtralConfig(intermediate_size=48, num_local_experts=4, **moe)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=4,
            norm_topk_prob=False,
            mlp_only_layers=[1] if num_layers > 1 else [],
            **moe,
        )
    if kind == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=max_positions,
            num_labels=num_labels,
            attention_dropout=dropout,
            pad_token_id=0,
        )
    return GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=num_layers,
        n_head=2,
        n_positions=max_positions,
        num_labels=num_labels,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        summary_first_dropout=dropout,
        pad_token_id=0,
    )


FAMILY_KINDS = (
    "roberta", "xlm-roberta", "electra", "distilbert", "gpt_neox", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
    "gemma3_text", "phi3", "olmo2", "qwen3_moe", "modernbert", "deberta-v2", "albert",
)  # fmt: skip
"""The families beyond the first five (``family_config``), each with its special layers switched on."""


def family_config(kind: str, num_labels: int, vocab_size: int, dropout: float, num_layers: int, max_positions: int):
    """A tiny config of one of ``FAMILY_KINDS`` that keeps the family's special layers on: sliding windows of 4
    tokens (shorter than the test texts) where the family has them, soft-capped attention (Gemma-2), qk-norm
    (Qwen3, Gemma-3, OLMo-2), scaled embeddings (Gemma), fused qkv (GPT-NeoX, Phi-3, ModernBERT: with its fused GLU,
    alternating global and local attention and mean pooling), a factorised embedding
    (ELECTRA's 16 → 32 projection), grouped-query attention (4 heads, 2 key/value heads) in every decoder,
    DeBERTa-v3's disentangled relative attention (c2p and p2c over 8 log buckets, shared key projections, the
    relative embeddings layer-normed, no absolute positions), ALBERT's one layer group shared by every layer and its
    16 → 32 embedding projection.
    """
    from transformers import CONFIG_MAPPING

    if kind in ("roberta", "xlm-roberta", "electra"):
        extra = {"embedding_size": 16} if kind == "electra" else {}
        return CONFIG_MAPPING[kind](
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=max_positions + 2, num_labels=num_labels, pad_token_id=1,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, classifier_dropout=dropout, **extra,
        )  # fmt: skip
    if kind == "modernbert":  # global then local (4-token window) attention, mean pooling, biased fused qkv and GLU
        special = dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"), 0)
        return CONFIG_MAPPING[kind](
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=max_positions, num_labels=num_labels,
            global_attn_every_n_layers=2, local_attention=4, classifier_pooling="mean", attention_bias=True,
            mlp_bias=True, attention_dropout=dropout, embedding_dropout=dropout, mlp_dropout=dropout,
            classifier_dropout=dropout, **special,
        )  # fmt: skip
    if kind == "deberta-v2":  # DeBERTa-v3's relative attention: log-bucketed positions (8 buckets, texts of 16)
        return CONFIG_MAPPING[kind](
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=max_positions, num_labels=num_labels, pad_token_id=0,
            relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
            max_relative_positions=max_positions, share_att_key=True, position_biased_input=False,
            norm_rel_ebd="layer_norm", type_vocab_size=0, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout, pooler_dropout=dropout,
        )  # fmt: skip
    if kind == "albert":  # one layer group run by every layer, its 16-wide embedding projected to 32
        return CONFIG_MAPPING[kind](
            vocab_size=vocab_size, embedding_size=16, hidden_size=32, num_hidden_layers=num_layers,
            num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_positions, num_labels=num_labels,
            pad_token_id=0, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
            classifier_dropout_prob=dropout,
        )  # fmt: skip
    if kind == "distilbert":
        return CONFIG_MAPPING[kind](
            vocab_size=vocab_size, dim=32, n_layers=num_layers, n_heads=2, hidden_dim=64,
            max_position_embeddings=max_positions, num_labels=num_labels, dropout=dropout, attention_dropout=dropout,
            seq_classif_dropout=dropout, pad_token_id=0,
        )  # fmt: skip
    decoder = {
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": max_positions,
        "num_labels": num_labels, "attention_dropout": dropout, "pad_token_id": 0, "bos_token_id": 2,
        "eos_token_id": 2,
    }  # fmt: skip
    sliding = {"sliding_window": 4}
    extra: dict = {
        "mistral": sliding,
        "qwen2": {**sliding, "use_sliding_window": True, "max_window_layers": 1},
        "qwen3": {**sliding, "use_sliding_window": True, "max_window_layers": 1},
        "gemma": {},
        "gemma2": {**sliding, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
        "gemma3_text": {**sliding, "sliding_window_pattern": 2},
        "phi3": {**sliding, "resid_pdrop": dropout, "embd_pdrop": dropout},
        # OLMo-2 normalises q and k over their width: at the default init (0.02) a tiny model's q is ~2e-3 and 1/√v
        # scales fp32 rounding 400-fold; real sizes are far from that, and so is init 0.2
        "olmo2": {"initializer_range": 0.2},
        "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                      "router_aux_loss_coef": 0.02, "norm_topk_prob": True},
        "gpt_neox": {"rotary_pct": 0.5, "hidden_dropout": dropout, "use_parallel_residual": True},
    }[kind]  # fmt: skip
    if kind == "gpt_neox":
        decoder = {k: v for k, v in decoder.items() if k not in ("num_key_value_heads", "head_dim")}
    config = CONFIG_MAPPING[kind](**decoder, **extra)
    if kind == "gemma2":
        config._attn_implementation = "eager"  # soft-capping runs in eager attention only (as transformers says)
    return config


def tiny_model_init(
    kind: str = "bert",
    num_labels: int = 2,
    dropout: float = 0.0,
    lora_options: dict | None = None,
    num_layers: int = 2,
    max_positions: int = 64,
    config_overrides: dict | None = None,
):
    """A ``model_init`` for the trainer: a fresh tiny ``*ForSequenceClassification``, in LoRA adapters when
    ``lora_options`` (``hftrain.config.LoraConfig`` fields) is given; ``config_overrides`` set config fields
    (e.g. ``num_attention_heads``)."""

    def build():
        from transformers import AutoModelForSequenceClassification

        config = tiny_config(kind, num_labels, dropout=dropout, num_layers=num_layers, max_positions=max_positions)
        config.update(config_overrides or {})
        model = AutoModelForSequenceClassification.from_config(config)
        if lora_options is None:
            return model
        from hftrain.config import LoraConfig
        from hftrain.models.lora import apply_lora

        return apply_lora(model, LoraConfig(use_lora=True, **lora_options))

    return build


def synthetic_texts(n: int, seed: int = 0, words: tuple[int, int] = (3, 20)) -> tuple[list[str], list[int]]:
    """Texts of 3..20 words (``words``); label 1 when most words are 'positive' ones: learnable, varied lengths."""
    rng = random.Random(seed)
    texts, labels = [], []
    low, high = words
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
        texts.append(" ".join(words))
        labels.append(int(sum(w in POSITIVE for w in words) * 2 > len(words)))
    return texts, labels


def save_model_folder(path: Path, **config_changes) -> Path:
    """A tiny BERT classifier saved with its tokenizer, as a user's model folder."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("bert")
    for key, value in config_changes.items():
        setattr(config, key, value)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tiny_tokenizer("bert").save_pretrained(path)
    return path


def write_csv(path: Path, rows: int = 60) -> Path:
    """``rows`` synthetic labelled texts (seed 0) as a CSV file with columns ``text,label``."""
    texts, labels = synthetic_texts(rows)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows(zip(texts, labels, strict=True))
    return path


TASK_LABELS = {"single_label_classification": 2, "multi_label_classification": 3, "regression": 1}
"""``num_labels`` of each task's synthetic labels (``task_labels``)."""


def task_labels(texts: list[str], problem_type: str) -> tuple[list, object]:
    """Learnable labels of ``texts`` for a task, and their ``datasets`` feature: single-label (most words positive),
    multi-label (most words positive; 'w0' present; more than 10 words) or regression (the share of positive
    words)."""
    import datasets

    shares = [sum(w in POSITIVE for w in text.split()) / len(text.split()) for text in texts]
    if problem_type == "regression":
        return shares, datasets.Value("float32")
    if problem_type == "multi_label_classification":
        rows = [[float(share > 0.5), float("w0" in t.split()), float(len(t.split()) > 10)] for t, share in
                zip(texts, shares, strict=True)]  # fmt: skip
        return rows, datasets.Sequence(datasets.Value("float32"), length=3)
    return [int(share > 0.5) for share in shares], datasets.Value("int64")


def tiny_splits(
    n_train: int = 96,
    n_eval: int = 25,
    seed: int = 0,
    words: tuple[int, int] = (3, 20),
    problem_type: str = "single_label_classification",
):
    """A DatasetDict with ``train``/``validation`` splits of synthetic text, labelled for ``problem_type``."""
    from datasets import Dataset, DatasetDict, Features, Value

    texts, _ = synthetic_texts(n_train + n_eval, seed, words)
    labels, feature = task_labels(texts, problem_type)
    features = Features({"text": Value("string"), "label": feature})
    return DatasetDict(
        train=Dataset.from_dict({"text": texts[:n_train], "label": labels[:n_train]}, features=features),
        validation=Dataset.from_dict({"text": texts[n_train:], "label": labels[n_train:]}, features=features),
    )


_RUNS = iter(range(10**6))


def _fresh_output_dir() -> str:
    """A new folder per call, the same on every rank of a launch (named by its rendezvous port)."""
    import os
    import tempfile

    return os.path.join(
        tempfile.gettempdir(), f"hftrain-test-{os.environ.get('MASTER_PORT', os.getpid())}-{next(_RUNS)}"
    )


def reset_accelerate_state() -> None:
    """Forget the Accelerate singletons (the process group stays) so a process can build another Accelerator."""
    import os

    from accelerate.state import AcceleratorState, GradientState

    # Accelerate exports these when it builds a DeepSpeed/FSDP state; a later run in this process would inherit them.
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        os.environ.pop(key, None)

    AcceleratorState._reset_state(reset_partial_state=True)  # the process group itself stays up
    GradientState._reset_state()
    # A ZeRO-3 run leaves transformers pointing at its DeepSpeed config: the next model would build in zero.Init.
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def fp32_args(output_dir: str, **changes):
    """The ``training`` section of a short exact run: fp32, a log line per step, no tracker, evaluation batches of 5,
    ``learning_rate`` 1e-3 (``changes`` override any field)."""
    from hftrain.config import TrainingConfig

    fields = {"per_device_eval_batch_size": 5, "learning_rate": 1e-3, "logging_steps": 1, "log_with": "none"}
    return TrainingConfig(output_dir=output_dir, mixed_precision="no", **{**fields, **changes})


def tiny_classifier_trainer(
    args, *, strategy: str = "ddp", kind: str = "bert", trainer_class: Any = None, n_train: int = 96, n_eval: int = 25
):
    """A ``SequenceClassificationTrainer`` (or ``trainer_class``) of a tiny ``kind`` model over tokenized tiny splits
    (at most 32 tokens), under ``strategy`` in this process group, not yet fitted."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer(kind)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(n_train, n_eval), tokenizer, max_seq_length=32)
    return (trainer_class or SequenceClassificationTrainer)(
        args,
        strategy=strategy_from_options(strategy, None, launch=launch_info_from_environ()),
        model_init=tiny_model_init(kind),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )


def fit_in_rank(trainer_class, args, strategy: str, options: dict | None, model_init, tokenizer, splits):
    """A ``trainer_class`` over ``splits`` under ``strategy`` (its ``options`` in the strategy section), fitted in
    this launched rank: ``(trainer, result)``."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.strategies import strategy_from_options

    trainer = trainer_class(
        args,
        strategy=strategy_from_options(strategy, options, launch=launch_info_from_environ()),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )
    return trainer, trainer.fit()


def counting_documents(n: int, seed: int) -> list[dict]:
    """Language-model rows: documents counting up through ``WORDS`` from a random start, 2 to 14 words (uneven targets
    per packed block)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, length = rng.randrange(len(WORDS)), rng.randint(2, 14)
        rows.append({"text": " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))})
    return rows


def tagged_rows(n: int, seed: int, *, longest: int = 12) -> list[dict]:
    """Token-classification rows of 3 to ``longest`` words; a run of 'positive' words is one POS entity (B-POS, then
    I-POS), the rest O."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, longest))]
        tags = [("I-POS" if i and words[i - 1] in POSITIVE else "B-POS") if w in POSITIVE else "O"
                for i, w in enumerate(words)]  # fmt: skip
        rows.append({"tokens": words, "tags": tags})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """``rows`` as JSON Lines at ``path``; the path as a string."""
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def moe_lm_job(root: Path) -> dict[str, str]:
    """A tiny Mixtral causal LM (its EOS the padding) with a word-level tokenizer in ``root / "lm"``, and its data:
    ``root``, ``train`` and ``validation`` (JSON Lines of :func:`counting_documents`)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer("gpt2")
    config = tiny_config("mixtral", max_positions=128)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    return {
        "root": str(root),
        "train": write_jsonl(root / "train.jsonl", counting_documents(120, seed=0)),
        "validation": write_jsonl(root / "validation.jsonl", counting_documents(20, seed=1)),
    }


def train_job(config, *, stop_at_step: int | None = None) -> tuple[Any, dict]:
    """A job config trained in this process group as ``hftrain.job.run_training`` runs it (validation, data cache,
    trainer, the verified export beside the last checkpoint into ``<output_dir>/model``): the trainer, and the run's
    losses, final metrics, global step, export folder and exported weights (None for a stopped run or where this
    process wrote none). The trainer is not closed: closing ends the process group, which a launch's next job still
    needs."""
    import torch
    from safetensors.torch import load_file

    from hftrain.cli import launch_info_from_environ
    from hftrain.job import export_model, prepare_job

    reset_accelerate_state()
    trainer, tokenizer, tokenized = prepare_job(config, launch_info_from_environ())
    folder = Path(config.training.output_dir) / "model"
    result = trainer.fit(
        stop_at_step=stop_at_step,
        beside_last_save=lambda: export_model(
            trainer, tokenizer, tokenized, folder, config, before_publish=trainer.wait_for_checkpoint
        ),
    )
    trainer.wait_for_checkpoint()
    trainer.release_folder()
    if torch.distributed.is_initialized():
        # the main process released the folder's lock before any rank starts a next job in it: that job's first
        # check (validate's run_folder_lock(...).check_free()) ran on another rank before this release, and was
        # refused, when the ranks came out of fit at different moments
        torch.distributed.barrier()
    weights = folder / "model.safetensors"
    return trainer, {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "metrics": result.metrics,
        "global_step": trainer.state.global_step,
        "model_dir": str(folder),
        "weights": load_file(weights) if weights.is_file() and stop_at_step is None else None,
    }


def run_tiny_training(
    *,
    kind: str = "bert",
    strategy: str = "ddp",
    micro: int = 4,
    gas: int = 1,
    steps: int = 10,
    order: str = "group_by_length",
    n_train: int = 96,
    n_eval: int = 25,
    output_dir: str | None = None,
    strategy_options: dict | None = None,
    stop_at_step: int | None = None,
    return_weights: bool = False,
    dropout: float = 0.0,
    lora_options: dict | None = None,
    num_layers: int = 2,
    words: tuple[int, int] = (3, 20),
    max_seq_length: int = 32,
    config_overrides: dict | None = None,
    inspect: Callable[[Any], Any] | None = None,
    problem_type: str = "single_label_classification",
    **training_overrides,
) -> dict:
    """Train a tiny model in this process group; returns losses, learning rates and final eval metrics.

    ``output_dir`` defaults to a fresh folder that every rank of this launch agrees on. ``lora_options``
    (``hftrain.config.LoraConfig`` fields) trains LoRA adapters and the head instead of the full model;
    ``config_overrides`` change the tiny model's config. ``inspect(trainer)``, called on every rank after training,
    adds what it returns as ``"inspected"``. ``problem_type`` picks the task (``TASK_LABELS``): its labels, its
    ``num_labels`` and the model config's ``problem_type``.
    """
    import torch

    from hftrain.cli import launch_info_from_environ
    from hftrain.config import TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer

    reset_accelerate_state()
    # Parity against a 1-process reference is checked in fp32 (bf16 is 'auto''s choice on CPUs that have it).
    training_overrides.setdefault("mixed_precision", "no")
    output_dir = output_dir or _fresh_output_dir()
    tokenizer = tiny_tokenizer(kind)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    splits = tiny_splits(n_train, n_eval, words=words, problem_type=problem_type)
    splits = tokenize_splits(splits, tokenizer, max_seq_length=max_seq_length)
    if problem_type != "single_label_classification":
        config_overrides = {"problem_type": problem_type, **(config_overrides or {})}
    args = TrainingConfig(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=5,
        gradient_accumulation_steps=gas,
        max_steps=steps,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        log_with="none",
        train_sampling_strategy=order,
        **training_overrides,
    )
    trainer = SequenceClassificationTrainer(
        args,
        strategy=strategy_from_options(strategy, strategy_options, launch=launch_info_from_environ()),
        model_init=tiny_model_init(
            kind,
            num_labels=TASK_LABELS[problem_type],
            dropout=dropout,
            lora_options=lora_options,
            num_layers=num_layers,
            max_positions=max_seq_length * 2,
            config_overrides=config_overrides,
        ),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )
    result = trainer.fit(stop_at_step=stop_at_step)
    history = trainer.state.log_history
    weights = None
    if return_weights:
        # collective; ZeRO-3 returns the gathered dict on rank 0 only (None elsewhere)
        state_dict = trainer.runtime.get_state_dict(trainer.model) or {}
        weights = {k: v.detach().clone() for k, v in state_dict.items()}
    return {
        "weights": weights if trainer.accelerator.is_main_process else None,
        "checkpoint": result.checkpoint,
        "preempted": result.preempted,
        "global_step": result.global_step,
        "losses": [h["loss"] for h in history if "loss" in h],
        "lrs": [h["learning_rate"] for h in history if "loss" in h],
        "metrics": result.metrics,
        "samples_seen": trainer.state.samples_seen,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "threads": torch.get_num_threads(),
        "inspected": inspect(trainer) if inspect is not None else None,
    }
