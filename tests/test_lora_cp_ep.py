"""LoRA under context parallelism (cp=2) and expert parallelism (ep=2) through the Trainer, against one process.

Two 2-process gloo launches (one per axis) and one 1-process launch for the references, fp32, LoRA r=4 on the
attention (and the head in ``modules_to_save``), the global batch 8 everywhere:
- cp=2, a tiny Llama classifier (grouped-query, causal, the classified token the last non-pad one): no parameter is
  split, the adapters and the head are replicated over cp and their gradients averaged over dp × cp; context
  parallelism finds the family's trunk inside the ``PeftModel``.
- ep=2, a tiny Mixtral classifier (4 experts, top-2, the routers' load-balancing loss in every loss): each rank holds
  half the routed experts, which LoRA leaves frozen; the adapters are replicated over ep.
Each run is stopped at step 8 and resumed to 10 (``save_steps`` 4): every step's loss, the learning rates, the
evaluation and the adapter weights equal the 1-process LoRA run within 1e-5, only adapters and the head moved, and
the run's export is a standard PEFT adapter (no expert weights) that ``PeftModel.from_pretrained`` loads onto the
base model, with the same weights and logits as the reference's export. In one process: the megatron strategy takes
``use_lora`` at cp=2 and at ep=2, and ``hftrain plan``'s LoRA rows of those layouts are runnable, not formula-only.
"""

from __future__ import annotations

import pytest
import torch

from hftrain.parallel.context_parallel import ATTENTION_NAME
from tests.distributed import run_distributed
from tests.megatron_runs import assert_same_weights
from tests.tiny import run_tiny_training

LORA = {"lora_r": 4, "lora_target_modules": ["q_proj", "v_proj"]}
# label -> (kind, megatron options, micro-batch per replica); 96 examples, global batch 8 (ep is carved out of dp:
# 2 replicas of 4); stopped at step 8 of 10, a checkpoint every 4
ROWS = {"cp2": ("llama", {"cp": 2}, 8), "ep2": ("mixtral", {"ep": 2}, 4)}
COMMON = {"steps": 10, "save_steps": 4, "return_weights": True, "lora_options": LORA}


def _exported(trainer, directory: str) -> dict:
    """Export the trained model (collective) and read the adapter the main process wrote."""
    from safetensors.torch import load_file

    from hftrain.checkpoint.export import export_pretrained
    from hftrain.parallel import ddp_ignored
    from hftrain.parallel.expert_parallel import ExpertParallelExperts
    from hftrain.parallel.lora import hf_model_of

    model = trainer.runtime.unwrap_model(trainer.model)
    plugin = getattr(trainer.runtime, "plugin", None)  # megatron's (the reference runs under DDP)
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    layout = {
        "attention": hf_model_of(model).config._attn_implementation,
        "context_split": getattr(model, "context_split", None) is not None,
        "local_experts": [m.local_experts for m in experts],
        "experts_frozen": all(not p.requires_grad for m in experts for p in m.parameters()),
        # the experts' data replicas are not DDP's group: their names, with the PEFT wrapper's prefix, are ignored
        "ddp_ignored": ddp_ignored(model, plugin.groups) if plugin else [],
        "parameters": [name for name, _ in model.named_parameters()],
    }
    result = export_pretrained(trainer.runtime, trainer.model, trainer.tokenizer, directory)
    main = trainer.accelerator.is_main_process
    return {"adapter": load_file(f"{result.model_dir}/adapter_model.safetensors") if main else None, **layout}


def _row(root: str, label: str) -> dict:
    """One row on this launch: the run stopped at step 8, then resumed to 10 and exported."""
    kind, options, micro = ROWS[label]
    common = {**COMMON, "kind": kind, "strategy": "megatron", "strategy_options": options, "micro": micro}
    part = run_tiny_training(output_dir=f"{root}/{label}", stop_at_step=8, **common)
    resumed = run_tiny_training(
        output_dir=f"{root}/{label}", resume_from_checkpoint="latest",
        inspect=lambda trainer: _exported(trainer, f"{root}/{label}-export"), **common,
    )  # fmt: skip
    return {"part": part, "resumed": resumed}


def _reference(root: str) -> dict:
    return {
        label: run_tiny_training(
            kind=kind,
            micro=8,
            output_dir=f"{root}/ref-{label}",
            inspect=lambda trainer, label=label: _exported(trainer, f"{root}/ref-{label}-export"),
            **COMMON,
        )  # fmt: skip
        for label, (kind, _, _) in ROWS.items()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("lora_cp_ep"))
    rows = {label: run_distributed(_row, nprocs=2, timeout=900, root=root, label=label) for label in ROWS}
    (reference,) = run_distributed(_reference, nprocs=1, timeout=900, root=root)
    return {"rows": rows, "reference": reference, "root": root}


