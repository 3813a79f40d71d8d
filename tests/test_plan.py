"""``hftrain plan``: its formulas against published figures, its estimates against live ranks, its configs run.

- Published: the ZeRO paper's worked example (7.5B parameters, N = 64) and DeepSpeed's own estimators
  (``estimate_zero2/3_model_states_mem_needs``, what the ``*_all_cold`` functions print), side by side.
- Measured: per-rank bytes of parameters, gradients and optimizer state that 2 gloo processes really hold under
  DDP, ZeRO-1/2/3 and FSDP (``tests/test_sharding.py``'s reader of the live DeepSpeed/FSDP objects) and under
  tensor parallelism (tp = 2, with sequence parallelism) and of the live pipeline stages (pp = 2; slow: tp = 2 ×
  pp = 2), each within 10 % of the estimate; the bytes autograd
  saves for backward (``saved_tensors_hooks``) within 25 % of the activation estimate.
- ``--write-configs``: the written files start a real 2-process run (zero2, megatron tp2 and pp2).
- Bad input: one line, exit code 2, nothing written; "nothing fits" is an answer.
- Language models (``--task causal_lm``): the logits term s·b·V'·(e + 4)/t, the lm_head counted (tied once), pp·cp rows
  runnable, ``model.task`` written, the activations against a tiny Llama LM's saved tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hftrain.cli import main
from hftrain.plan import (
    Hardware,
    Workload,
    data_parallel,
    formulas,
    model_from_config,
    model_from_sizes,
    model_parallel,
    plan,
)
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
STATE_TOLERANCE = 0.10
ACTIVATION_TOLERANCE = 0.25
# hidden 320 / intermediate 320: every matrix >= 1e5 elements (DeepSpeed's persistence threshold), see test_sharding
MEASURED_MODEL = {"hidden_size": 320, "intermediate_size": 320, "num_hidden_layers": 2, "vocab_size": 320}
MEASURED_LABELS = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp2": "fsdp"}


def _rows(result) -> dict:
    return {row.label: row for row in result.rows}


# ---------------------------------------------------------------------------------------------- published figures
def test_zero_paper_worked_example():
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, Nd = 64, mixed-precision Adam (K = 12)."""
    model = model_from_sizes(parameters=7_500_000_000, layers=32, hidden=4096, heads=32, vocab=50_000)
    rows = _rows(plan(model, Hardware(gpus_per_node=8, nodes=8), Workload(precision="bf16")))
    published = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    # ZeRO-2's row also holds the one gradient that straddles two partitions whole (measured; not in the paper)
    straddling = {"zero2": 2 * model.largest_layer_parameters}
    ours = {label: round((rows[label].model_states - straddling.get(label, 0)) / GB, 1) for label in published}
    assert ours == published


