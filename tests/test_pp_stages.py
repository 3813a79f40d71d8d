"""Pipeline stage splitting: layer ranges, refusals, and chunks that reproduce the unsharded model exactly."""

from __future__ import annotations

import pytest

from hftrain.errors import ConfigError
from hftrain.parallel.pipeline import chunk_ids_of_rank, stage_layer_ranges
from tests.tiny import FAMILY_KINDS


def test_ranges_by_layer_count():
    assert stage_layer_ranges(4, pp=2) == [range(0, 2), range(2, 4)]
    # extra layers go to the last stages (the first also embeds)
    assert stage_layer_ranges(7, pp=3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert stage_layer_ranges(5, pp=5) == [range(i, i + 1) for i in range(5)]
    assert stage_layer_ranges(3, pp=1) == [range(0, 3)]


def test_ranges_interleaved_assignment():
    ranges = stage_layer_ranges(8, pp=2, virtual_stages=2)
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # chunk c lives on pipeline rank c % pp: rank 0 runs layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7
    assert chunk_ids_of_rank(0, pp=2, virtual_stages=2) == [0, 2]
    assert chunk_ids_of_rank(1, pp=2, virtual_stages=2) == [1, 3]
    assert [ranges[c] for c in chunk_ids_of_rank(0, pp=2, virtual_stages=2)] == [range(0, 2), range(4, 6)]


def test_ranges_by_parameters():
    # a heavy first layer (embeddings counted into it) gets a stage of its own
    assert stage_layer_ranges(4, pp=2, balance="parameters", layer_sizes=[10, 3, 3, 3]) == [range(0, 1), range(1, 4)]
    assert stage_layer_ranges(6, pp=3, balance="parameters", layer_sizes=[4, 1, 1, 1, 1, 4]) == [
        range(0, 1),
        range(1, 5),
        range(5, 6),
    ]
    # equal sizes: the same split as by count, or as good (max part minimal)
    ranges = stage_layer_ranges(6, pp=3, balance="parameters", layer_sizes=[2] * 6)
    assert [len(r) for r in ranges] == [2, 2, 2]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 2, "pp": 3}, "only 2 layers"),
        ({"num_layers": 4, "pp": 2, "virtual_stages": 3}, "6 pipeline stages"),
        ({"num_layers": 6, "pp": 2, "virtual_stages": 2}, "virtual_stages=2"),
        ({"num_layers": 4, "pp": 1, "virtual_stages": 2}, "needs pp > 1"),
        ({"num_layers": 4, "pp": 0}, "pp must be >= 1"),
        ({"num_layers": 4, "pp": 2, "balance": "flops"}, "balance"),
        ({"num_layers": 4, "pp": 2, "balance": "parameters"}, "layer_sizes"),
    ],
)
def test_ranges_refused(kwargs, field):
    num_layers = kwargs.pop("num_layers")
    with pytest.raises(ConfigError, match=field) as info:
        stage_layer_ranges(num_layers, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("1f1b", {"pp": 4, "num_microbatches": 2}, "num_microbatches >= pp"),
        ("gpipe", {"pp": 2, "num_microbatches": 4, "virtual_stages": 2}, "one stage per rank"),
        ("interleaved_1f1b", {"pp": 1, "num_microbatches": 4, "virtual_stages": 2}, "needs pp >= 2"),
        ("interleaved_1f1b", {"pp": 2, "num_microbatches": 3, "virtual_stages": 2}, "multiple of pp"),
        ("zigzag", {"pp": 2, "num_microbatches": 4}, "one of gpipe, 1f1b, interleaved_1f1b"),
        ("gpipe", {"pp": 2, "num_microbatches": 0}, "num_microbatches must be >= 1"),
    ],
)
def test_schedule_settings_refused(name, kwargs, message):
    from hftrain.parallel import check_schedule

    with pytest.raises(ConfigError, match=message):
        check_schedule(name, **kwargs)


def _model(kind: str, layers: int):
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    config = tiny_config(kind, num_layers=layers)  # per-layer types (sliding windows) follow the layer count
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def _batch():
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (5, 11), generator=gen)
    mask = torch.ones_like(ids)
    for row, keep in enumerate([11, 7, 3, 9, 1]):  # right padding of different lengths (pad id 0)
        ids[row, keep:], mask[row, keep:] = 0, 0
    return ids, mask, torch.tensor([0, 1, 1, 0, 1])


STAGED_KINDS = ["bert", "gpt2", "llama", *FAMILY_KINDS]
LAYOUTS = [(2, 1, "layers"), (3, 1, "parameters"), (2, 2, "layers")]


