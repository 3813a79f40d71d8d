"""Pipeline schedules on 2 real gloo processes (pp=2) against a single-process reference.

One launch covers every schedule (gpipe, 1f1b, interleaved_1f1b with 2 virtual stages) and every model family
(BERT, GPT-2, Llama; 4 tiny layers): per-step loss, every gradient, gradient accumulation over two steps,
a changed sequence length, eval logits (with a batch that the micro-batch count does not divide), and the
recorded timeline with its PNG.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed

KINDS = ("bert", "gpt2", "llama")
CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2))
MICROBATCHES = 4


def four_layer_model(kind: str, seed: int = 0):
    """A tiny 4-layer classifier, the same on every process (seeded)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    config = tiny_config(kind)
    config.num_hidden_layers = 4  # GPT-2's n_layer is an alias of it
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def make_batch(batch: int, seq: int, seed: int):
    """Token ids with right padding of varying length (pad id 0 in all tiny tokenizers) and labels."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(batch):
        keep = int(torch.randint(2, seq + 1, (1,), generator=gen))
        ids[row, keep:], mask[row, keep:] = 0, 0
    labels = torch.randint(0, 2, (batch,), generator=gen)
    return {"input_ids": ids, "attention_mask": mask}, labels


def cross_entropy(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits, labels)


def reference(kind: str) -> dict:
    """Single-process losses, gradients (two accumulated batches) and eval logits."""
    model = four_layer_model(kind)
    batches = [make_batch(8, 12, 1), make_batch(8, 9, 2)]  # second batch: another sequence length
    losses = []
    for inputs, labels in batches:
        loss = cross_entropy(model(**inputs).logits, labels)
        loss.backward()  # accumulates, as the pipeline must
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    inputs, _ = make_batch(6, 10, 3)
    return {"losses": losses, "grads": grads, "logits": model(**inputs).logits.detach()}


def pipeline_run(kind: str, schedule: str, virtual_stages: int) -> dict:
    """This rank's part of the same computation through ``schedule`` on pp=2."""
    import torch.distributed as dist

    from hftrain.errors import ConfigError
    from hftrain.parallel import SCHEDULES, TimelineRecorder, build_schedule, build_stage_modules

    rank = dist.get_rank()
    model = four_layer_model(kind)
    layout = SCHEDULES[schedule].layout  # which chunks this rank holds ("v" for ZBV)
    chunks = build_stage_modules(model, pp_rank=rank, pp=2, virtual_stages=virtual_stages, layout=layout)
    recorder = TimelineRecorder(rank)
    pipe = build_schedule(
        schedule,
        chunks,
        pp_group=dist.group.WORLD,
        pp_rank=rank,
        pp=2,
        num_microbatches=MICROBATCHES,
        loss_fn=cross_entropy,
        device="cpu",
        recorder=recorder,
    )
    losses = []
    for seed, seq in ((1, 12), (2, 9)):
        inputs, labels = make_batch(8, seq, seed)
        # each rank gets only what its stages need: inputs on the first, labels on the last
        loss = pipe.train_step(inputs if pipe.is_first else None, labels if pipe.is_last else None)
        losses.append(None if loss is None else loss.item())
    grads = {chunk.hf_name(n): p.grad.clone() for chunk in chunks for n, p in chunk.named_parameters()}
    model.eval()
    inputs, _ = make_batch(6, 10, 3)
    logits = pipe.eval_step(inputs if pipe.is_first else None, None)
    # a training batch the micro-batch count does not divide is refused on every rank (the shape is shared)
    refused = None
    try:
        bad, labels = make_batch(6, 10, 4)
        pipe.train_step(bad if pipe.is_first else None, labels if pipe.is_last else None)
    except ConfigError as error:
        refused = str(error)
    return {"losses": losses, "grads": grads, "logits": logits, "events": recorder.events, "refused": refused}


def all_pipeline_runs() -> dict:
    """Every (family, schedule) case in one process group."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {(k, s): pipeline_run(k, s, v) for k in KINDS for s, v in CASES}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(all_pipeline_runs, nprocs=2, timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", [s for s, _ in CASES])
def test_schedule_matches_single_process(runs, kind, schedule):
    import torch

    from hftrain.parallel import SCHEDULES

    ref = reference(kind)
    last_rank = 0 if SCHEDULES[schedule].layout == "v" else 1  # ZBV's V ends on rank 0
    last, other = runs[last_rank][(kind, schedule)], runs[1 - last_rank][(kind, schedule)]
    assert other["losses"] == [None, None] and other["logits"] is None
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-7)
    grads = {**other["grads"], **last["grads"]}
    assert set(grads) == set(ref["grads"])  # every parameter owned by exactly one rank ...
    assert not set(other["grads"]) & set(last["grads"])  # ... and not by both
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(last["logits"], ref["logits"], rtol=1e-5, atol=1e-6)
    for result in (other, last):
        assert "num_microbatches=4 does not divide the per-step batch of 6" in result["refused"]


@pytest.mark.distributed
def test_timeline_png_and_bubble(runs, tmp_path):
    from hftrain.parallel import SCHEDULES, measured_bubble, render_timeline, theoretical_bubble
    from hftrain.parallel.pipeline import chunk_ids_of_rank

    for schedule, v in CASES:
        events = runs[0][("bert", schedule)]["events"] + runs[1][("bert", schedule)]["events"]
        last_step = [e for e in events if e.step == 1]
        # every micro-batch ran forward and backward (zero bubble: and its weight pass) once on every chunk
        kinds = "FBW" if schedule in ("interleaved_zb", "zbv") else "FB"
        assert sorted((e.chunk, e.microbatch, e.kind) for e in last_step) == sorted(
            (c, m, k) for c in range(2 * v) for m in range(MICROBATCHES) for k in kinds
        )
        layout = SCHEDULES[schedule].layout
        assert all(e.chunk in chunk_ids_of_rank(e.rank, pp=2, virtual_stages=v, layout=layout) for e in events)
        png = render_timeline(
            events,
            tmp_path / f"{schedule}.png",
            schedule=schedule,
            pp=2,
            num_microbatches=MICROBATCHES,
            virtual_stages=v,
        )
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        # Stated tolerance: the measured bubble is at least half the formula's (a schedule cannot beat it by
        # more than timing noise; zero bubble aims below it, so 0 there) and below 0.9 (tiny stages on a shared
        # 2-core machine are dominated by overheads and waits). benchmarks/pipeline.py measures it against the
        # formula with even, compute-bound stages.
        bubble = measured_bubble(events)
        floor = 0.0 if schedule in ("interleaved_zb", "zbv") else 0.5 * theoretical_bubble(2, MICROBATCHES, v)
        assert floor < bubble < 0.9, (schedule, bubble)