def test_deepspeed_estimators_side_by_side():
    """DeepSpeed's estimators equal ours plus what they count and the paper does not: the fp32 gradient partition
    (+4Ψ/N, ZeRO-2; ZeRO-3: 18Ψ/N against our 16Ψ/N) and, for ZeRO-3, 4 bytes × the largest layer."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = model_from_sizes(parameters=7_500_000_000, layers=32, hidden=4096, heads=32, vocab=50_000)
    psi, largest = model.parameters, model.largest_layer_parameters
    for gpus, nodes in ((8, 1), (8, 8)):
        n = gpus * nodes
        rows = _rows(plan(model, Hardware(gpus_per_node=gpus, nodes=nodes, cpu_memory=1e15), Workload()))
        _, ds_gpu = estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=False)
        paper_zero2 = rows["zero2"].model_states - 2 * largest  # without the straddling gradient
        assert ds_gpu == pytest.approx(paper_zero2 + 4 * psi / n, abs=1)
        ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(
            psi, gpus, nodes, cpu_offload=True, additional_buffer_factor=1.0
        )
        assert ds_gpu == pytest.approx(2 * psi)  # ours adds the bf16 gradient partition kept on the GPU
        assert rows["zero2_offload"].params == pytest.approx(ds_gpu)
        if 16 >= 4 * n:  # DeepSpeed's max(4·N, 16)·Ψ: one pinned fp32 copy per process beyond 4 GPUs
            assert ds_cpu == pytest.approx(rows["zero2_offload"].cpu_per_node)
        _, ds_gpu, ds_layer = estimate_zero3_model_states_mem_needs(psi, largest, gpus, nodes, cpu_offload=False)
        assert ds_layer == 4 * largest
        assert ds_gpu == pytest.approx(rows["zero3"].model_states + 2 * psi / n + 4 * largest, abs=1)
        ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
            psi, largest, gpus, nodes, additional_buffer_factor=1.0
        )
        assert ds_cpu == pytest.approx(rows["zero3_offload"].cpu_per_node)  # 18Ψ per node: (2+4+12)Ψ/N × GPUs
        assert ds_gpu == 4 * largest


def test_formulas_reduce_to_the_papers():
    s, b, h, a = 2048, 4, 4096, 32
    shape = {"seq": s, "micro_batch": b, "hidden": h, "heads": a, "intermediate": 4 * h, "element": 2, "mask": 1}
    assert formulas.layer_activation_bytes(**shape) == s * b * h * (34 + 5 * a * s / h)
    for t in (2, 4, 8):
        assert formulas.layer_activation_bytes(**shape, tp=t) == pytest.approx(
            s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        )
        sp = formulas.layer_activation_bytes(**shape, tp=t, sequence_parallel=True)
        assert sp == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert formulas.recomputed_layer_bytes(seq=s, micro_batch=b, hidden=h, element=2) == 2 * s * b * h
    assert formulas.all_reduce_bytes(100.0, 4) == 150.0 and formulas.all_gather_bytes(100.0, 4) == 75.0
    assert formulas.pipeline_bubble(4, 8) == 3 / 11 and formulas.pipeline_bubble(4, 8, chunks=2) == 3 / 19
    # ZeRO-3 moves ≈ 1.5× DDP's volume (bf16 states under DeepSpeed against DDP's bf16 all-reduce)
    model = model_from_sizes(parameters=1_500_000_000, layers=24, hidden=2048, heads=16, vocab=50_000)
    rows = _rows(plan(model, Hardware(gpus_per_node=8), Workload(precision="bf16")))
    zero3, zero2 = rows["zero3"].comm["intra"], rows["zero2"].comm["intra"]
    assert zero3 / zero2 == pytest.approx(1.5)


def test_parameters_counted_exactly_from_a_config(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    for kind in ("bert", "llama", "gpt2"):
        config = tiny_config(kind)
        config.save_pretrained(tmp_path / kind)
        real = AutoModelForSequenceClassification.from_config(config)
        spec = model_from_config(str(tmp_path / kind))
        assert spec.parameters == sum(p.numel() for p in real.parameters())
        assert spec.layers == 2 and spec.hidden == 32 and spec.model_type == kind
        assert model_from_config(str(tmp_path / kind / "config.json")).parameters == spec.parameters


# ---------------------------------------------------------------------------------------------- the command
def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


SIZES = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "50000"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "{tmp}"], "--model: '{tmp}' is not a local model folder with a config.json"),
        ([*SIZES, "--tp", "3"], "--tp 3 does not divide the attention heads 32"),
        (
            ["--layers", "30", "--hidden", "4096", "--heads", "32", "--vocab", "50000", "--pp", "4"],
            "--pp 4 does not divide the 30 layers",
        ),
        ([*SIZES, "--gpu-memory", "1"], "--gpu-memory 1 GB leaves nothing"),
        ([*SIZES, "--gpus-per-node", "0"], "--gpus-per-node 0: needs at least 1"),
        ([*SIZES, "--intra", "carrier-pigeon"], "--intra 'carrier-pigeon' is not a bandwidth class"),
        (["--layers", "2"], "no model: give --model"),
        ([*SIZES, "--row", "ddp"], "--row chooses what --write-configs writes"),
        ([*SIZES, "--ep", "2"], "--ep 2: custom is a dense model (no experts to split)"),
        (["--model", "{tmp}/model", "--ep", "2"], "is a dense model (no experts to split); drop --ep"),
        ([*SIZES, "--ep", "0"], "--ep 0: must be a positive integer"),
        ([*SIZES, "--write-configs", "{tmp}/out"], "--write-configs needs a model that a job can load"),
        (["--model", "{tmp}/model", "--write-configs", "{tmp}/model"], "exists and is not an empty folder"),
        (["--model", "{tmp}/model", "--write-configs", "{tmp}/out", "--row", "nope"], "is not a row of this plan"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, args, message):
    from tests.tiny import tiny_config

    tiny_config("bert").save_pretrained(tmp_path / "model")
    code, out, err = _cli(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hftrain: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]
    assert not (tmp_path / "out").exists()


def test_nothing_fits_is_an_answer(capsys):
    code, out, err = _cli(
        capsys,
        "--parameters",
        "175B",
        "--layers",
        "96",
        "--hidden",
        "12288",
        "--heads",
        "96",
        "--vocab",
        "50000",
        "--gpu-memory",
        "24",
        "--json",
    )
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["recommended"] is None and data["nearest"] is not None
    assert any("nodes" in reason and "fits" in reason for reason in data["reasons"])
    assert not any(row["fits"] for row in data["rows"])


SEVEN_B = [*SIZES, "--parameters", "7.5B", "--nodes", "8", "--micro-batch", "4", "--seq", "2048", "--accumulation", "8"]


def test_table_json_and_python_agree(capsys):
    model = model_from_sizes(parameters=7_500_000_000, layers=32, hidden=4096, heads=32, vocab=50_000)
    result = plan(model, Hardware(gpus_per_node=8, nodes=8), Workload(micro_batch=4, seq=2048, accumulation=8))
    code, out, _ = _cli(capsys, *SEVEN_B, "--json")
    data = json.loads(out)
    assert code == 0 and data["recommended"] == result.choice.label
    for row, raw in zip(result.rows, data["rows"], strict=True):
        assert (raw["label"], raw["total"], raw["comm"]) == (row.label, row.total, row.comm)
    code, table, _ = _cli(capsys, *SEVEN_B)
    assert f"{result.choice.label} *" in table and "Korthikanti" in table and "2(N−1)/N" in table
    # the bubble of a pipeline row is the 1F1B formula at m = 8 micro-batches
    pipeline = next(r for r in result.rows if r.pp == 4)
    assert pipeline.bubble == 3 / 11 and pipeline.runnable
    assert pipeline.strategy["num_microbatches"] == 8 and pipeline.strategy["schedule"] == "1f1b"
    # ZeRO-1 under pp > 1 too: each stage's Adam state sharded over its own dp group
    assert pipeline.dp > 1 and pipeline.strategy["shard_optimizer"]


# ---------------------------------------------------------------------------------------------- against measurement
def _estimate_rows(psi_model: dict, strategies: list[str]) -> dict:
    from transformers import BertConfig

    hardware = Hardware(gpus_per_node=2, gpu_memory=1e12, reserve=0, dropout_mask_bytes=4)
    work = Workload(precision="fp32", micro_batch=4, seq=32, accumulation=2, dropout=False)
    spec = _spec_from_bert({"num_attention_heads": 4, "max_position_embeddings": 64, **psi_model}, BertConfig)
    return {label: data_parallel.estimate(label, spec, work, hardware) for label in strategies}


def _spec_from_bert(settings: dict, config_class) -> object:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        config_class(num_labels=2, **settings).save_pretrained(folder)
        return model_from_config(folder)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "labels",
    [["zero2", "zero3", "fsdp2"], pytest.param(list(MEASURED_LABELS), marks=pytest.mark.slow, id="all")],
    ids=lambda labels: "-".join(labels),
)
def test_model_states_match_the_live_ranks(labels):
    """ZeRO-2/3 and FSDP2 (slow: also DDP and ZeRO-1) on 2 gloo processes, fp32, accumulation 2: the per-GPU
    estimate within 10 % of the most loaded rank (the one that must fit; ZeRO-2's ranks differ by the gradient
    straddling partitions)."""
    from tests.state_reader import measure_strategies

    runs = run_distributed(measure_strategies, nprocs=2, timeout=900, labels=labels, model=MEASURED_MODEL)
    estimates = _estimate_rows(MEASURED_MODEL, [MEASURED_LABELS[label] for label in labels])
    failures = []
    for label in labels:
        row = estimates[MEASURED_LABELS[label]]
        assert not any("error" in run[label] for run in runs), [run[label] for run in runs]
        for part, value in most_loaded(runs, label).items():
            estimate = getattr(row, part)
            if abs(estimate / value - 1) > STATE_TOLERANCE:
                failures.append(f"{label} {part}: estimate {estimate:,.0f} measured {value:,}")
    assert not failures, failures


def most_loaded(runs: list[dict], label: str) -> dict[str, int]:
    """The largest per-rank bytes of each state over the ranks and the two measuring points of a window."""
    parts = {"params": ("params",), "grads": ("grads",), "optimizer": ("optimizer", "master")}
    return {
        part: max(sum(run[label][point][k] for k in keys) for run in runs for point in ("accumulating", "at_step"))
        for part, keys in parts.items()
    }


def _measured_bert() -> object:
    """The measured BERT (``MEASURED_MODEL``, no dropout, eager attention), seeded, in training mode."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig

    torch.manual_seed(0)
    config = BertConfig(
        num_labels=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **MEASURED_MODEL,
    )
    config._attn_implementation = "eager"
    return AutoModelForSequenceClassification.from_config(config).train()


