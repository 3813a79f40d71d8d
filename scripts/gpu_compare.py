"""Side by side on one GPU, in one run: hftrain against the tuned ``transformers.Trainer`` (issue 54, part 5).

``python scripts/gpu_compare.py`` (under ten minutes on one H100/H200; ``--quick`` is a CPU smoke run of the same
code at tiny sizes). Two jobs; each side of each runs in its own process (Accelerate and the Trainer keep
process-global state), one after another on the same device, and prints one line; a table closes the run.

- ``default``: hftrain's default job, the MiniLM classifier (6 layers, hidden 384) on Rotten Tomatoes, batch 32,
  at most 128 tokens, bf16: hftrain with its defaults (``data.pad_to_multiple_of: auto``, ``training.sdpa_backend:
  auto``) and with ``training.compile``, against the Trainer at its tuned settings (``train_sampling_strategy=
  "group_by_length"``, ``bf16``, ``optim="adamw_torch_fused"``) and the same with ``torch_compile``. Same tokenizer,
  same rows, same batch, learning rate and clipping.
- ``lm``: a Llama-shaped model of ~1.07B parameters (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 KV heads,
  SmolLM2's 49,152-token vocabulary, tied embeddings) built from its config with random weights (a GPU machine has
  no hub), trained as a causal LM on the Rotten Tomatoes texts packed into 2048-token blocks, batch 8, bf16, fused
  AdamW. hftrain packs (``hftrain.data.language.pack_splits``, its rules); the Trainer gets those same blocks as its
  dataset and hftrain's collator (``input_ids``, ``labels``, ``position_ids``: transformers masks each document).

What is timed: the optimizer steps after ``--warmup`` steps (compilation, cuDNN plans and the allocator's growth
fall in the warm-up), between two ``torch.cuda.synchronize()`` calls at the window's ends; nothing else is
synchronised by the benchmark. When the window closes the side writes its figures and its process ends: no
evaluation, checkpoint or export is timed or run on either side.

- tokens/s: the window's real (non-padding) tokens over its seconds. Each side counts its own collated batches (the
  Trainer's on the host in its collator; hftrain's on the device, read once after the window).
- MFU: the useful model FLOPs of those tokens (``hftrain.trainers.throughput.FlopModel``: 6 FLOPs per linear weight
  per token, 12·L·H·d·s per token for the attention products, each example at its own length, full-square
  attention as PaLM counts it) over the window's seconds and the card's datasheet bf16 peak (``datasheet_peak``).
- host syncs/step: ``torch.cuda.set_sync_debug_mode("warn")`` over the window; the warnings counted, per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SEED = 42

# side name -> (job, library, compiled)
SIDES = {
    "default/hftrain": ("default", "hftrain", False),
    "default/hftrain compile": ("default", "hftrain", True),
    "default/trainer": ("default", "trainer", False),
    "default/trainer compile": ("default", "trainer", True),
    "lm/hftrain compile": ("lm", "hftrain", True),
    "lm/trainer compile": ("lm", "trainer", True),
    "lm/hftrain": ("lm", "hftrain", False),
    "lm/trainer": ("lm", "trainer", False),
}
LLAMA_1B = dict(
    hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8
)
LLAMA_TINY = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)


# ----------------------------------------------------------------------------- assets (built by the parent)
def prepare_assets(folder: Path) -> None:
    """What a machine without the embedded packages needs (``--prepare-assets``): MiniLM's config and tokenizer,
    the default job's train and validation rows as CSV, SmolLM2's tokenizer. A few MB; no weights."""
    import hftrain
    from hftrain.models import cache_dir, resolve_model_path

    folder.mkdir(parents=True, exist_ok=True)
    minilm = resolve_model_path("embedded:minilm")
    (folder / "minilm").mkdir(exist_ok=True)
    for name in os.listdir(minilm):
        if not name.endswith((".safetensors", ".bin")) and (minilm / name).is_file():
            shutil.copy(minilm / name, folder / "minilm" / name)
    splits = hftrain.load_splits(None)
    for split in ("train", "validation"):
        splits[split].select_columns(["text", "label"]).to_csv(folder / f"rt_{split}.csv", index=False)
    smollm2 = (
        resolve_model_path("embedded:smollm2") if not (cache_dir() / "smollm2").is_dir() else cache_dir() / "smollm2"
    )
    (folder / "smollm2_tokenizer").mkdir(exist_ok=True)
    for name in os.listdir(smollm2):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(smollm2 / name, folder / "smollm2_tokenizer" / name)
    print(f"assets in {folder}: {sorted(os.listdir(folder))}")


def build_models(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """Random-weight model folders: MiniLM (from the assets' config, or the embedded weights when installed) and
    the Llama LM from its config, saved once in fp32 with their tokenizers."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    folders = {}
    assets = Path(args.assets) if args.assets else None
    if assets is None:
        from hftrain.models import resolve_model_path

        folders["default"] = resolve_model_path("embedded:minilm")
    else:
        torch.manual_seed(SEED)
        config = AutoConfig.from_pretrained(assets / "minilm", num_labels=2, trust_remote_code=False)
        model = AutoModelForSequenceClassification.from_config(config)
        folders["default"] = work / "minilm"
        model.save_pretrained(folders["default"])
        AutoTokenizer.from_pretrained(assets / "minilm", trust_remote_code=False).save_pretrained(folders["default"])
    tokenizer_dir = assets / "smollm2_tokenizer" if assets else None
    if tokenizer_dir is None:
        from hftrain.models import cache_dir, resolve_model_path

        tokenizer_dir = cache_dir() / "smollm2"
        if not tokenizer_dir.is_dir():
            tokenizer_dir = resolve_model_path("embedded:smollm2")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    shapes = LLAMA_TINY if args.quick else LLAMA_1B
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=args.block,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=False,
        **shapes,
    )
    torch.manual_seed(SEED)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialised where it is fast
        model = LlamaForCausalLM(config)
    folders["lm"] = work / "llama"
    model.to("cpu").save_pretrained(folders["lm"])
    tokenizer.save_pretrained(folders["lm"])
    params = sum(p.numel() for p in model.parameters())
    print(f"built the LM: {params / 1e9:.3f}B parameters, {shapes}", flush=True)
    del model
    return folders