def _initial_model(kind: str, lora: dict | None = None) -> torch.nn.Module:
    """The model every run starts from (built right after the trainer's seed), with or without its adapters."""
    from transformers import set_seed

    from tests.tiny import tiny_model_init

    set_seed(42)
    return tiny_model_init(kind, lora_options=lora)().eval()


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(ROWS))
def test_lora_stopped_and_resumed_equals_lora_on_one_process(runs, label):
    ref = runs["reference"][label]
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the loss moved
    for rank in runs["rows"][label]:
        part, resumed = rank["part"], rank["resumed"]
        assert part["preempted"] == "stop_at_step" and part["global_step"] == 8
        assert part["losses"] == pytest.approx(ref["losses"][:8], rel=1e-5)
        assert resumed["global_step"] == ref["global_step"] == 10
        assert resumed["losses"] == pytest.approx(ref["losses"], rel=1e-5)  # the log holds steps 1-8 too
        assert resumed["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
        assert resumed["samples_seen"] == ref["samples_seen"]
        assert resumed["metrics"]["eval_samples"] == 25  # each validation example once, not once per cp rank
        assert resumed["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
    layout = runs["rows"][label][0]["resumed"]["inspected"]
    if label == "cp2":  # context parallelism found the trunk inside the PeftModel
        assert layout["attention"] == ATTENTION_NAME and layout["context_split"]
    else:  # half the experts per rank, frozen; the ignore list names the wrapped model's expert parameters
        assert layout["local_experts"] == [2, 2] and layout["experts_frozen"]
        assert layout["ddp_ignored"] and all(".experts." in n for n in layout["ddp_ignored"])
        assert set(layout["ddp_ignored"]) <= set(layout["parameters"])
    losses = runs["rows"][label][0]["resumed"]["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True))
    print(f"\nLoRA {label}, stopped at 8 and resumed to 10: largest relative loss difference {worst:.1e}")
    # the full weights (experts gathered over ep) under PEFT's names: equal, and only adapters and the head moved
    weights = runs["rows"][label][0]["resumed"]["weights"]
    assert_same_weights(weights, ref["weights"], atol=1e-5)
    initial = _initial_model(ROWS[label][0], LORA).state_dict()
    moved = {name for name, tensor in weights.items() if not torch.equal(tensor, initial[name])}
    assert moved and all(".lora_" in n or ".modules_to_save." in n for n in moved), sorted(moved)
    assert any(".lora_B." in n and weights[n].abs().sum() > 0 for n in weights)


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(ROWS))
def test_the_export_is_a_peft_adapter_equal_to_one_processs(runs, label, tmp_path):
    from peft import PeftModel

    adapter = runs["rows"][label][0]["resumed"]["inspected"]["adapter"]
    ref_adapter = runs["reference"][label]["inspected"]["adapter"]
    assert_same_weights(adapter, ref_adapter, atol=1e-5)
    assert not any("expert" in name for name in adapter)  # the adapter only: no expert (or other base) weight
    assert any(".lora_B." in n and t.abs().sum() > 0 for n, t in adapter.items())
    kind = ROWS[label][0]
    root = runs["root"]
    loaded = {
        run: PeftModel.from_pretrained(_initial_model(kind), f"{root}/{run}").eval()
        for run in (f"{label}-export", f"ref-{label}-export")
    }
    ids = torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in loaded.values()]
        base = _initial_model(kind)(input_ids=ids).logits
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    assert (logits[0] - base).abs().max() > 1e-4  # the adapter changed the model


# ----------------------------------------------------------------- what the strategy and the planner offer
@pytest.mark.parametrize(("kind", "sizes"), [("llama", {"cp": 2}), ("mixtral", {"ep": 2})])
def test_the_strategy_takes_lora_with_cp_or_ep_and_the_planner_offers_it(tmp_path, kind, sizes):
    """The megatron strategy's model check takes ``use_lora`` at cp=2 and at ep=2, and ``hftrain plan``'s LoRA rows
    of those layouts are runnable (not formula-only); under ep LoRA trains no expert (the planner's experts hold no
    gradient or Adam state)."""
    from hftrain.plan import Hardware, Workload, model_from_config, model_parallel
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform
    from tests.tiny import tiny_config

    config = tiny_config(kind)
    config.save_pretrained(tmp_path / kind)
    strategy = strategy_from_options(
        "megatron", sizes, launch=LaunchInfo(world_size=2, local_world_size=2), platform=Platform("cpu", "gloo")
    )
    strategy.check_model(config, use_lora=True)  # refused before: "lora.use_lora with parallelism.cp=2 ..."
    model = model_from_config(str(tmp_path / kind))
    work, hardware = Workload(lora_rank=4, dropout=False), Hardware(gpus_per_node=2)
    row = model_parallel.estimate(1, 1, model, work, hardware, **sizes)
    assert row.runnable and not any("formula only" in note for note in row.notes), row.notes
    assert row.strategy[next(iter(sizes))] == 2
    if kind == "mixtral":
        full = model_parallel.estimate(1, 1, model, Workload(dropout=False), hardware, **sizes)
        assert full.runnable and row.grads < full.grads and row.optimizer < full.optimizer
