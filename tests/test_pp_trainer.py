"""Pipeline parallelism in the ``megatron`` strategy: PP, TP × PP and TP × PP × DP through the Trainer.

Three launches carry the multi-process checks, each covering all three schedules and spreading the nine
model × schedule combinations over the layouts (every combination once, every schedule at every layout):
- 2 processes, pp=2 (plus GPT-2 with the zero-bubble V schedule);
- 4 processes, tp=2 × pp=2, plus interrupted-then-resumed and the pp=2 checkpoint resumed at pp=1 (tp=2 × dp=2);
- 8 processes, tp=2 × pp=2 × dp=2;
and one process for the references (DDP, the whole global batch). Each run equals its reference within 1e-5
relative loss over 10 steps. A real ``torchrun`` job at tp=2 × pp=2 exports a model plain transformers reloads
with the trained logits and draws its pipeline timeline, and ``hftrain export`` exports its checkpoint; bad input
is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hftrain.checkpoint.sharded import read_model_tensors
from tests.conftest import torchrun
from tests.distributed import run_distributed
from tests.megatron_runs import (
    assert_resumed_equals_uninterrupted,
    assert_same_weights,
    megatron_job_args,
    refused_as_launched_rank0,
)
from tests.tiny import run_tiny_training, synthetic_texts, tiny_config, tiny_tokenizer

LAYERS = 4  # 2 stages × 2 virtual stages for the interleaved schedule
INTERLEAVED = {"schedule": "interleaved_1f1b", "virtual_stages": 2}
SCHEDULES = {"gpipe": {"schedule": "gpipe"}, "1f1b": {"schedule": "1f1b"}, "interleaved": INTERLEAVED}
ZBV = {"zbv": {"schedule": "zbv", "virtual_stages": 2}}  # zero-bubble V: one registry entry, through the Trainer too
# layout -> (processes, per-device micro-batch, micro-batches, strategy options, cases (kind, schedule, accumulation))
LAYOUTS = {
    "pp2": (
        2, 8, 4, {"pp": 2}, [("bert", "gpipe", 1), ("gpt2", "1f1b", 2), ("llama", "interleaved", 1), ("gpt2", "zbv", 1)]
    ),
    "tp2pp2": (4, 8, 4, {"tp": 2, "pp": 2}, [("gpt2", "gpipe", 1), ("llama", "1f1b", 1), ("bert", "interleaved", 2)]),
    "tp2pp2dp2": (
        8, 4, 2, {"tp": 2, "pp": 2}, [("llama", "gpipe", 2), ("bert", "1f1b", 1), ("gpt2", "interleaved", 1)]
    ),
}  # fmt: skip
GLOBAL_MICRO = 8  # examples per micro-step over all data-parallel replicas
# 96 examples, global batch 16: 6 steps per epoch; step 8 is mid-epoch 1.
RESUME = {"kind": "gpt2", "gas": 2, "steps": 12, "save_steps": 5, "return_weights": True, "num_layers": LAYERS}


def _options(layout: str, schedule: str) -> dict:
    _, _, microbatches, options, _ = LAYOUTS[layout]
    return {**options, "num_microbatches": microbatches, **{**SCHEDULES, **ZBV}[schedule]}


def _parity(layout: str) -> dict:
    _, micro, _, _, cases = LAYOUTS[layout]
    return {
        case: run_tiny_training(
            kind=case[0], gas=case[2], micro=micro, steps=10, strategy="megatron",
            strategy_options=_options(layout, case[1]), num_layers=LAYERS,
        )
        for case in cases
    }  # fmt: skip


def _pp2(root: str) -> dict:
    return {"parity": _parity("pp2")}


def _tp2pp2(root: str) -> dict:
    parity = _parity("tp2pp2")
    common = {**RESUME, "strategy": "megatron", "micro": 8}
    options = {"tp": 2, "pp": 2, "num_microbatches": 4, "schedule": "1f1b"}
    full = run_tiny_training(output_dir=f"{root}/full", strategy_options=options, **common)
    part = run_tiny_training(output_dir=f"{root}/part", strategy_options=options, stop_at_step=8, **common)
    resumed = run_tiny_training(
        output_dir=f"{root}/part", strategy_options=options, resume_from_checkpoint="latest", **common
    )
    # the pp=2 checkpoint at tp=2 × pp=1 × dp=2 (micro 4 keeps the global batch at 16)
    at_pp1 = run_tiny_training(
        output_dir=f"{root}/pp1", strategy_options={"tp": 2}, trust_external_checkpoint=True,
        resume_from_checkpoint=f"{root}/part/checkpoints/step_00000008", **{**common, "micro": 4},
    )  # fmt: skip
    layout = json.loads(Path(root, "part", "checkpoints", "step_00000008", "state", "sharded.json").read_text())
    return {"parity": parity, "full": full, "part": part, "resumed": resumed, "pp1": at_pp1, "layout": layout}


def _tp2pp2dp2(root: str) -> dict:
    return {"parity": _parity("tp2pp2dp2")}


def _references(root: str) -> dict:
    cases = {(kind, gas) for *_, layout_cases in LAYOUTS.values() for kind, _, gas in layout_cases}
    return {
        case: run_tiny_training(kind=case[0], gas=case[1], micro=GLOBAL_MICRO, steps=10, num_layers=LAYERS)
        for case in sorted(cases)
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("megatron_pp"))
    (reference,) = run_distributed(_references, nprocs=1, timeout=900, root=root)
    return {
        "reference": reference,
        "pp2": run_distributed(_pp2, nprocs=2, timeout=900, root=root),
        "tp2pp2": run_distributed(_tp2pp2, nprocs=4, timeout=1500, root=root),
        "tp2pp2dp2": run_distributed(_tp2pp2dp2, nprocs=8, timeout=1500, root=root),
    }


def _assert_parity(run: dict, ref: dict, *, rel: float = 1e-5) -> None:
    assert len(run["losses"]) == len(ref["losses"]) == 10
    assert run["losses"] == pytest.approx(ref["losses"], rel=rel)
    assert run["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
    assert run["samples_seen"] == ref["samples_seen"]  # counted per data-parallel replica, not per process
    assert run["metrics"]["eval_samples"] == 25  # each validation example once, through the pipeline
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the loss moved


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout,case",
    [(layout, case) for layout, (*_, cases) in LAYOUTS.items() for case in cases],
    ids=[f"{layout}-{k}-{s}-gas{g}" for layout, (*_, cases) in LAYOUTS.items() for k, s, g in cases],
)
def test_loss_trajectory_matches_single_process(runs, layout, case):
    ranks = runs[layout]
    assert len(ranks) == LAYOUTS[layout][0]
    ref = runs["reference"][(case[0], case[2])]
    for rank in ranks:  # the last stage's loss reached every rank of every stage
        _assert_parity(rank["parity"][case], ref)


def test_every_model_and_schedule_is_covered_at_every_layout():
    combinations = [(k, s) for *_, cases in LAYOUTS.values() for k, s, _ in cases if s in SCHEDULES]
    assert sorted(combinations) == sorted((k, s) for k in ("bert", "gpt2", "llama") for s in SCHEDULES)
    for *_, cases in LAYOUTS.values():
        assert {s for _, s, _ in cases} >= set(SCHEDULES)


@pytest.mark.distributed
def test_resumed_equals_uninterrupted_under_tp2_pp2(runs):
    assert_resumed_equals_uninterrupted(runs["tp2pp2"])  # weights merged from the tp shards and the pp stages
    assert runs["tp2pp2"][0]["layout"] == {
        "format": "hftrain-dcp-v1",
        "tp": 2,
        "cp": 1,
        "pp": 2,
        "dp": 1,
        "world_size": 4,
    }


@pytest.mark.distributed
def test_pp2_checkpoint_resumes_at_pp1_equal_to_continuing_at_pp2(runs):
    full, at_pp1 = runs["tp2pp2"][0]["full"], runs["tp2pp2"][0]["pp1"]
    assert at_pp1["global_step"] == 12
    assert at_pp1["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert at_pp1["lrs"] == pytest.approx(full["lrs"], rel=1e-9)
    assert_same_weights(at_pp1["weights"], full["weights"], atol=1e-5)


# ----------------------------------------------------------------- a real job: torchrun, export, timeline
@pytest.fixture(scope="module")
def pp_job(tmp_path_factory) -> dict[str, str]:
    """Tiny GPT-2 (2 layers) and BERT (2 and 5 layers) model folders and a small labelled CSV."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("megatron_pp_job")
    configs = {"gpt2": tiny_config("gpt2"), "bert": tiny_config("bert"), "bert5": tiny_config("bert", num_layers=5)}
    for name, config in configs.items():
        AutoModelForSequenceClassification.from_config(config).save_pretrained(root / name)
        tiny_tokenizer("gpt2" if name == "gpt2" else "bert").save_pretrained(root / name)
    texts, labels = synthetic_texts(80, seed=1)
    csv = root / "train.csv"
    csv.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels, strict=True)))
    return {**{name: str(root / name) for name in configs}, "data": str(csv)}


