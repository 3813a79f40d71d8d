"""Token classification (``model.task: token_classification``): words labelled one by one, through the whole job.

Three launches of the real job (``hftrain.job``: the task record, the JSON Lines reader, the data cache, the trainer,
the verified export). One process: the reference (micro-batch 4 × accumulation 2), a LoRA run and a tiny Llama's
reference. Two processes: DDP, ZeRO-3 and FSDP2 (micro-batch 2 × accumulation 2 × 2 replicas, the same global batch of
8), and a DDP run stopped after step 2 and resumed. Four processes: megatron's tp2 with sequence parallelism, pp2, cp2
and tp2 × pp2 (the same global batch), a pp2 run stopped after step 2 and resumed, and the Llama
(``LlamaForTokenClassification``) at tp2 with sequence parallelism, cp2 and tp2 × pp2. Each equals its reference
within 1e-5 (fp32): the loss of every step (one mean over the global batch's labelled words, whatever the split), the
final evaluation (loss, entity F1, accuracy) and the exported weights. The tokenizer splits some words into two
sub-tokens, so the label alignment (first sub-token labelled, the rest and the special tokens -100) is what the losses
count.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hftrain.cli import main
from hftrain.tasks import Inputs as _Inputs
from tests.distributed import run_distributed
from tests.tiny import POSITIVE, WORDS, reset_accelerate_state, tiny_config

STEPS = 6
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
LABELS = ["B-POS", "I-POS", "O"]  # sorted, as the reader orders label names


def _tokenizer():
    """A WordPiece tokenizer over ``WORDS`` and the suffix ``##s``: ``w3s`` is two sub-tokens, ``[CLS] ... [SEP]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *WORDS, "##s"])}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def _sentences(n: int, seed: int) -> list[dict]:
    """``n`` rows of 3..12 words; a run of 'positive' words is one POS entity (B-POS, then I-POS), the rest O; a
    third of the words carry the suffix ``s`` (two sub-tokens)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        tags, previous = [], False
        for word in words:
            positive = word in POSITIVE
            tags.append(("I-POS" if previous else "B-POS") if positive else "O")
            previous = positive
        rows.append({"tokens": [w + "s" if rng.random() < 0.33 else w for w in words], "tags": tags})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, str]:
    """Base BERT and Llama model folders (no head: the token head is initialised, as from a pretrained trunk) and the
    data."""
    from transformers import BertModel, LlamaModel

    root = tmp_path_factory.mktemp("token")
    model, llama = root / "model", root / "llama"
    BertModel(tiny_config("bert", vocab_size=64)).save_pretrained(model)
    llama_config = tiny_config("llama", vocab_size=64)
    llama_config.classifier_dropout = 0.0  # LlamaForTokenClassification (`score`) would default to 0.1
    LlamaModel(llama_config).save_pretrained(llama)
    for folder in (model, llama):
        _tokenizer().save_pretrained(folder)
    return {
        "model": str(model),
        "llama": str(llama),
        "train": str(_write_jsonl(root / "train.jsonl", _sentences(64, seed=1))),
        "validation": str(_write_jsonl(root / "validation.jsonl", _sentences(13, seed=2))),
        "root": str(root),
    }


def _config(job: dict[str, str], run: str, *, micro: int, model: str = "model", **fields):
    from hftrain.api import make_config

    return make_config(
        model_name_or_path=job[model], task="token_classification", dataset_name=None, train_file=job["train"],
        validation_file=job["validation"], max_seq_length=32, cache_dir=str(Path(job["root"]) / "cache"),
        output_dir=str(Path(job["root"]) / run), max_steps=STEPS, per_device_train_batch_size=micro,
        gradient_accumulation_steps=2, per_device_eval_batch_size=3, learning_rate=3e-3, warmup_steps=1,
        logging_steps=1, log_with="none", mixed_precision="no", save_steps=2, **fields,
    )  # fmt: skip


def _train(config, *, stop_at_step: int | None = None) -> dict:
    """The job trained as ``hftrain.job.run_training`` runs it (``tests.tiny.train_job``): its losses, final metrics
    and exported weights (main process)."""
    from tests.tiny import train_job

    return train_job(config, stop_at_step=stop_at_step)[1]


def _one_process(job: dict[str, str]) -> dict:
    return {
        "reference": _train(_config(job, "reference", micro=4)),
        "lora": _train(_config(job, "lora", micro=4, use_lora=True, lora_r=4)),
        "llama": _train(_config(job, "llama_reference", micro=4, model="llama")),
    }


def _two_processes(job: dict[str, str]) -> dict:
    runs = {name: _train(_config(job, name, micro=2, name=name)) for name in ("ddp", "zero3", "fsdp")}
    _train(_config(job, "resumed", micro=2, name="ddp"), stop_at_step=2)
    runs["resumed"] = _train(_config(job, "resumed", micro=2, name="ddp", resume_from_checkpoint="latest"))
    return runs


MEGATRON = {  # 4 processes, each the reference's global batch of 8: name -> (micro-batch, parallelism)
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),  # dp 2
    "pp2": (2, {"pp": 2, "num_microbatches": 2}),  # dp 2
    "cp2": (2, {"cp": 2}),  # dp 2
    "tp2_pp2": (4, {"tp": 2, "pp": 2, "num_microbatches": 2}),  # dp 1
}


LLAMA = ("tp2_sp", "cp2", "tp2_pp2")  # the layouts a tiny LlamaForTokenClassification also takes


def _four_processes(job: dict[str, str]) -> dict:
    """Megatron's layouts of the token classifier, and the pipeline's run stopped after step 2 and resumed."""
    runs = {}
    for name, (micro, options) in MEGATRON.items():
        runs[name] = _train(_config(job, name, micro=micro, name="megatron", **options))
    micro, options = MEGATRON["pp2"]
    _train(_config(job, "pp2_resumed", micro=micro, name="megatron", **options), stop_at_step=2)
    resumed = _config(job, "pp2_resumed", micro=micro, name="megatron", resume_from_checkpoint="latest", **options)
    runs["pp2_resumed"] = _train(resumed)
    for name in LLAMA:
        micro, options = MEGATRON[name]
        runs[f"llama_{name}"] = _train(
            _config(job, f"llama_{name}", micro=micro, model="llama", name="megatron", **options)
        )
    return runs


@pytest.fixture(scope="module")
def one(job) -> dict:
    (only,) = run_distributed(_one_process, nprocs=1, timeout=600, job=job)
    return only


@pytest.fixture(scope="module")
def runs(job, one) -> dict:
    return {"one": one, "two": run_distributed(_two_processes, nprocs=2, timeout=900, job=job)}


@pytest.fixture(scope="module")
def megatron(job) -> list[dict]:
    return run_distributed(_four_processes, nprocs=4, timeout=1500, job=job)


def _assert_equal(run: dict, ref: dict) -> None:
    import torch

    assert len(run["losses"]) == len(ref["losses"]) == STEPS
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert run["metrics"]["eval_samples"] == ref["metrics"]["eval_samples"] == 13  # each example once
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    assert set(run["weights"]) == set(ref["weights"])
    for name, tensor in ref["weights"].items():
        torch.testing.assert_close(run["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp", "resumed"])
def test_two_processes_equal_one(runs, strategy):
    ref = runs["one"]["reference"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the loss moved
    assert {"eval_loss", "eval_f1", "eval_precision", "eval_recall", "eval_accuracy"} <= set(ref["metrics"])
    _assert_equal(runs["two"][0][strategy], ref)


@pytest.mark.distributed
def test_megatron_layouts_equal_one_process(one, megatron):
    """BERT at tp2 with sequence parallelism, pp2, cp2 and tp2 × pp2 (4 gloo processes each), pp2 resumed after step 2,
    and Llama at tp2 with sequence parallelism, cp2 and tp2 × pp2: every step's loss on every rank, the final
    evaluation and the exported weights equal one process's within 1e-5; each export reloads into
    ``AutoModelForTokenClassification``."""
    from transformers import AutoModelForTokenClassification

    bert = [(name, one["reference"], "BertForTokenClassification") for name in [*MEGATRON, "pp2_resumed"]]
    llama = [(f"llama_{name}", one["llama"], "LlamaForTokenClassification") for name in LLAMA]
    for name, ref, model_class in bert + llama:
        for rank in megatron:  # every rank logs the step's loss and evaluates
            assert rank[name]["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
            assert rank[name]["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6), name
        _assert_equal(megatron[0][name], ref)
        model = AutoModelForTokenClassification.from_pretrained(megatron[0][name]["model_dir"])
        assert type(model).__name__ == model_class, name


@pytest.mark.distributed
def test_export_reloads_as_a_token_classifier_with_its_labels(runs):
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(runs["one"]["reference"]["model_dir"])
    assert type(model).__name__ == "BertForTokenClassification"
    assert model.config.id2label == dict(enumerate(LABELS))
    assert model.config.label2id == {name: i for i, name in enumerate(LABELS)}


@pytest.mark.distributed
def test_lora_exports_a_token_cls_adapter_with_its_head(runs, job):
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    folder = Path(runs["one"]["lora"]["model_dir"])
    adapter = json.loads((folder / "adapter_config.json").read_text())
    assert adapter["task_type"] == "TOKEN_CLS"
    assert "classifier" in adapter["modules_to_save"]
    base = AutoModelForTokenClassification.from_pretrained(job["model"], num_labels=len(LABELS))
    model = PeftModel.from_pretrained(base, folder)
    saved = model.base_model.model.classifier.modules_to_save["default"].weight
    assert not saved.equal(base.classifier.original_module.weight)  # the trained head was saved and loaded


def test_label_alignment_follows_transformers_ner_example():
    from hftrain.data.word_labels import align_labels

    tokenizer = _tokenizer()
    encoded = tokenizer([["w1", "w3s", "w30"]], is_split_into_words=True)
    assert tokenizer.convert_ids_to_tokens(encoded["input_ids"][0]) == ["[CLS]", "w1", "w3", "##s", "w30", "[SEP]"]
    assert align_labels(encoded.word_ids(0), [0, 1, 2]) == [-100, 0, 1, -100, 2, -100]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"tokens": ["w1", "w2"], "tags": ["O"]}', "2 tokens and 1 tags; give one tag per word"),
        ('{"tokens": ["w1"], "tags": "O"}', "tags must be a list of label names"),
        ('{"tokens": ["w1"], "labels": ["O"]}', 'an object with "tokens" and "tags"'),
        ("not json", "not JSON"),
    ],
)
def test_a_bad_line_is_one_line_naming_the_file_and_line(job, tmp_path, capsys, line, says):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"tokens": ["w1"], "tags": ["O"]}) + "\n" + line + "\n")
    args = ["train", "--model_name_or_path", job["model"], "--task", "token_classification", "--dataset_name",
            "null", "--train_file", str(bad), "--log_with", "none", "--output_dir", str(tmp_path / "out"),
            "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    reset_accelerate_state()
    code, printed = main(args), capsys.readouterr()
    assert code == 2
    said = [text for text in printed.err.splitlines() if f"data.train_file '{bad}' line 2: " in text]
    assert len(said) == 1 and says in said[0], printed.err[-2000:]
    assert not (tmp_path / "out" / "model").exists()


def test_megatron_refuses_expert_parallelism_for_a_token_classifier():
    """The task record's ``megatron_axes_not_built``: one line naming the axis and the task, before any process group;
    a sequence classifier of the same mixture of experts takes the same layout."""
    from hftrain.errors import ConfigError
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    strategy = strategy_from_options(
        "megatron", {"ep": 2}, launch=LaunchInfo(world_size=2, local_world_size=2), platform=Platform("cpu", "gloo")
    )
    strategy.check_model(tiny_config("mixtral"), use_lora=False)
    with pytest.raises(ConfigError, match="parallelism.ep=2 with model.task: token_classification is not built"):
        strategy.check_model(tiny_config("mixtral"), use_lora=False, task="token_classification")
    # pp with cp: the chunks take context parallelism's split of the positions a per-token loss reads, as a sequence
    # classifier's do (trained against one process in tests/test_pp_cp_per_token.py)
    launch = LaunchInfo(world_size=4, local_world_size=4)
    strategy = strategy_from_options("megatron", {"pp": 2, "cp": 2}, launch=launch, platform=Platform("cpu", "gloo"))
    strategy.check_model(tiny_config("bert"), use_lora=False)
    strategy.check_model(tiny_config("bert"), use_lora=False, task="token_classification")


def test_num_labels_other_than_the_data_is_refused(job):
    from hftrain.errors import ConfigError
    from hftrain.tasks import task_of

    task = task_of("token_classification")
    splits = task.read(None, None, {"train_file": job["train"], "validation_file": job["validation"], "seed": 0})
    with pytest.raises(ConfigError, match="model.num_labels is 5 and the data has 3 labels"):
        task.inputs(splits, _tokenizer(), _Inputs(max_length=32, num_labels=5), print)
    _, head = task.inputs(splits, _tokenizer(), _Inputs(max_length=32, num_labels=None), print)
    assert head["num_labels"] == 3 and head["id2label"] == dict(enumerate(LABELS))