@pytest.mark.parametrize(
    ("kind", "pp", "virtual_stages", "balance"),
    [("bert", *layout) for layout in LAYOUTS] + [(kind, 2, 2, "layers") for kind in STAGED_KINDS[1:]]
    + [(kind, 3, 1, "parameters") for kind in ("gpt2", "llama")],
)  # fmt: skip
def test_chunks_in_sequence_equal_model(kind, pp, virtual_stages, balance):
    """All ranks' chunks run in global order in one process give the model's logits, loss and grads exactly."""
    import torch

    from hftrain.parallel import build_stage_modules, placements

    model = _model(kind, layers=4)
    ids, mask, labels = _batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    by_index = {}
    for rank in range(pp):
        chunks = build_stage_modules(model, pp_rank=rank, pp=pp, virtual_stages=virtual_stages, balance=balance)
        for k, chunk in enumerate(chunks):
            by_index[rank + k * pp] = chunk
    assert by_index[0].is_first and by_index[pp * virtual_stages - 1].is_last
    acts = (ids, mask)
    for index in range(pp * virtual_stages):
        acts = by_index[index](*acts)
        acts = acts if isinstance(acts, tuple) else (acts,)
    (logits,) = acts
    assert torch.equal(logits, out.logits)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.equal(loss, out.loss)
    loss.backward()

    names = [name for chunk in by_index.values() for name, _ in chunk.hf_named_parameters()]
    # the weights the stage cut records as held by every pipeline rank (DeBERTa's relative embeddings, ALBERT's
    # shared layer group), under the names the model's named_parameters gives them
    shared = {n for n, r in placements(model).items() if r.copies == "pp"} & {n for n, _ in model.named_parameters()}
    assert sorted(set(names)) == sorted(n for n, _ in model.named_parameters())  # every parameter
    # each once, but the weights every chunk reads, in every chunk
    assert {n for n in names if names.count(n) > 1} == shared
    assert all(names.count(n) == len(by_index) for n in shared)
    for chunk in by_index.values():
        for name, param in chunk.named_parameters():
            # a shared weight's gradient sums the chunks' parts, in another order than one backward adds them
            exact = chunk.hf_name(name) not in shared
            tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-9}
            torch.testing.assert_close(param.grad, ref_grads[chunk.hf_name(name)], **tolerance)


ENCODERS = ("roberta", "xlm-roberta", "electra", "distilbert", "modernbert", "deberta-v2", "albert")
LM_KINDS = ["gpt2", "llama", *(k for k in FAMILY_KINDS if k not in ENCODERS)]


@pytest.mark.parametrize("kind", LM_KINDS)
def test_causal_lm_chunks_in_sequence_equal_model(kind):
    """A decoder's ``*ForCausalLM`` cut into 2 × 2 chunks, run in global order with ``(input_ids, position_ids)`` of
    packed documents (positions restarting, no attention mask): the model's logits, and its gradients, exactly; the
    activation tuple carries the positions, and every parameter (a tied one on the first and last chunk) is covered."""
    import torch
    from transformers import AutoModelForCausalLM

    from hftrain.parallel import build_stage_modules
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, num_layers=4))
    ids, _, _ = _batch()
    positions = torch.cat([torch.arange(4), torch.arange(7)]).repeat(ids.shape[0], 1)  # two documents per row
    positions[1] = torch.arange(ids.shape[1])  # one document
    out = model(input_ids=ids, position_ids=positions, use_cache=False)
    whole = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), use_cache=False)
    assert not torch.allclose(out.logits[0, 4:], whole.logits[0, 4:])  # the packed mask matters: the check can fail
    out.logits.float().pow(2).mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    by_index = {}
    for rank in range(2):
        for k, chunk in enumerate(build_stage_modules(model, pp_rank=rank, pp=2, virtual_stages=2, head="causal_lm")):
            by_index[rank + k * 2] = chunk
    acts = (ids, positions)
    for index in range(4):
        acts = by_index[index](*acts)
        if index < 3:  # a mixture of experts' chunks add their routing sums (C, P, R) at the tuple's end
            assert len(acts) == (5 if kind == "qwen3_moe" else 2) and torch.equal(acts[1], positions)
    assert torch.equal(acts, out.logits)
    acts.float().pow(2).mean().backward()
    names = {name for chunk in by_index.values() for name, _ in chunk.hf_named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=0, atol=0)


def test_parameter_balance_moves_layers_off_the_embedding_stage():
    from hftrain.parallel import build_stage_modules

    model = _model("bert", layers=4)
    model.bert.embeddings.word_embeddings.weight.data = model.bert.embeddings.word_embeddings.weight.data.repeat(60, 1)
    by_layers = build_stage_modules(model, pp_rank=0, pp=2, balance="layers")[0]
    by_params = build_stage_modules(model, pp_rank=0, pp=2, balance="parameters")[0]
    assert list(by_layers.layers) == ["0", "1"]
    assert list(by_params.layers) == ["0"]