def data_files(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The default job's train and validation rows as CSV (``text``, ``label``)."""
    if args.assets:
        return Path(args.assets) / "rt_train.csv", Path(args.assets) / "rt_validation.csv"
    import hftrain

    splits = hftrain.load_splits(None)
    paths = work / "rt_train.csv", work / "rt_validation.csv"
    for split, path in zip(("train", "validation"), paths, strict=True):
        splits[split].select_columns(["text", "label"]).to_csv(path, index=False)
    return paths


# ----------------------------------------------------------------------------- the timed window (both sides)
class Window:
    """Steps ``warmup + 1`` .. ``warmup + measured`` between two synchronisations; then the figures go to ``out``
    and the process ends (nothing after the window runs)."""

    def __init__(self, out: Path, warmup: int, measured: int, flop_model, peak: float) -> None:
        self.out, self.warmup, self.measured = out, warmup, measured
        self.flops, self.peak = flop_model, peak
        self.step = 0
        self.start = 0.0
        self.syncs = 0
        self.counting = False
        # Σ tokens, Σ length², examples of the window's batches (device tensors or ints)
        self.tokens, self.squares, self.examples = 0, 0, 0
        warnings.showwarning = self._warning

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            self.syncs += 1

    def count(self, lengths) -> None:
        """One micro-batch's example lengths (a host list or a device tensor)."""
        if not self.counting:
            return
        if isinstance(lengths, list):
            self.tokens += sum(lengths)
            self.squares += sum(n * n for n in lengths)
        else:
            lengths = lengths.long()
            self.tokens = self.tokens + lengths.sum()
            self.squares = self.squares + (lengths * lengths).sum()
        self.examples += len(lengths)

    def step_end(self) -> None:
        import torch

        self.step += 1
        cuda = torch.cuda.is_available()
        if self.step == self.warmup:
            if cuda:
                torch.cuda.synchronize()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            self.start, self.counting = time.perf_counter(), True
        elif self.step == self.warmup + self.measured:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.start
            tokens, squares = int(self.tokens), int(self.squares)
            flops = self.flops.per_token * tokens + self.flops.per_sequence * self.examples
            flops += 12.0 * self.flops.layers * self.flops.attention_width * squares
            figures = {
                "steps": self.measured,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "tflops": flops / seconds / 1e12,
                "mfu": flops / seconds / self.peak,
                "syncs_per_step": self.syncs / self.measured,
                "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            }
            self.out.write_text(json.dumps(figures))
            sys.stdout.flush()
            os._exit(0)


def flop_model_and_peak(model_dir: Path, task: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from hftrain.trainers.throughput import FlopModel, datasheet_peak

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    auto = AutoModelForCausalLM if task == "lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        flops = FlopModel.of(auto.from_config(config))
    if torch.cuda.is_available():
        found = datasheet_peak(torch.cuda.get_device_name(), "bf16")
        if found is not None:
            return flops, found[0] * 1e12
    return flops, 1e12  # the CPU smoke run: MFU against a nominal 1 TFLOP/s


# ----------------------------------------------------------------------------- the sides (child processes)
def child(args: argparse.Namespace) -> None:
    job, library, compiled = SIDES[args.child]
    spec = json.loads(args.spec)
    model_dir = Path(spec["model"])
    flops, peak = flop_model_and_peak(model_dir, job)
    window = Window(Path(args.out), args.warmup, args.steps, flops, peak)
    (run_hftrain if library == "hftrain" else run_trainer)(args, job, compiled, spec, window)
    raise SystemExit(f"{args.child}: the run ended before its window closed (step {window.step})")


def run_hftrain(args, job: str, compiled: bool, spec: dict, window: Window) -> None:
    from hftrain.config import load_config
    from hftrain.job import run_training
    from hftrain.strategies import LaunchInfo
    from hftrain.trainers.base import Trainer
    from hftrain.trainers.throughput import Throughput

    on_step_end, count = Trainer._on_step_end, Throughput.count

    def stamped(self, *a, **k):
        stopped = on_step_end(self, *a, **k)
        window.step_end()
        return stopped

    def counted(self, batch):
        count(self, batch)
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        lengths = mask.sum(dim=1) if mask is not None else ids.new_full((ids.shape[0],), ids.shape[1])
        window.count(lengths)

    Trainer._on_step_end, Throughput.count = stamped, counted
    steps = args.warmup + args.steps + 5
    overrides = [
        "--model_name_or_path",
        spec["model"],
        "--output_dir",
        spec["output"],
        "--overwrite_output_dir",
        "true",
        "--log_with",
        "none",
        "--max_steps",
        str(steps),
        "--mixed_precision",
        "bf16" if not args.quick else "no",
        "--logging_steps",
        "50",
        "--compile",
        str(compiled).lower(),
    ]
    if job == "default":
        overrides += ["--train_file", spec["train"], "--validation_file", spec["validation"]]
    else:
        overrides += [
            "--task",
            "causal_lm",
            "--train_file",
            spec["lm_train"],
            "--validation_file",
            spec["lm_validation"],
            "--text_column",
            "text",
            "--max_seq_length",
            str(args.block),
            "--per_device_train_batch_size",
            str(args.lm_batch),
            "--learning_rate",
            "1e-4",
        ]
    run_training(load_config(None, overrides), LaunchInfo(), process_exits_after=True)


def run_trainer(args, job: str, compiled: bool, spec: dict, window: Window) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    tokenizer = AutoTokenizer.from_pretrained(spec["model"], trust_remote_code=False)
    set_seed(SEED)
    if job == "default":
        import datasets

        from hftrain.config import TrainConfig

        defaults = TrainConfig()
        rows = datasets.load_dataset("csv", data_files={"train": spec["train"]})["train"]
        dataset = rows.map(
            lambda b: tokenizer(b["text"], truncation=True, max_length=defaults.data.max_seq_length),
            batched=True,
            remove_columns=["text"],
        )
        pad = DataCollatorWithPadding(tokenizer)

        def collate(features):
            batch = pad(features)
            window.count(batch["attention_mask"].sum(dim=1).tolist())
            return batch

        model = AutoModelForSequenceClassification.from_pretrained(
            spec["model"], num_labels=2, dtype=torch.float32, trust_remote_code=False
        )
        fields = dict(
            per_device_train_batch_size=defaults.training.per_device_train_batch_size,
            learning_rate=defaults.training.learning_rate,
            train_sampling_strategy="group_by_length",
        )
    else:
        from hftrain.config import load_config
        from hftrain.data.language import lm_collator, pack_splits

        config = load_config(
            None,
            [
                "--task",
                "causal_lm",
                "--model_name_or_path",
                spec["model"],
                "--train_file",
                spec["lm_train"],
                "--validation_file",
                spec["lm_validation"],
            ],
        )
        import hftrain

        blocks = pack_splits(hftrain.load_splits(config), tokenizer, block_size=args.block, log=lambda _: None)
        dataset = blocks["train"]

        def collate(features):
            batch = lm_collator(features)
            window.count([batch["input_ids"].shape[1]] * batch["input_ids"].shape[0])
            return batch

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, trust_remote_code=False)
        model.config.use_cache = False  # a cache, even an empty one, turns transformers' packed-document mask off
        fields = dict(
            per_device_train_batch_size=args.lm_batch, learning_rate=1e-4, train_sampling_strategy="sequential"
        )

    class Stamps(TrainerCallback):
        def on_step_end(self, *a, **k):
            window.step_end()

    training_args = TrainingArguments(
        output_dir=spec["output"],
        max_steps=args.warmup + args.steps + 5,
        seed=SEED,
        optim="adamw_torch_fused",
        bf16=not args.quick,
        torch_compile=compiled,
        max_grad_norm=1.0,
        logging_steps=50,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        dataloader_pin_memory=torch.cuda.is_available(),
        **fields,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collate, callbacks=[Stamps()]
    )
    trainer.train()


# ----------------------------------------------------------------------------- the parent
def lm_corpus(train_csv: Path, work: Path, copies: int) -> Path:
    """The LM's documents: the review texts, ``copies`` times (enough 2048-token blocks for the steps)."""
    import csv

    with open(train_csv, newline="") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    work.mkdir(exist_ok=True)
    path = work / "lm_train.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        for _ in range(copies):
            writer.writerows([text] for text in texts)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)}")
    parser.add_argument("--assets", help="a folder from --prepare-assets (a machine without the embedded packages)")
    parser.add_argument("--prepare-assets", help="write the assets into this folder and stop")
    parser.add_argument("--quick", action="store_true", help="a CPU smoke run of the same code at tiny sizes")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lm_steps", type=int, default=None)
    parser.add_argument("--block", type=int, default=None)
    parser.add_argument("--lm_batch", type=int, default=None)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds: no side starts after this")
    parser.add_argument("--side_timeout", type=float, default=240.0)
    parser.add_argument("--json", help="write every side's figures here")
    parser.add_argument("--log", help="append every side's output here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.block = args.block or (128 if args.quick else 2048)
    args.lm_batch = args.lm_batch or (2 if args.quick else 8)
    if args.child:
        args.warmup, args.steps = args.warmup, args.steps
        child(args)
        return 0
    if args.prepare_assets:
        prepare_assets(Path(args.prepare_assets))
        return 0
    began = time.perf_counter()
    warmup = args.warmup or (3 if args.quick else 20)
    steps = args.steps or (6 if args.quick else 200)
    lm_steps = args.lm_steps or (4 if args.quick else 12)
    lm_warmup = 2 if args.quick else 5
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        train, validation = data_files(args, work)
        models = build_models(args, work)
        lm_train = lm_corpus(train, work, copies=1 if args.quick else 2)
        lm_validation = lm_corpus(validation, work / "v", copies=1)
        for side in args.sides.split(","):
            if side not in SIDES:
                raise SystemExit(f"--sides: unknown side '{side}'; use {', '.join(SIDES)}")
            if time.perf_counter() - began > args.budget:
                print(f"SKIP {side}: past --budget {args.budget:.0f} s", flush=True)
                continue
            job = SIDES[side][0]
            spec = {
                "model": str(models[job]),
                "train": str(train),
                "validation": str(validation),
                "lm_train": str(lm_train),
                "lm_validation": str(lm_validation),
                "output": str(work / side.replace("/", "_").replace(" ", "_")),
            }
            out = work / "figures.json"
            out.unlink(missing_ok=True)
            w, s = (warmup, steps) if job == "default" else (lm_warmup, lm_steps)
            command = [
                sys.executable,
                str(Path(__file__)),
                "--child",
                side,
                "--spec",
                json.dumps(spec),
                "--out",
                str(out),
                "--warmup",
                str(w),
                "--steps",
                str(s),
                "--block",
                str(args.block),
                "--lm_batch",
                str(args.lm_batch),
                *(["--quick"] if args.quick else []),
            ]
            start = time.perf_counter()
            try:
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.side_timeout)
                failed = None if out.is_file() else (done.stderr or done.stdout)[-3000:]
                output = f"{done.stdout}\n{done.stderr}"
            except subprocess.TimeoutExpired as error:
                output = f"{error.stdout or ''}\n{error.stderr or ''}"
                failed = f"timed out after {args.side_timeout:.0f} s\n{output[-2000:]}"
            if args.log:
                with open(args.log, "a") as log:
                    log.write(f"===== {side}\n{output}\n")
            if failed:
                print(f"FAIL {side} ({time.perf_counter() - start:.0f} s):\n{failed}", flush=True)
                continue
            figures = json.loads(out.read_text())
            results[side] = figures
            print(
                f"{side}: {figures['tokens_per_s']:,.0f} tokens/s, MFU {figures['mfu']:.4f}, "
                f"{figures['syncs_per_step']:.2f} host syncs/step, {figures['seconds'] / figures['steps'] * 1e3:.1f} "
                f"ms/step, max_memory_allocated {figures['max_memory_gib']:.2f} GiB "
                f"({time.perf_counter() - start:.0f} s in all)",
                flush=True,
            )
    print(f"\n| side ({device}) | tokens/s | vs the Trainer's best | MFU | host syncs/step | ms/step | GiB |")
    print("|---|---|---|---|---|---|---|")
    for side, f in results.items():
        job = SIDES[side][0]
        best = max((r["tokens_per_s"] for s, r in results.items() if s.startswith(f"{job}/trainer")), default=None)
        ratio = f"{f['tokens_per_s'] / best:.2f}x" if best else "-"
        print(
            f"| {side} | {f['tokens_per_s']:,.0f} | {ratio} | {f['mfu']:.3f} | {f['syncs_per_step']:.2f} | "
            f"{f['seconds'] / f['steps'] * 1e3:.1f} | {f['max_memory_gib']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "sides": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
