"""The ``save_pretrained`` export under every strategy, full and LoRA, reloaded with plain transformers / peft.

One 2-process gloo launch trains every case a few steps, exports it (which reloads and verifies on the main
process), and returns the trained model's logits on a batch the export never saw plus each rank's local piece
of every trained weight. The tests then reload each folder here, outside any DeepSpeed context, and check:
the logits (the head survives: pitfall "classification head lost with LoRA"), every tensor and shape of a full
export ("ZeRO-3 save_pretrained writes empty weights"), trained ``lora_B`` not all zero ("LoRA adapter saved empty
under ZeRO-3"), the adapter equal to the concatenation of the ranks' *different* shards, not one rank's slice
("FSDP2 + PEFT saves one rank's adapter slice"), and the merged model equal to the adapter model (pitfalls in
docs/pitfalls.md). One job runs through the CLI and reloads with
``AutoPeftModelForSequenceClassification``, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from hftrain.errors import HFTrainError
from tests.distributed import run_distributed
from tests.tiny import run_tiny_training, tiny_config, tiny_model_init, tiny_tokenizer

STEPS = 3
SEED = 42  # TrainingConfig's default seed: the trainer builds the base model right after set_seed(SEED)
TOLERANCE = 1e-5
# A large alpha / r scale, so that 3 steps of LoRA move the logits far more than the tolerance: a dropped
# adapter must fail the comparison, not hide inside it.
LORA = {"lora_r": 4, "lora_alpha": 64}
VERIFY_TEXTS = ["w1 w2 w3", "w30 w31 w5 w6 w7 w8 w9", "w0"]  # what export_pretrained verifies on
TEST_TEXTS = ["w4 w4 w22 w23", "w39", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"]  # what the tests compare on
# label -> (hftrain strategy, strategy options, shards parameters)
STRATEGIES: dict[str, tuple[str, dict | None, bool]] = {
    "ddp": ("ddp", None, False),
    "fsdp1": ("fsdp", {"fsdp_version": 1}, True),
    "fsdp2": ("fsdp", {"fsdp_version": 2}, True),
    "zero1": ("zero1", None, False),
    "zero2": ("zero2", None, False),
    "zero3": ("zero3", None, True),
    "zero3_offload": ("zero3", {"offload_optimizer": True, "offload_params": True}, True),
}
# (model kind, strategy label, LoRA, mixed precision): BERT under every strategy, GPT-2 (Conv1D, fan_in_fan_out)
# under DDP and ZeRO-3, and bf16 (autocast under DDP, bf16 weights under DeepSpeed) for LoRA.
CASES = (
    [("bert", label, lora, "no") for label in STRATEGIES for lora in (False, True)]
    + [("gpt2", label, lora, "no") for label in ("ddp", "zero3") for lora in (False, True)]
    + [("bert", label, True, "bf16") for label in ("ddp", "zero3")]
)
IDS = [
    f"{kind}-{label}-{'lora' if lora else 'full'}" + ("-bf16" if mp != "no" else "") for kind, label, lora, mp in CASES
]


# ----------------------------------------------------------------- the 2-process body
def _recording_trainer():
    from hftrain.trainers import SequenceClassificationTrainer

    class Recording(SequenceClassificationTrainer):
        last = None

        def fit(self, *args, **kwargs):
            Recording.last = self
            return super().fit(*args, **kwargs)

    return Recording


def _forget_previous_run() -> None:
    """Reset what one run leaves in the process and would change the next one's strategy."""
    from accelerate.state import AcceleratorState
    from transformers.integrations import unset_hf_deepspeed_config

    # tiny.reset_accelerate_state keeps PartialState, which remembers the previous distributed type; and a ZeRO-3
    # run leaves transformers' global DeepSpeed config set, which would build the next model under zero.Init.
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()


def _batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    return dict(tokenizer(texts, padding=True, return_tensors="pt"))