def test_unsupported_model_refused():
    import torch

    from hftrain.parallel import build_stage_modules

    with pytest.raises(ConfigError, match="pipeline parallelism has no entry for model type None"):
        build_stage_modules(torch.nn.Linear(2, 2), pp_rank=0, pp=2)


def test_bubble_formulas_and_measurement_on_an_ideal_timeline():
    """An ideal GPipe timeline (F = 1, B = 2, no communication cost) measures exactly (p-1)/(m+p-1)."""
    from hftrain.parallel import measured_bubble, theoretical_bubble
    from hftrain.parallel.timeline import Event

    assert theoretical_bubble(4, 8) == 3 / 11
    assert theoretical_bubble(2, 4, virtual_stages=2) == 1 / 9
    p, m = 2, 4
    events = [Event(0, r, r, i, "F", i + r, i + r + 1) for r in range(p) for i in range(m)]
    last_forward_end = m + p - 1
    for r in range(p):
        for i in range(m):
            # the last stage starts backward after its last forward; each earlier stage waits for the later one
            start = last_forward_end + 2 * i + 2 * (p - 1 - r)
            events.append(Event(0, r, r, i, "B", start, start + 2))
    assert measured_bubble(events) == pytest.approx(theoretical_bubble(p, m))


def test_recorder_keeps_recent_steps_only():
    from hftrain.parallel import TimelineRecorder

    recorder = TimelineRecorder(pp_rank=1, max_steps=2)
    for _ in range(5):
        recorder.begin_step()
        recorder.record(chunk=1, microbatch=0, kind="F", start=0.0, end=1.0)
    assert [e.step for e in recorder.events] == [3, 4]
    assert all(e.rank == 1 for e in recorder.events)


def test_v_style_and_style_mismatch_refused():
    """ZBV's V: rank r holds chunks r and 2p-1-r; stages built for another style are refused, not mis-run."""
    from hftrain.parallel import build_schedule, build_stage_modules

    assert chunk_ids_of_rank(0, pp=4, virtual_stages=2, style="v") == [0, 7]
    assert chunk_ids_of_rank(3, pp=4, virtual_stages=2, style="v") == [3, 4]
    model = _model("gpt2", layers=4)
    v_chunks = build_stage_modules(model, pp_rank=0, pp=2, virtual_stages=2, style="v")
    assert [c.index for c in v_chunks] == [0, 3] and v_chunks[0].is_first and v_chunks[1].is_last
    loop_chunks = build_stage_modules(model, pp_rank=0, pp=2, virtual_stages=2)
    options = {"pp_group": None, "pp_rank": 0, "pp": 2, "num_microbatches": 2, "loss_fn": None, "device": "cpu"}
    with pytest.raises(ConfigError, match="pass style='v' to build_stage_modules"):
        build_schedule("zbv", loop_chunks, **options)
    with pytest.raises(ConfigError, match="pass style='loop'"):
        build_schedule("interleaved_1f1b", v_chunks, **options)
    assert build_schedule("zbv", v_chunks, **options).is_last  # the V ends on rank 0


@pytest.mark.parametrize("style", ["loop", "v"])
def test_the_stage_cut_records_the_weights_several_ranks_hold(style):
    """``build_stage_modules`` records each pipeline copy on its parameter (``Placement.copies``, ``primary``), which
    the gradient completion, the norm and the checkpoint read: a causal LM's tied embedding over the embedding group
    when the first and last chunk are on different ranks (the first chunk's rank holds the primary; the V style puts
    both on rank 0: one weight, no record), DeBERTa's relative embeddings over pp on every rank; nothing else."""
    import torch
    from transformers import AutoModelForCausalLM

    from hftrain.parallel import build_stage_modules, placements
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config("gpt2", num_layers=4))
    for rank in range(2):
        build_stage_modules(lm, pp_rank=rank, pp=2, virtual_stages=2, style=style, head="causal_lm")
        copies = {name: (r.copies, r.primary) for name, r in placements(lm).items() if r.copies is not None}
        expected = {"transformer.wte.weight": ("embedding", rank == 0), "lm_head.weight": ("embedding", rank == 0)}
        assert copies == ({} if style == "v" else expected), (style, rank)

    deberta = _model("deberta-v2", layers=4)
    for rank in range(2):
        build_stage_modules(deberta, pp_rank=rank, pp=2, virtual_stages=2, style=style)
        copies = {name: (r.copies, r.primary) for name, r in placements(deberta).items() if r.copies is not None}
        encoder = deberta.deberta.encoder
        aux = {f"deberta.encoder.{n}" for n, _ in encoder.named_parameters() if n.startswith(("rel_", "LayerNorm"))}
        assert copies == dict.fromkeys(aux, ("pp", rank == 0)), (style, rank)