def _tensor_parallel_measurement(seq: int, micro: int, shard_optimizer: bool = False) -> dict:
    """In each rank: a tiny BERT prepared by hftrain's ``MegatronPlugin`` (tp = 2, sequence parallelism, DDP
    over dp = world/2, ZeRO-1 when ``shard_optimizer``), one AdamW step, then this rank's model-state bytes and
    the bytes its forward saves for backward."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from hftrain.config import ParallelismConfig
    from hftrain.parallel import sum_partial_grads
    from hftrain.plan.measure import model_state_bytes, saved_activation_bytes
    from hftrain.strategies.megatron.plugin import MegatronPlugin, unwrap

    dist.init_process_group("gloo")
    Accelerator(cpu=True)  # the plugin's optimizer wrapper is Accelerate's, which needs its state
    plugin = MegatronPlugin(ParallelismConfig(tp=2, sequence_parallel=True), shard_optimizer=shard_optimizer).setup()
    model = plugin.prepare_model(_measured_bert())
    optimizer = plugin.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, MEASURED_MODEL["vocab_size"], (micro, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1] * (micro // 2))
    model(input_ids=ids, labels=labels).loss.backward()
    sum_partial_grads(unwrap(model), "tp", plugin.groups.tp_group)
    optimizer.step()
    states = model_state_bytes(unwrap(model), optimizer)
    states["activations"] = saved_activation_bytes(model, lambda: model(input_ids=ids, labels=labels))
    dist.destroy_process_group()
    return states


def _check_tensor_parallel(runs: list[dict], gpus: int, seq: int, micro: int) -> None:
    """The megatron row's estimate (tp = 2 over ``gpus`` GPUs) against the most loaded rank."""
    from transformers import BertConfig

    spec = _spec_from_bert({"num_attention_heads": 4, "max_position_embeddings": 64, **MEASURED_MODEL}, BertConfig)
    hardware = Hardware(gpus_per_node=gpus, gpu_memory=1e12, reserve=0, dropout_mask_bytes=4)
    work = Workload(precision="fp32", micro_batch=micro, seq=seq, dropout=False, fused_attention=False)
    row = model_parallel.estimate(2, 1, spec, work, hardware)
    assert row.strategy == {"name": "megatron", "tp": 2, "sequence_parallel": True, "shard_optimizer": gpus > 2}
    for part in ("params", "grads", "optimizer"):
        assert getattr(row, part) == pytest.approx(max(r[part] for r in runs), rel=STATE_TOLERANCE), part
    assert row.activations == pytest.approx(max(r["activations"] for r in runs), rel=ACTIVATION_TOLERANCE)


@pytest.mark.distributed
def test_tensor_parallel_estimate_matches_the_live_ranks():
    """tp = 2 with sequence parallelism on 2 gloo processes: model states within 10 %, activations within 25 %."""
    runs = run_distributed(_tensor_parallel_measurement, nprocs=2, timeout=600, seq=32, micro=4)
    _check_tensor_parallel(runs, 2, seq=32, micro=4)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_and_data_parallel_estimate_matches_four_live_ranks():
    """tp = 2 × dp = 2 with ZeRO-1 (shard_optimizer) on 4 gloo processes: Adam's state halves again."""
    runs = run_distributed(_tensor_parallel_measurement, nprocs=4, timeout=900, seq=32, micro=4, shard_optimizer=True)
    _check_tensor_parallel(runs, 4, seq=32, micro=4)