@pytest.mark.distributed
def test_tp2_pp2_job_exports_a_reloadable_model_and_draws_its_timeline(pp_job, tmp_path):
    from transformers import AutoModelForSequenceClassification

    output_dir = tmp_path / "out"
    pipeline = ["--tp", "2", "--pp", "2", "--num_microbatches", "4", "--schedule", "1f1b"]
    done = torchrun(4, ["scripts/train.py", *megatron_job_args(pp_job["gpt2"], pp_job["data"], output_dir, *pipeline)])
    log = done.stdout + done.stderr
    # the export reloaded the folder with plain transformers and compared logits with the trained pipeline
    diff = float(re.search(r"reloaded it: max logit difference (\S+)", log).group(1))
    assert diff <= 1e-5
    strategy = json.loads((output_dir / "hftrain_strategy.json").read_text())
    assert (strategy["tp"], strategy["pp"], strategy["dp_size"], strategy["schedule"]) == (2, 2, 1, "1f1b")
    exported = AutoModelForSequenceClassification.from_pretrained(output_dir / "model")
    final = read_model_tensors(output_dir / "checkpoints" / "step_00000004" / "state")
    state = exported.state_dict()
    assert set(final) == set(state)  # every stage's tensors, merged
    for name, tensor in final.items():
        assert torch.equal(state[name], tensor), name
    # the timeline of the last step: one row of events per stage, the bubble next to (p-1)/(m+p-1) = 1/5
    assert (output_dir / "pipeline_timeline.png").stat().st_size > 1000
    timeline = json.loads((output_dir / "pipeline_timeline.json").read_text())
    assert timeline["theoretical_bubble"] == pytest.approx(1 / 5)
    print(f"\ntp2×pp2 1f1b m=4: bubble measured {timeline['measured_bubble']:.3f}, theoretical 0.200")
    # The measured figure is wall-clock on 2 shared cores (uneven tiny stages, sends): a fraction, not a bound to
    # assert; benchmarks/ measures the formula with even stage compute. What must hold is the schedule itself.
    assert 0.0 <= timeline["measured_bubble"] < 1.0
    for rank in (0, 1):  # each stage runs its passes one after another: their order is the schedule's, not timing's
        order = [
            (e["kind"], e["microbatch"])
            for e in sorted(timeline["events"], key=lambda e: e["start"])
            if e["rank"] == rank
        ]
        assert sorted(order) == [(k, m) for k in "BF" for m in range(4)], order
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(4)), order
    first = [
        (e["kind"], e["microbatch"]) for e in sorted(timeline["events"], key=lambda e: e["start"]) if e["rank"] == 0
    ]
    assert first.index(("B", 0)) < first.index(("F", 3)), first  # 1F1B: a backward before the last forward, not GPipe
    assert {e["kind"] for e in timeline["events"]} == {"F", "B"} and {e["rank"] for e in timeline["events"]} == {0, 1}
    assert len(timeline["events"]) == 2 * 2 * 4  # F and B of 4 micro-batches on each of 2 stages
    # a tp=2 × pp=2 checkpoint exports the same way, launched like its run
    exported_dir, checkpoint = tmp_path / "exported", output_dir / "checkpoints" / "step_00000002"
    torchrun(4, ["-m", "hftrain", "export", str(checkpoint), str(exported_dir), "--output_dir", str(output_dir)])
    reloaded = AutoModelForSequenceClassification.from_pretrained(exported_dir).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in read_model_tensors(checkpoint / "state").items())