def _local_trainable_pieces(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own storage of every trained weight (LoRA and head), flattened: a ZeRO-3 partition, an FSDP
    shard (FSDP1 shards a layer's flat parameter, so a small weight may lie wholly on one rank), or all of it."""
    from torch.distributed.tensor import DTensor

    pieces = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if isinstance(param, DTensor):  # FSDP2: a dim-0 shard
            local = param.to_local()
        elif hasattr(param, "ds_tensor"):  # ZeRO-3: a flat partition, padded at the end
            local = param.ds_tensor
        else:  # FSDP1 (use_orig_params): a flat view into this rank's shard; DDP/ZeRO-1/2: the whole tensor
            local = param.data
        pieces[name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")] = local.detach().flatten().clone()
    return pieces


def _train_and_export(kind: str, label: str, lora: bool, precision: str, directory: str) -> dict:
    from hftrain.checkpoint.export import export_pretrained

    strategy, options, _ = STRATEGIES[label]
    _forget_previous_run()
    recording = _recording_trainer()
    with mock.patch("hftrain.trainers.SequenceClassificationTrainer", recording):
        run_tiny_training(
            kind=kind, strategy=strategy, strategy_options=options, lora_options=LORA if lora else None,
            steps=STEPS, n_eval=5, output_dir=f"{directory}-run", mixed_precision=precision,
        )  # fmt: skip
    trainer = recording.last
    acc, model, tokenizer = trainer.accelerator, trainer.model, trainer.tokenizer
    pieces = _local_trainable_pieces(model) if lora else {}
    try:  # a failed verification raises on every rank alike, so the launch can go on to the next case
        export = export_pretrained(
            trainer.runtime, model, tokenizer, directory, merge_lora=lora, verify_inputs=_batch(tokenizer, VERIFY_TEXTS)
        )
    except HFTrainError as error:
        export = str(error)
    model.eval()
    with torch.no_grad():  # collective under ZeRO-3/FSDP: every rank runs it
        logits = model(**_batch(tokenizer, TEST_TEXTS)).logits.float().cpu()
    return {"export": export, "logits": logits, "pieces": pieces, "distributed_type": str(acc.distributed_type)}


def _export_all(root: str) -> dict:
    # DeepSpeed last: a ZeRO run changes process-wide state that _forget_previous_run must undo for the others.
    order = sorted(range(len(CASES)), key=lambda i: CASES[i][1].startswith("zero"))
    return {IDS[i]: _train_and_export(*CASES[i], directory=f"{root}/{IDS[i]}") for i in order}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("export")
    return run_distributed(_export_all, nprocs=2, timeout=900, root=str(root))


# ----------------------------------------------------------------- reloading here (no DeepSpeed, one process)
def _fresh_model(kind: str) -> torch.nn.Module:
    """The model the trainer started from: built right after set_seed, as the trainer does."""
    from transformers import set_seed

    set_seed(SEED)
    return tiny_model_init(kind)().eval()


@torch.no_grad()
def _logits(model: torch.nn.Module, kind: str) -> torch.Tensor:
    tokenizer = tiny_tokenizer(kind)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return model(**_batch(tokenizer, TEST_TEXTS)).logits.float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_export_reloads_to_the_trained_model(exports, case):
    from hftrain.checkpoint.export import LOGIT_TOLERANCE

    kind, label, lora, precision = case
    case_id = IDS[CASES.index(case)]
    tolerance = LOGIT_TOLERANCE[precision]
    rank0, rank1 = exports[0][case_id], exports[1][case_id]
    export = rank0["export"]
    assert not isinstance(export, str), export  # the export's own verification failed
    assert rank1["export"] == export  # every rank got the main process's verdict
    assert rank0["distributed_type"].endswith(
        "FSDP" if label.startswith("fsdp") else "DEEPSPEED" if label.startswith("zero") else "MULTI_CPU"
    )
    assert export.is_adapter == lora and export.logit_diffs["model"] <= tolerance
    print(f"{case_id}: export verification {export.logit_diffs}")
    if lora:
        reloaded = _check_adapter(Path(export.model_dir), kind, rank0["pieces"], rank1["pieces"], STRATEGIES[label][2])
        assert export.logit_diffs["merged"] <= tolerance
        # Under DeepSpeed bf16 the frozen base was trained (and merged) in bf16, the adapter reloads onto fp32.
        _check_merged(Path(export.merged_dir), kind, _logits(reloaded, kind), tolerance)
    else:
        reloaded = _check_full(Path(export.model_dir), kind)
    diff = _max_diff(_logits(reloaded, kind), rank0["logits"])
    print(f"{case_id}: reloaded here vs trained, max logit difference {diff:.2e}")
    assert diff <= tolerance
    if precision == "no":  # training moved the logits far beyond the tolerance, so the comparison means something
        assert _max_diff(_logits(_fresh_model(kind), kind), rank0["logits"]) > 50 * tolerance
    # (Not so in bf16 on this tiny model: its logits are ~1e-2, below the 16-bit rounding bound. The export's exact
    # checks, tensor shapes and adapter values, do not depend on the precision.)


def _check_full(directory: Path, kind: str) -> torch.nn.Module:
    """Every tensor of a fresh model is written with its full shape, and loads strictly.

    Pitfall "ZeRO-3 save_pretrained writes empty weights", docs/pitfalls.md.
    """
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    written = load_file(directory / "model.safetensors")
    fresh = _fresh_model(kind).state_dict()
    assert sorted(written) == sorted(fresh)
    assert all(written[k].shape == fresh[k].shape and written[k].numel() > 0 for k in fresh)
    model, info = AutoModelForSequenceClassification.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _check_adapter(directory: Path, kind: str, pieces0: dict, pieces1: dict, sharded: bool) -> torch.nn.Module:
    """The adapter holds the head and every trained LoRA weight, equal to the ranks' shards put together."""
    from peft import PeftModel
    from safetensors.torch import load_file

    written = load_file(directory / "adapter_model.safetensors")
    head = "classifier" if kind == "bert" else "score"
    # the new head is saved (pitfall "classification head lost with LoRA", docs/pitfalls.md)
    assert f"base_model.model.{head}.weight" in written
    lora_b = [k for k in written if "lora_B" in k]
    assert lora_b and len(lora_b) == len([k for k in written if "lora_A" in k])
    # trained, not the zero init (pitfall "LoRA adapter saved empty under ZeRO-3", docs/pitfalls.md)
    assert all(written[k].abs().max() > 0 for k in lora_b)
    fresh = _fresh_model(kind)
    fresh_head = getattr(fresh, head).weight.detach().clone()
    assert _max_diff(written[f"base_model.model.{head}.weight"], fresh_head) > 0  # the head was trained
    model = PeftModel.from_pretrained(fresh, directory).eval()
    state = model.state_dict()
    assert sorted(pieces0) == sorted(pieces1)
    assert (
        len([n for n in pieces0 if "lora_" in n]) == 2 * len(lora_b)
        and f"base_model.model.{head}.modules_to_save.default.weight" in pieces0
    )
    for name, piece0 in pieces0.items():
        full = state[name].flatten()
        if sharded:  # rank 0's part, then rank 1's (ZeRO-3 pads the last partition)
            joined = torch.cat([piece0, pieces1[name]])[: full.numel()]
        else:
            assert torch.equal(piece0, pieces1[name]), name
            joined = piece0
        # The export holds the fp32 master weights; the ranks' working copies are them rounded to the training dtype.
        assert torch.equal(joined, full.to(joined.dtype)), name
    # each rank holds only part of the adapter, so one rank's slice would not be all of it
    # (pitfall "FSDP2 + PEFT saves one rank's adapter slice", docs/pitfalls.md)
    if sharded:
        total = sum(state[name].numel() for name in pieces0)
        assert all(0 < sum(p.numel() for p in pieces.values()) < total for pieces in (pieces0, pieces1))
    return model


def _check_merged(directory: Path, kind: str, adapter_logits: torch.Tensor, tolerance: float) -> None:
    """The merged folder is a plain model (the fresh model's tensors, no LoRA) giving the adapter model's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    assert sorted(load_file(directory / "model.safetensors")) == sorted(_fresh_model(kind).state_dict())
    merged = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    assert _max_diff(_logits(merged, kind), adapter_logits) <= tolerance


# ----------------------------------------------------------------- one process, no launch
def test_verification_rejects_a_folder_that_is_not_the_trained_model(tmp_path):
    from hftrain.checkpoint.export import verify_export

    tokenizer = tiny_tokenizer("bert")
    inputs = _batch(tokenizer, VERIFY_TEXTS)
    trained = _fresh_model("bert")
    with torch.no_grad():
        expected = trained(**inputs).logits
    assert verify_export(_save(trained, tmp_path / "same"), inputs, expected) <= TOLERANCE
    torch.manual_seed(1)
    other = tiny_model_init("bert")()
    with pytest.raises(HFTrainError) as error:
        verify_export(_save(other, tmp_path / "other"), inputs, expected)
    assert "does not reproduce the trained model" in str(error.value) and "\n" not in str(error.value)


def _save(model: torch.nn.Module, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


class _OneProcess:
    """The part of the runtime that ``export_pretrained`` uses, for one process, with a given gathered state.

    A real Accelerator here would leave Accelerate's process-wide state behind in the test process.
    """

    is_main_process = True
    num_processes = 1
    mixed_precision = "no"
    device = torch.device("cpu")

    def __init__(self, gathered: dict[str, torch.Tensor]) -> None:
        self.gathered = gathered

    def plain_model_context(self):
        import contextlib

        return contextlib.nullcontext()

    def evaluation_context(self):  # the runtime's context of a forward-only pass: nothing for one process
        import contextlib

        return contextlib.nullcontext()

    def gradients_released(self):  # no gradient buffer kept between steps
        import contextlib

        return contextlib.nullcontext()

    def wait_for_everyone(self) -> None:
        pass

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return self.gathered


def test_an_empty_partition_is_refused_before_anything_is_written(tmp_path):
    """What a ZeRO-3 gather without stage3_gather_16bit_weights_on_model_save hands over.

    Pitfall "ZeRO-3 save_pretrained writes empty weights", docs/pitfalls.md.
    """
    from hftrain.checkpoint.export import export_pretrained

    model = _fresh_model("bert")
    gathered = dict(model.state_dict())
    gathered["classifier.weight"] = torch.empty(0)
    with pytest.raises(HFTrainError) as error:
        export_pretrained(_OneProcess(gathered), model, tiny_tokenizer("bert"), tmp_path / "model")
    assert "wrong shape (e.g. classifier.weight: (0,)" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "model").exists()


def test_tied_weights_gathered_as_two_copies_reload_tied(tmp_path):
    """Sharding gathers a tied lm_head as its own tensor; the export must write one and reload tied.

    Pitfall "tied weights duplicated on save", docs/pitfalls.md.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from hftrain.checkpoint.export import export_pretrained

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    gathered = {k: v.clone() for k, v in model.state_dict().items()}  # no shared storage left
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
    export = export_pretrained(
        _OneProcess(gathered), model, tiny_tokenizer("gpt2"), tmp_path / "model", verify_inputs=inputs
    )
    assert export.max_logit_diff <= TOLERANCE
    reloaded = GPT2LMHeadModel.from_pretrained(export.model_dir)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight


def test_apply_lora_trains_adapters_and_head_only():
    from hftrain.config import LoraConfig
    from hftrain.models.lora import apply_lora

    for kind, head, targets in (("bert", "classifier", ("query", "value")), ("gpt2", "score", ("c_attn",))):
        model = apply_lora(tiny_model_init(kind)(), LoraConfig(use_lora=True, lora_r=4))
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert all("lora_" in n or f".{head}.modules_to_save." in n for n in trainable), trainable
        assert any(f".{head}.modules_to_save." in n for n in trainable)
        assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable if "lora_" in n} == set(targets)
    assert model.peft_config["default"].fan_in_fan_out  # GPT-2's Conv1D weights are stored transposed


# ----------------------------------------------------------------- the job, through the CLI
def test_lora_job_exports_an_adapter_that_auto_peft_reloads(tmp_path):
    """``hftrain train`` with LoRA writes an adapter on the base model's folder and the merged model beside it."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_splits

    base_dir = tmp_path / "tiny-bert"
    AutoModelForSequenceClassification.from_config(tiny_config("bert")).save_pretrained(base_dir)
    tiny_tokenizer("bert").save_pretrained(base_dir)
    splits = tiny_splits(n_train=40, n_eval=8)
    splits["train"].to_csv(tmp_path / "train.csv")
    splits["validation"].to_csv(tmp_path / "validation.csv")
    output_dir = tmp_path / "out"
    command = [
        sys.executable, "-m", "hftrain", "train", "--model_name_or_path", str(base_dir),
        "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "validation.csv"),
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--log_with", "none",
        "--use_lora", "true", "--lora_alpha", "64", "--lora_r", "4", "--merge_lora_on_export", "true",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model saved to {output_dir / 'model'}" in done.stdout + done.stderr
    assert "reloaded it: max logit difference" in done.stdout + done.stderr
    adapter = AutoPeftModelForSequenceClassification.from_pretrained(output_dir / "model").eval()
    merged = AutoModelForSequenceClassification.from_pretrained(output_dir / "model_merged").eval()
    assert _max_diff(_logits(adapter, "bert"), _logits(merged, "bert")) <= TOLERANCE


def _publish_checks(export, target: Path) -> dict:
    """Export to ``target`` (holding an earlier export) twice: with a ``before_publish`` that fails, then with one
    that succeeds; what the folder held at each point."""
    target.mkdir()
    (target / "earlier.txt").write_text("the earlier export")
    seen: dict = {}

    def refuse() -> None:
        seen["staged"] = sorted(p.name for p in target.parent.iterdir())
        raise HFTrainError("the last checkpoint failed")

    with pytest.raises(HFTrainError, match="the last checkpoint failed"):
        export(target, refuse)
    seen["after_refusal"] = sorted(p.name for p in target.parent.iterdir()), sorted(p.name for p in target.iterdir())
    export(target, lambda: seen.setdefault("earlier_at_publish", (target / "earlier.txt").exists()))
    seen["published"] = sorted(p.name for p in target.iterdir())
    return seen


@pytest.mark.parametrize("path", ["gathered", "streamed"])
def test_an_export_replaces_the_earlier_one_only_after_before_publish(tmp_path, path):
    """The job exports beside its last checkpoint's background write and passes the wait for it as
    ``before_publish``: the folders are staged and verified first, the earlier export is still in place when it
    runs, and when it fails the staged folder is removed and the earlier export stays."""
    from hftrain.checkpoint.export import export_pretrained

    if path == "gathered":
        model = _fresh_model("bert")
        runtime, tokenizer = _OneProcess(dict(model.state_dict())), tiny_tokenizer("bert")
        seen = _publish_checks(
            lambda target, hook: export_pretrained(runtime, model, tokenizer, target, before_publish=hook),
            tmp_path / "model",
        )
    else:

        def inspect(trainer):
            assert hasattr(trainer.runtime, "iter_full_state")  # the DDP runtime streams
            return _publish_checks(
                lambda target, hook: export_pretrained(
                    trainer.runtime, trainer.model, trainer.tokenizer, target, before_publish=hook
                ),
                tmp_path / "model",
            )

        seen = run_tiny_training(steps=1, inspect=inspect)["inspected"]
    assert seen["staged"] == [".staging-model", "model"]
    assert seen["after_refusal"] == (["model"], ["earlier.txt"])
    assert seen["earlier_at_publish"] is True
    assert "model.safetensors" in seen["published"] and "earlier.txt" not in seen["published"]


def test_a_gpu_trained_model_is_compared_with_its_cpu_reload_at_a_cross_device_tolerance():
    """The reload computes on the CPU: logits from a GPU differ in summation order (and TF32 rounding where torch
    allows it); fp32 gets that margin, a CPU run and autocast runs none beyond their own."""
    import torch

    from hftrain.checkpoint.export import cross_device_tolerance

    assert cross_device_tolerance("cpu", "no") == 0.0 and cross_device_tolerance("cuda", "bf16") == 0.0
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert cross_device_tolerance("cuda", "no") == 1e-4
        torch.backends.cuda.matmul.allow_tf32 = True
        assert cross_device_tolerance("cuda", "no") == 2e-3
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