def _pipeline_measurement(tp: int, pp: int, seq: int, micro: int, microbatches: int) -> dict:
    """In each rank: the tiny BERT split over tp (no sequence parallelism: the stages do not split the
    sequence) and into ``pp`` stages the way
    hftrain's pipeline runtime builds them (``apply_tensor_parallel``, ``build_stage_modules``), one 1F1B
    training step over ``microbatches`` micro-batches of ``micro``, one AdamW step on this rank's stage
    parameters, then the model-state bytes of this rank's stage modules and optimizer."""
    import torch
    import torch.distributed as dist

    from hftrain.config import ParallelismConfig
    from hftrain.parallel import apply_tensor_parallel, build_schedule, build_stage_modules, sum_partial_grads
    from hftrain.plan.measure import model_state_bytes
    from hftrain.strategies.megatron.plugin import MegatronPlugin

    dist.init_process_group("gloo")
    layout = MegatronPlugin(ParallelismConfig(tp=tp, pp=pp)).setup().groups
    model = _measured_bert()
    model = apply_tensor_parallel(model, tp_group=layout.tp_group, sequence_parallel=False)
    stages = build_stage_modules(model, pp_rank=layout.pp_rank, pp=pp)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().view(-1, 2), labels.view(-1))

    schedule = build_schedule(
        "1f1b",
        stages,
        pp_group=layout.pp_group,
        pp_rank=layout.pp_rank,
        pp=pp,
        num_microbatches=microbatches,
        loss_fn=loss_fn,
        device=torch.device("cpu"),
    )
    held = torch.nn.ModuleList(stages)
    optimizer = torch.optim.AdamW(held.parameters(), lr=1e-3)
    batch = micro * microbatches
    ids = torch.randint(0, MEASURED_MODEL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    schedule.train_step(inputs, torch.tensor([0, 1] * (batch // 2)))
    sum_partial_grads(model, "tp", layout.tp_group)
    optimizer.step()
    states = model_state_bytes(held, optimizer)
    states["pp_rank"] = layout.pp_rank
    dist.destroy_process_group()
    return states


def _check_pipeline(runs: list[dict], tp: int, pp: int, seq: int, micro: int, microbatches: int) -> dict:
    """The megatron tp×pp row's estimate against the most loaded rank; returns the ratios (for the README)."""
    from transformers import BertConfig

    spec = _spec_from_bert({"num_attention_heads": 4, "max_position_embeddings": 64, **MEASURED_MODEL}, BertConfig)
    hardware = Hardware(gpus_per_node=tp * pp, gpu_memory=1e12, reserve=0, dropout_mask_bytes=4)
    work = Workload(precision="fp32", micro_batch=micro, seq=seq, accumulation=microbatches, dropout=False)
    row = model_parallel.estimate(tp, pp, spec, work, hardware)
    assert row.strategy["pp"] == pp and row.strategy["num_microbatches"] == microbatches
    assert not row.strategy["sequence_parallel"] and not row.strategy["shard_optimizer"]
    assert {r["pp_rank"] for r in runs} == set(range(pp))
    ratios = {}
    for part in ("params", "grads", "optimizer"):
        measured = max(r[part] for r in runs)
        ratios[part] = (getattr(row, part), measured)
        assert getattr(row, part) == pytest.approx(measured, rel=STATE_TOLERANCE), (part, ratios[part])
    return ratios


@pytest.mark.distributed
def test_pipeline_estimate_matches_the_live_stages():
    """pp = 2 on 2 gloo processes (1F1B, 2 micro-batches): the most loaded stage's model states within 10 %.

    Stage 0 holds a layer and the embeddings, stage 1 a layer and the pooler/classifier: the plan takes the
    larger of the two, which the live ranks must confirm (counting the head on stage 0 is 14 % over)."""
    runs = run_distributed(_pipeline_measurement, nprocs=2, timeout=600, tp=1, pp=2, seq=32, micro=2, microbatches=2)
    _check_pipeline(runs, 1, 2, seq=32, micro=2, microbatches=2)


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_and_pipeline_estimate_matches_four_live_ranks():
    """tp = 2 × pp = 2 on 4 gloo processes: model states within 10 %."""
    runs = run_distributed(_pipeline_measurement, nprocs=4, timeout=900, tp=2, pp=2, seq=32, micro=2, microbatches=2)
    _check_pipeline(runs, 2, 2, seq=32, micro=2, microbatches=2)


@pytest.mark.parametrize("kind, dropout", [("bert", 0.0), ("bert", 0.1), ("llama", 0.0)])
def test_activation_estimate_matches_saved_tensors(kind, dropout):
    """The bytes autograd saves in one forward of a whole tiny model (eager attention) against the estimate."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hftrain.plan.common import activation_bytes
    from hftrain.plan.measure import saved_activation_bytes
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config(kind, dropout=dropout)
    config._attn_implementation = "eager"
    model = AutoModelForSequenceClassification.from_config(config).train()
    micro, seq = 4, 48
    ids = torch.randint(3, config.vocab_size, (micro, seq))
    measured = saved_activation_bytes(model, lambda: model(input_ids=ids))
    spec = model_from_config(_saved(config))
    work = Workload(precision="fp32", micro_batch=micro, seq=seq, dropout=dropout > 0, fused_attention=False)
    estimate = activation_bytes(spec, work, Hardware(dropout_mask_bytes=4), layers=spec.layers)
    assert estimate == pytest.approx(measured, rel=ACTIVATION_TOLERANCE)


def _saved(config) -> str:
    import tempfile

    folder = tempfile.mkdtemp(prefix="hftrain-plan-")
    config.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------- --write-configs
def _launch(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "hftrain: error" in line or "Error:" in line]
    assert done.returncode == 0, "\n".join(errors[:5]) + "\n" + done.stderr[-3000:]
    return done


RUN_ARGS = ["--max_steps", "2", "--logging_steps", "1", "--log_with", "none", "--learning_rate", "1e-3"]


@pytest.mark.distributed
# The megatron row runs sequence parallelism: its export verification once crashed on an odd sequence length.
# The pp2 row: the plan's 2 micro-batches of 4 become one per-device batch of 8 in 2 pipeline micro-batches.
# zero2's row is the slow tier's (16 s): test_launch_configs starts a zero2 job from its config the same way
@pytest.mark.parametrize(
    "row", [pytest.param("zero2", marks=pytest.mark.slow), "megatron tp2·pp1·dp1", "megatron tp1·pp2·dp1"]
)
def test_written_configs_start_a_run(capsys, tiny_job, tmp_path, row):
    out = tmp_path / "configs"
    code, table, err = _cli(
        capsys,
        "--model",
        tiny_job["model"],
        "--gpus-per-node",
        "2",
        "--gpu-memory",
        "8",
        "--precision",
        "fp32",
        "--micro-batch",
        "4",
        "--seq",
        "32",
        "--accumulation",
        "2",
        "--write-configs",
        str(out),
        "--row",
        row,
    )
    assert code == 0, err
    job = out / "job.yaml"
    if "pp2" in row:
        written = yaml.safe_load(job.read_text())
        axes = written["parallelism"]  # the axes in their own section, the strategy's name in its
        assert (axes["pp"], axes["num_microbatches"], axes["schedule"]) == (2, 2, "1f1b")
        assert written["strategy"]["name"] == "megatron" and not set(written["strategy"]) & set(axes)
        assert "torchrun --nnodes 1 --nproc_per_node 2" in (out / "launch.sh").read_text()
    data = ["--train_file", tiny_job["data"], "--output_dir", str(tmp_path / "run"), *RUN_ARGS]
    if (out / "accelerate.yaml").exists():
        assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out / "accelerate.yaml")]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    _launch([*launcher, "scripts/train.py", "--config", str(job), *data])
    summary = json.loads((tmp_path / "run" / "hftrain_strategy.json").read_text())
    assert summary["strategy"] == row.split(" ")[0] and summary["world_size"] == 2
    assert summary["global_batch"] == 4 * 2 * summary["dp_size"]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_lora_parameters_are_the_adapters_hftrain_builds(tmp_path, kind):
    """LoRA's trainable count (PEFT's default query/value targets) equals the adapters ``apply_lora`` creates."""
    from tests.tiny import tiny_config, tiny_model_init

    model = tiny_model_init(kind, lora_options={"lora_r": 4})()
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    tiny_config(kind).save_pretrained(tmp_path)
    assert model_from_config(str(tmp_path)).lora_parameters(4) == adapters


def test_context_parallel_rows_split_activations_and_name_their_exchange():
    """``--cp``: megatron rows whose activations are those of s/cp positions, with the cp exchange in the
    communication and the all-to-all chosen where each GPU's heads divide by cp."""
    from hftrain.plan.model_parallel import estimate

    model = model_from_config("embedded:smollm2")
    hardware = Hardware(gpus_per_node=4, gpu_memory=80e9)
    work = Workload(micro_batch=1, seq=16384)
    whole = estimate(1, 1, model, work, Hardware(gpus_per_node=1, gpu_memory=80e9))
    rows = plan(model, hardware, work, cp=4, pp=1).rows
    assert [r.label for r in rows] == ["megatron tp1·cp4·pp1·dp1"]
    (row,) = rows
    assert "megatron tp1·cp2·pp2·dp1" in [r.label for r in plan(model, hardware, work, cp=2).rows]
    assert row.strategy["cp"] == 4 and row.strategy["cp_comm"] == "ring"  # 3 key/value heads: no all-to-all at 4
    assert row.activations == pytest.approx(whole.activations / 4, rel=0.02)
    assert row.comm["intra"] > 0  # the ring's keys and values (no gradient all-reduce: one replica)
    assert estimate(1, 1, model, work, Hardware(gpus_per_node=3, gpu_memory=80e9), cp=3).strategy["cp_comm"] == (
        "all_to_all"
    )
    # a classifier's head gathers the whole sequences' hidden states: all-gather forward, all-reduce backward
    lm = model_from_config("embedded:smollm2", task="causal_lm")
    gather = 3 * (4 - 1) / 4 * work.micro_batch * work.seq * model.hidden * work.element * work.accumulation
    extra = row.comm["intra"] - estimate(1, 1, lm, work, hardware, cp=4).comm["intra"]
    assert extra == pytest.approx(gather, rel=1e-3)  # the rest: the score head's gradient in the dp × cp all-reduce


# ---------------------------------------------------------------------------------------------- mixture of experts
# Mixtral-8x7B's sizes (its config.json), built on the meta device
MIXTRAL_8X7B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
}


def _mixtral_8x7b(tmp_path):
    from transformers import MixtralConfig

    MixtralConfig(**MIXTRAL_8X7B, num_labels=2).save_pretrained(tmp_path / "mixtral-8x7b")
    return model_from_config(str(tmp_path / "mixtral-8x7b"))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_parameters_counted_exactly_from_a_config(tmp_path, kind):
    """Ψ, the routed experts (E·3·h·I per MoE layer) and the rest of the MoE blocks against the real tiny model."""
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    config = tiny_config(kind)
    config.save_pretrained(tmp_path)
    real = AutoModelForSequenceClassification.from_config(config)
    spec = model_from_config(str(tmp_path))
    assert spec.parameters == sum(p.numel() for p in real.parameters())
    width = config.intermediate_size if kind == "mixtral" else config.moe_intermediate_size
    assert (spec.experts, spec.top_k, spec.intermediate) == (4, 2, width)
    # Qwen2-MoE's second layer is dense (mlp_only_layers)
    sparse = [0, 1] if kind == "mixtral" else [0]
    assert spec.moe_layers == len(sparse)
    assert [i for i, layer in enumerate(real.model.layers) if hasattr(layer.mlp, "experts")] == sparse
    assert spec.expert_parameters == len(sparse) * 4 * 3 * spec.hidden * width
    mlps = sum(p.numel() for layer in real.model.layers for p in layer.mlp.parameters())
    assert spec.replicated_mlp_parameters == mlps - spec.expert_parameters  # routers, shared expert, dense MLP
    outside = real.model.embed_tokens.weight.numel() + real.model.norm.weight.numel() + real.score.weight.numel()
    assert spec.embedding_parameters == outside  # the mean layer keeps Ψ − L·Ψ_layer exact with unequal layers
    assert spec.active_parameters == spec.parameters - spec.expert_parameters / 2  # top-2 of 4 experts


def test_mixtral_8x7b_counted_on_the_meta_device(tmp_path):
    """46.57B parameters (the published 46.7B less the LM head, plus a 2-label score), 12.75B active per token."""
    spec = _mixtral_8x7b(tmp_path)
    h, i, layers, v = 4096, 14336, 32, 32000
    experts = layers * 8 * 3 * h * i
    attention = 2 * h * h + 2 * h * 1024  # q, o; k, v of 8 key/value heads of 128
    per_layer = attention + 2 * h + 8 * h  # two norms, the router
    assert spec.expert_parameters == experts
    assert spec.parameters == layers * per_layer + experts + v * h + h + 2 * h == 46_571_728_896
    assert spec.active_parameters == pytest.approx(12.75e9, rel=1e-3)
    assert spec.layer_parameters == per_layer + experts / layers


def test_the_plan_offers_only_expert_layouts_that_training_takes(tmp_path):
    """Expert parallelism composes with tp, pp, dp and cp in training (ParallelDims.validate_trainable; ep × cp:
    tests/test_moe_cp.py): the plan offers ep with pp, and with a fixed --cp (cp is not searched)."""
    model = _mixtral_8x7b(tmp_path)
    hardware = Hardware(gpus_per_node=8, nodes=4)
    found = model_parallel.fixed_layouts(model, hardware)
    assert all(set(layout) == {"tp", "pp", "cp", "ep"} and layout["cp"] == 1 for layout in found)
    assert any(layout["ep"] > 1 and layout["pp"] > 1 for layout in found), found
    assert model_parallel.fixed_layouts(model, hardware, pp=2, ep=2)
    with_cp = model_parallel.fixed_layouts(model, hardware, pp=2, cp=2, ep=2)
    assert with_cp and all(layout["cp"] == 2 and layout["ep"] == 2 for layout in with_cp), with_cp


def test_expert_parallel_rows_halve_the_experts_and_state_the_all_to_all(tmp_path):
    """ep = 2 holds half of ep = 1's expert states per GPU, the rest unchanged; the all-to-all is the formula."""
    model = _mixtral_8x7b(tmp_path)
    hardware = Hardware(gpus_per_node=8, nodes=4)
    work = Workload(micro_batch=2, seq=4096, accumulation=4)
    x = model.expert_parameters
    # tp2 × pp2: the stage's 16 of 32 layers, params 4 + grads 4 + Adam 8 bytes per parameter; ZeRO-1 shards each
    # stage's Adam state over its dp 8, the experts' at ep = 2 over their dp/ep = 4 replicas (edp)
    staged = [model_parallel.estimate(2, 2, model, work, hardware, ep=ep) for ep in (1, 2)]
    assert staged[1].label == "megatron tp2·pp2·dp8·ep2" and staged[1].strategy["ep"] == 2
    assert staged[0].strategy["shard_optimizer"] and staged[1].strategy["shard_optimizer"]
    stage = x * 16 / 32
    assert staged[0].figures["experts"] == pytest.approx(stage * (4 + 4) + stage / 8 * 8)
    assert staged[1].figures["experts"] == pytest.approx(stage / 2 * (4 + 4) + stage / 2 / 4 * 8)
    assert staged[0].params - staged[1].params == pytest.approx(stage / 2 * 4)
    assert staged[0].grads - staged[1].grads == pytest.approx(stage / 2 * 4)
    # pp splits a mixture of experts (its stages pass the router loss on), with ep too (carved out of each stage's dp)
    assert staged[0].runnable and staged[1].runnable
    # tp2 at pp1 (dp 16): the experts' params and grads halve; ZeRO-1's Adam state /dp, the experts' at ep = 2 over
    # their dp/ep = 8 replicas
    one, two = (model_parallel.estimate(2, 1, model, work, hardware, ep=ep) for ep in (1, 2))
    assert two.label == "megatron tp2·pp1·dp16·ep2" and "ep" not in one.strategy and two.runnable
    assert not one.strategy["sequence_parallel"] and not two.strategy["sequence_parallel"]  # refused with experts
    assert one.strategy["shard_optimizer"] and two.strategy["shard_optimizer"]
    assert one.figures["experts"] == pytest.approx(x * (4 + 4) + x / 16 * 8)
    assert two.figures["experts"] == pytest.approx(x / 2 * (4 + 4) + x / 2 / 8 * 8)
    assert one.params - two.params == pytest.approx(x / 2 * 4) and one.grads - two.grads == pytest.approx(x / 2 * 4)
    from hftrain.plan.expert_parallel import all_to_all_bytes

    # all-to-all per MoE layer and micro-batch: dispatch + combine, forward + backward, the (ep−1)/ep leaving
    tokens, k, h, e = 2 * 4096, 2, 4096, 2
    assert one.figures["all_to_all"] == 0
    assert (
        two.figures["all_to_all"]
        == 4 * tokens * k * h * e * (2 - 1) / 2
        == all_to_all_bytes(tokens=tokens, top_k=k, hidden=h, element=e, ep=2)
    )
    # per step: m = 4 micro-batches × 32 MoE layers on the intra-node link (tp·ep = 4 consecutive GPUs), beside
    # tp's 4 all-reduces of s·b·h per layer (the gradient all-reduces, over dp 16 and dp/ep 8, cross nodes)
    sbh = 4096 * 2 * h * e
    assert two.comm["intra"] == pytest.approx(
        4 * 32 * two.figures["all_to_all"] + 4 * 32 * 4 * formulas.all_reduce_bytes(sbh, 2)
    )
    assert one.comm["intra"] == pytest.approx(4 * 32 * 4 * formulas.all_reduce_bytes(sbh, 2))
    assert "all-to-all" in two.formulas["experts"]


def test_plan_with_ep_lists_only_expert_parallel_layouts(capsys, tmp_path):
    from tests.tiny import tiny_config

    model = _mixtral_8x7b(tmp_path)
    hardware = Hardware(gpus_per_node=8, nodes=2)
    rows = plan(model, hardware, Workload(), ep=4).rows
    assert rows and all(r.size("ep") == 4 and r.label.endswith("·ep4") and r.dp % 4 == 0 for r in rows)
    default = plan(model, hardware, Workload()).rows  # every ep dividing dp and the 8 experts, ep = 1 included
    assert {r.size("ep") for r in default if r.strategy["name"] == "megatron"} == {1, 2, 4, 8}
    assert "megatron tp1·pp1·dp16·ep8" in [r.label for r in default]
    tiny_config("mixtral").save_pretrained(tmp_path / "tiny")  # 4 experts
    for args, message in (
        (["--ep", "3"], "--ep 3 does not divide the 4 experts of"),
        (["--ep", "4"], "--ep 4 divides the data-parallel size of no layout on 2 GPUs"),
    ):
        code, out, err = _cli(capsys, "--model", str(tmp_path / "tiny"), "--gpus-per-node", "2", *args)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    code, out, err = _cli(capsys, "--model", str(tmp_path / "tiny"), "--gpus-per-node", "2", "--ep", "2")
    assert code == 0 and "megatron tp1·pp1·dp2·ep2" in out and "all-to-all" in out


# ---------------------------------------------------------------------------------------------- language models
GPT2_VOCAB = 50_257
GPT2_SMALL = {"layers": 12, "hidden": 768, "heads": 12, "vocab": GPT2_VOCAB}


def _tiny_lm(tmp_path, *, tied: bool = False, vocab: int = 64, name: str = "lm"):
    """A tiny Llama language model's folder (untied by default, as Llama) and its config."""
    from tests.tiny import tiny_config

    config = tiny_config("llama", vocab_size=vocab)
    config.tie_word_embeddings = tied
    config.save_pretrained(tmp_path / name)
    return str(tmp_path / name), config


def test_language_model_logits_are_whole_on_data_parallel_rows_and_split_over_tp():
    """GPT-2 small's 50,257-token vocabulary at s = 1,024, b = 4, bf16: an LM row's activations are the classifier's
    plus s·b·V'·(e + 4)/t, V' the vocabulary padded to a multiple of t (50,258 at tp2, 50,260 at tp4)."""
    s, b, e = 1024, 4, 2
    work = Workload(micro_batch=b, seq=s, dropout=False)
    hardware = Hardware(gpus_per_node=4, gpu_memory=80e9)
    lm = model_from_sizes(parameters=None, **GPT2_SMALL, task="causal_lm")
    classifier = model_from_sizes(parameters=None, **GPT2_SMALL)
    assert lm.parameters == classifier.parameters  # 12·L·h² + V·h: the head tied to the embedding
    ddp = [data_parallel.estimate("ddp", m, work, hardware) for m in (lm, classifier)]
    assert ddp[0].activations - ddp[1].activations == s * b * GPT2_VOCAB * (e + 4) == 1_235_116_032
    for tp, padded in ((1, GPT2_VOCAB), (2, 50_258), (4, 50_260)):
        assert formulas.logits_activation_bytes(seq=s, micro_batch=b, vocab=padded, element=e, tp=tp) == (
            s * b * padded * (e + 4) / tp
        )
    for tp, padded, exact in ((2, 50_258, 617_570_304), (4, 50_260, 308_797_440)):
        rows = [model_parallel.estimate(tp, 1, m, work, hardware) for m in (lm, classifier)]
        assert rows[0].activations - rows[1].activations == s * b * padded * (e + 4) / tp == exact
        assert rows[0].runnable and rows[0].strategy["sequence_parallel"]
        assert "s·b·V'·(e + 4)/t" in rows[0].formulas["activations"]
        assert "s·b·V'" not in rows[1].formulas["activations"]
    # the plan's rows: the LM's extra activations are ÷ tp on megatron rows, whole on every data-parallel one
    rows = {m.task: _rows(plan(m, hardware, work)) for m in (lm, classifier)}
    for label, row in rows["causal_lm"].items():
        extra = row.activations - rows["sequence_classification"][label].activations
        if row.strategy["name"] != "megatron":
            assert extra == s * b * GPT2_VOCAB * (e + 4), label
        elif row.pp == 1:
            assert extra == pytest.approx(s * b * GPT2_VOCAB * (e + 4) / row.tp, rel=1e-4), label


def test_language_model_parameters_count_the_lm_head_once_when_tied(tmp_path):
    """``--task causal_lm`` counts the ``AutoModelForCausalLM`` model: a tied lm_head adds nothing to the embedding,
    an untied one V·h; under tp it is split over the vocabulary like the embedding (V'·h/t per GPU)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hftrain.plan.model_parallel import stage_parameters

    specs = {}
    for tied in (True, False):
        folder, config = _tiny_lm(tmp_path, tied=tied, name=f"tied{tied}")
        real = AutoModelForCausalLM.from_config(config)
        assert (real.lm_head.weight is real.model.embed_tokens.weight) == tied
        spec = model_from_config(folder, task="causal_lm")
        assert spec.parameters == sum(p.numel() for p in real.parameters())  # tied weights once
        assert spec.lm_head_parameters == (0 if tied else 64 * 32) and spec.task == "causal_lm"
        classifier = AutoModelForSequenceClassification.from_config(config)
        assert model_from_config(folder).parameters == sum(p.numel() for p in classifier.parameters())
        specs[tied] = spec
    vocab, hidden = 64, 32
    assert specs[False].parameters - specs[True].parameters == vocab * hidden
    assert stage_parameters(specs[False], 1, 1) == specs[False].parameters
    for tp in (2, 4):
        assert stage_parameters(specs[False], tp, 1) - stage_parameters(specs[True], tp, 1) == vocab * hidden / tp
    # under a pipeline the last stage holds the tied head's copy (place_stage_copies), as it holds an untied head
    from hftrain.plan.model_parallel import _head_per_gpu

    for tp in (1, 2):
        assert _head_per_gpu(specs[True], tp) == _head_per_gpu(specs[False], tp) == vocab * hidden / tp
    # GPT-2 ties its head: the language model is the classifier less its 2-label score (and GPT-2's has no bias)
    from tests.tiny import tiny_config

    tiny_config("gpt2").save_pretrained(tmp_path / "gpt2")
    gpt2 = model_from_config(str(tmp_path / "gpt2"), task="causal_lm")
    assert gpt2.lm_head_parameters == 0
    assert model_from_config(str(tmp_path / "gpt2")).parameters - gpt2.parameters == 2 * 32


def test_language_model_rows_are_runnable_exactly_when_the_trainer_takes_them(tmp_path):
    """A language model's row is runnable exactly when the megatron strategy's model check with ``task="causal_lm"``
    accepts its layout: every layout here, pp with cp included (``LANGUAGE_MODEL_LAYOUTS_NOT_BUILT`` is empty since
    pp × cp trains a per-token loss, issue 57); the same layouts of the classifier are runnable too."""
    from hftrain.plan.common import activation_bytes, logits_bytes
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    folder, config = _tiny_lm(tmp_path)
    lm, classifier = model_from_config(folder, task="causal_lm"), model_from_config(folder)
    assert lm.refused_layouts == () and not classifier.refused_layouts
    for tp, pp, cp in ((2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)):
        row = model_parallel.estimate(tp, pp, lm, Workload(dropout=False), Hardware(gpus_per_node=8), cp=cp)
        options = {"tp": tp, "pp": pp, "cp": cp, **({"num_microbatches": 2} if pp > 1 else {})}
        strategy = strategy_from_options(
            "megatron",
            options,
            launch=LaunchInfo(world_size=tp * pp * cp, local_world_size=tp * pp * cp),
            platform=Platform("cpu", "gloo"),
        )
        strategy.check_model(config, use_lora=False, task="causal_lm")  # accepted (a ConfigError otherwise)
        assert row.runnable and not any("formula only" in note for note in row.notes), (tp, pp, cp, row.notes)
        same = model_parallel.estimate(tp, pp, classifier, Workload(dropout=False), Hardware(gpus_per_node=8), cp=cp)
        assert same.runnable
    # under a pipeline the logits are the last stage's: its layers, one micro-batch in flight, and the logits
    work = Workload(micro_batch=2, seq=64, accumulation=4, dropout=False)
    staged = model_parallel.estimate(1, 2, lm, work, Hardware(gpus_per_node=2))
    first = activation_bytes(lm, work, Hardware(), layers=1, in_flight=2, logits=False)
    last = activation_bytes(lm, work, Hardware(), layers=1)
    assert staged.activations == max(first, last) and logits_bytes(lm, work) == 2 * 64 * 64 * 6
    result = plan(lm, Hardware(gpus_per_node=2), work)
    assert result.choice.runnable and all(r.runnable == (r.size("cp") == 1) for r in result.rows)


def test_write_configs_writes_the_language_model_task(capsys, tmp_path):
    """``--task causal_lm --write-configs`` writes ``model.task: causal_lm`` (validated as a job config); without
    ``--task`` no task is written (the default classifier); a cp row of a language model is written, and so is a
    pp·cp row (runnable since pp × cp trains a per-token loss, issue 57)."""
    folder, _ = _tiny_lm(tmp_path)
    common = ["--model", folder, "--gpus-per-node", "2", "--seq", "64", "--micro-batch", "2"]
    for task, row in (("causal_lm", "megatron tp2·pp1·dp1"), ("causal_lm", "zero2"), (None, "zero2")):
        out = tmp_path / f"out-{task}-{row.split(' ')[0]}"
        task_args = ["--task", task] if task else []
        code, table, err = _cli(capsys, *common, *task_args, "--write-configs", str(out), "--row", row)
        assert code == 0, err
        assert ("(causal_lm)" in table and "logits: causal LM" in table) == (task is not None)
        job = yaml.safe_load((out / "job.yaml").read_text())
        assert job["model"].get("task") == task and job["model"]["model_name_or_path"] == folder
    context = ["--cp", "2", "--write-configs", str(tmp_path / "cp"), "--row", "megatron tp1·cp2·pp1·dp1"]
    code, out, err = _cli(capsys, *common, "--task", "causal_lm", *context)
    assert code == 0, err
    job = yaml.safe_load((tmp_path / "cp" / "job.yaml").read_text())
    assert job["model"]["task"] == "causal_lm" and job["parallelism"]["cp"] == 2
    staged = ["--gpus-per-node", "4", "--cp", "2", "--pp", "2", "--write-configs", str(tmp_path / "pp-cp")]
    code, out, err = _cli(capsys, *common, "--task", "causal_lm", *staged, "--row", "megatron tp1·cp2·pp2·dp1")
    assert code == 0, err
    job = yaml.safe_load((tmp_path / "pp-cp" / "job.yaml").read_text())
    assert job["model"]["task"] == "causal_lm" and (job["parallelism"]["pp"], job["parallelism"]["cp"]) == (2, 2)
    code, out, _ = _cli(capsys, *common, "--task", "causal_lm", "--json")
    data = json.loads(out)
    assert data["model"]["task"] == "causal_lm" and "s·b·V'·(e + 4)/t" in data["formulas"]["logits"]


@pytest.mark.parametrize("vocab", [64, 1024])
def test_language_model_activation_estimate_matches_saved_tensors(tmp_path, vocab):
    """A tiny Llama language model (tp1, fp32, eager attention, 4 × 48): the planned activations, logits included,
    within ``ACTIVATION_TOLERANCE`` (25 %) of the bytes autograd saves in the forward and the loss
    (``hftrain.trainers.language.token_losses``: the fp32 log-softmax) plus the logits alive at the loss. At V = 1,024
    the logits term is over half of the estimate (measured ratios: 0.89 at V = 64, 0.95 at V = 1,024)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hftrain.plan.common import activation_bytes, logits_bytes
    from hftrain.plan.measure import saved_activation_bytes
    from hftrain.trainers.language import next_token_targets, token_losses

    torch.manual_seed(0)
    folder, config = _tiny_lm(tmp_path, vocab=vocab)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).train()
    micro, seq = 4, 48
    ids = torch.randint(3, vocab, (micro, seq))
    alive = {}

    def forward():
        alive["logits"] = model(input_ids=ids, use_cache=False).logits
        return token_losses(None, alive["logits"], next_token_targets(ids)).sum()

    measured = saved_activation_bytes(model, forward) + alive["logits"].nbytes
    spec = model_from_config(folder, task="causal_lm")
    work = Workload(precision="fp32", micro_batch=micro, seq=seq, dropout=False, fused_attention=False)
    estimate = activation_bytes(spec, work, Hardware(dropout_mask_bytes=4), layers=spec.layers)
    assert logits_bytes(spec, work) == micro * seq * vocab * (4 + 4)
    assert estimate == pytest.approx(measured, rel=ACTIVATION_TOLERANCE)


def test_a_layer_every_layer_runs_is_held_once_per_stage_and_run_every_layer(tmp_path):
    """ALBERT: one layer group run by all L layers. The plan counts its weights once (Ψ at pp = 1), once on every
    pipeline stage (as the stages hold it: counted from the real chunks), and its compute L times."""
    from transformers import AutoModelForSequenceClassification

    from hftrain.parallel import build_stage_modules
    from hftrain.plan.model_parallel import stage_parameters
    from tests.tiny import tiny_config

    config = tiny_config("albert", num_layers=4)
    config.save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_config(config)
    spec = model_from_config(str(tmp_path))
    assert (spec.layers, spec.held_layers) == (4, 1)
    assert spec.parameters == sum(p.numel() for p in model.parameters())
    assert stage_parameters(spec, 1, 1) == spec.parameters
    for pp in (2, 4):
        held = []
        for rank in range(pp):
            chunks = build_stage_modules(model, pp_rank=rank, pp=pp)
            held.append(sum({id(p): p.numel() for chunk in chunks for p in chunk.parameters()}.values()))
        assert stage_parameters(spec, 1, pp) == max(held), (pp, held)
    assert spec.active_parameters == spec.parameters + 3 * spec.layer_parameters


def test_the_planner_names_each_axis_beyond_tp_and_pp_in_its_own_term_module_only():
    """Issue 56: every axis beyond tp, pp and dp is one term (``hftrain.plan.terms.TERMS``) in its own module, and the
    generic planner names none (``scripts/axis_reach.py``: no other file of ``hftrain/plan`` names cp or ep); an
    unknown axis given to the estimator is refused; ``--json`` rows keep each term's size and figures as keys."""
    import importlib.util

    from hftrain.parallel.dims import AXIS_SIZES
    from hftrain.plan.report import plan_dict
    from hftrain.plan.terms import TERMS

    root = Path(__file__).resolve().parent.parent
    assert {term.axis for term in TERMS} == set(AXIS_SIZES) - {"tp", "pp"}
    assert {type(term).__module__ for term in TERMS} == {
        "hftrain.plan.context_parallel",
        "hftrain.plan.expert_parallel",
    }
    spec = importlib.util.spec_from_file_location("axis_reach", root / "scripts" / "axis_reach.py")
    reach = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reach)
    for axis in ("cp", "ep"):
        assert not [path for path in reach.reach(axis) if path.startswith("plan/")], axis
    model = model_from_config("embedded:smollm2")
    with pytest.raises(TypeError, match="'xp' is not a term's axis"):
        model_parallel.estimate(1, 1, model, Workload(), Hardware(gpus_per_node=2), xp=2)
    row = plan_dict(plan(model, Hardware(gpus_per_node=4), Workload(seq=4096), cp=2))["rows"][0]
    keys = list(row)
    assert keys[keys.index("working") + 1 : keys.index("working") + 5] == ["cp", "ep", "experts", "all_to_all"]
    assert (row["cp"], row["ep"], row["experts"], row["all_to_all"]) == (2, 1, 0.0, 0.0)
    assert "sizes" not in row and "figures" not in row


def test_expert_parallel_rows_of_a_task_that_refuses_ep_are_formula_only(tmp_path):
    """A task whose record does not run ep yet (token classification: ``megatron_axes_not_built``) gets ep > 1 rows
    marked formula-only, as the trainer refuses them; its ep = 1 rows stay runnable."""
    from transformers import MixtralConfig

    MixtralConfig(**MIXTRAL_8X7B, num_labels=2).save_pretrained(tmp_path / "mixtral-8x7b")
    model = model_from_config(str(tmp_path / "mixtral-8x7b"), task="token_classification")
    hardware, work = Hardware(gpus_per_node=8, nodes=4), Workload(micro_batch=2, seq=4096, accumulation=4)
    one, two = (model_parallel.estimate(2, 1, model, work, hardware, ep=ep) for ep in (1, 2))
    assert one.runnable and not two.runnable
    assert "formula only: hftrain's trainer takes no ep for model.task token_classification yet" in two.notes[0]