def _bad_input_cases(job: dict[str, str]) -> dict[str, tuple[list[str], str, str]]:
    """label -> (extra arguments, WORLD_SIZE, expected message part)."""
    return {
        "tp-pp-not-dividing-world": (["--tp", "2", "--pp", "2"], "2", "parallelism.tp: tp=2 × pp=2 does not divide"),
        "more-stages-than-layers": (["--pp", "4"], "4", "parallelism.pp: pp × virtual_stages = 4 pipeline"),
        "microbatches-not-dividing-batch": (["--pp", "2", "--num_microbatches", "3"], "2", "does not divide training."),
        "fewer-microbatches-than-stages": (["--pp", "2", "--num_microbatches", "1"], "2", ">= pp (1 < 2)"),
        "virtual-stages-not-dividing-layers": (
            ["--model_name_or_path", job["bert5"], "--pp", "2", *_interleaved(2)],
            "2",
            "parallelism.virtual_stages: virtual_stages=2",
        ),
        "interleaved-one-stage": (_interleaved(1), "1", "'interleaved_1f1b' needs pp >= 2"),
        "virtual-stages-without-interleaving": (["--pp", "2", "--virtual_stages", "2"], "2", "set virtual_stages: 1"),
        "unknown-schedule": (["--pp", "2", "--schedule", "zigzag"], "2", "parallelism.schedule: schedule must be one"),
        "pp-with-ddp": (["--pp", "2", "--strategy.name", "ddp"], "2", "parallelism.pp is a megatron option"),
        "pp-with-sequence-parallel": (
            ["--tp", "2", "--pp", "2", "--sequence_parallel", "true"], "4", "parallelism.sequence_parallel with"
        ),
    }  # fmt: skip


def _interleaved(virtual_stages: int) -> list[str]:
    return ["--schedule", "interleaved_1f1b", "--virtual_stages", str(virtual_stages)]


@pytest.mark.parametrize("label", list(_bad_input_cases({"bert5": ""})))
def test_bad_input_is_one_line_exit_2_nothing_written(pp_job, tmp_path, capsys, monkeypatch, label):
    extra, world_size, message = _bad_input_cases(pp_job)[label]
    refused_as_launched_rank0(monkeypatch, capsys, tmp_path, pp_job["bert"], pp_job["data"], extra, world_size, message)
