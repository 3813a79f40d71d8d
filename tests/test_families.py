"""Every family in the registry (``hftrain.parallel.families``) trains under each axis it takes, through the Trainer,
equal to its 1-process run; the axes it does not take are refused in one line; ``hftrain plan`` marks runnable
exactly the axes the trainer takes.

The families beyond the first five (``tests.tiny.FAMILY_KINDS``: RoBERTa, XLM-R, ELECTRA, DistilBERT, GPT-NeoX, Mistral,
Qwen2, Qwen3, Gemma, Gemma-2, Gemma-3, Phi-3, OLMo-2, Qwen3-MoE, DeBERTa-v2, ALBERT), tiny but with their special
layers on (sliding windows shorter than the texts, soft-capping, qk-norm, scaled embeddings, fused qkv, ELECTRA's
embedding projection, DeBERTa-v3's relative attention, ALBERT's one layer group run by every layer). Three launches:
one process (the references); 2 processes for tp=2, pp=2, cp=2 and ep=2 (each where the family takes it); 4
processes for tp=2 × pp=2 (and RoBERTa at pp=2 × cp=2). Each run
equals its reference within 1e-5 (fp32): losses every step, the final evaluation, and the trained weights (gathered as
the export gathers them) loaded strictly into the plain transformers class. BERT, GPT-2, Llama, Mixtral and Qwen2-MoE
have their own tests (``test_pp_trainer``, ``test_cp_trainer``, ``test_ep_trainer``, ``test_tp_plans``).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.tiny import FAMILY_KINDS, run_tiny_training

STEPS = 3
COMMON = {"steps": STEPS, "n_train": 48, "n_eval": 10, "max_seq_length": 16, "return_weights": True, "num_layers": 2}
GLOBAL_MICRO = 8
MICROBATCHES = 2  # the pipeline layouts' num_microbatches


def _axes(kind: str) -> frozenset[str]:
    from hftrain.parallel.families import trainable_axes
    from tests.tiny import tiny_config

    return trainable_axes(tiny_config(kind))


def _layouts(world: int) -> dict[str, dict]:
    """layout label -> strategy options, for the launch of ``world`` processes."""
    if world == 4:
        return {
            "tp2pp2": {"tp": 2, "pp": 2, "num_microbatches": MICROBATCHES},
            "pp2cp2": {"pp": 2, "cp": 2, "num_microbatches": MICROBATCHES},
        }
    return {"tp2": {"tp": 2}, "pp2": {"pp": 2, "num_microbatches": MICROBATCHES}, "cp2": {"cp": 2}, "ep2": {"ep": 2}}


# Layouts run for some families only: pp × cp for RoBERTa, whose pipeline chunks number positions from the padding
# index on the whole sequence (BERT's and Llama's pp × cp are in tests/test_cp_trainer.py).
ONLY = {"pp2cp2": {"roberta"}}


def _options(kind: str, options: dict) -> dict:
    """The layout's strategy options for ``kind``: at cp > 1, the one cp exchange its family's trunk names where it
    has one (``cp_comm_only``: DeBERTa's all-to-all), as a user would set ``cp_comm``."""
    from hftrain.parallel.families import family_of
    from tests.tiny import tiny_config

    only = getattr(family_of(tiny_config(kind)).stages, "cp_comm_only", None)
    return {**options, "cp_comm": only[0]} if options.get("cp", 1) > 1 and only is not None else options


def _needs(options: dict) -> set[str]:
    return {axis for axis in ("tp", "pp", "cp", "ep") if options.get(axis, 1) > 1}


def _runs_layout(kind: str, label: str, options: dict) -> bool:
    """Whether ``kind`` trains under the layout ``label`` here: it takes every axis the layout splits (and the
    layout is not kept to other families)."""
    return _needs(options) <= _axes(kind) and kind in ONLY.get(label, {kind})


def _runs(world: int) -> dict:
    import torch.distributed as dist

    results = {}
    for kind in FAMILY_KINDS:
        for label, options in _layouts(world).items():
            if not _runs_layout(kind, label, options):
                continue
            dp = world // (options.get("tp", 1) * options.get("pp", 1) * options.get("cp", 1))
            run = run_tiny_training(
                kind=kind,
                micro=GLOBAL_MICRO // dp,
                strategy="megatron",
                strategy_options=_options(kind, options),
                **COMMON,
            )
            results[(kind, label)] = run if dist.get_rank() == 0 else {"losses": run["losses"]}
    return results


def _references() -> dict:
    references = {kind: run_tiny_training(kind=kind, micro=GLOBAL_MICRO, **COMMON) for kind in FAMILY_KINDS}
    # a mixture of experts' router loss is per pipeline micro-batch, as under gradient accumulation
    references |= {
        (kind, "accumulated"): run_tiny_training(
            kind=kind, micro=GLOBAL_MICRO // MICROBATCHES, gas=MICROBATCHES, **COMMON
        )
        for kind in FAMILY_KINDS
        if "ep" in _axes(kind)
    }
    return references


@pytest.fixture(scope="module")
def runs() -> dict:
    (reference,) = run_distributed(_references, nprocs=1, timeout=900)
    return {
        "reference": reference,
        2: run_distributed(_runs, nprocs=2, timeout=1500, world=2),
        4: run_distributed(_runs, nprocs=4, timeout=1500, world=4),
    }


def _expected_cases() -> list[tuple[str, str, int]]:
    cases = []
    for world in (2, 4):
        for label, options in _layouts(world).items():
            cases += [(kind, label, world) for kind in FAMILY_KINDS if _runs_layout(kind, label, options)]
    return cases


def test_the_registry_gives_each_family_its_axes():
    """What the table below runs: every new family takes pp and tp (Phi-3's fused qkv too); cp every dense one,
    sliding windows included (RoBERTa's pad-numbered positions are numbered on the whole sequence, then split;
    Gemma-2's soft-capping and ModernBERT's bidirectional windows through the score-modified block kernel,
    tests/test_cp_variants.py; ALBERT's shared layer gathered once after the encoder; DeBERTa's relative attention
    with cp_comm all_to_all: its cp2 column runs it, tests/test_cp_deberta.py has the layer); ep the mixtures of
    experts, which take cp too (their router loss summed over dp × cp, tests/test_moe_cp.py)."""
    expected = {
        "roberta": "tp pp cp", "xlm-roberta": "tp pp cp", "electra": "tp pp cp", "distilbert": "tp pp cp",
        "gpt_neox": "tp pp cp", "mistral": "tp pp cp", "qwen2": "tp pp cp", "qwen3": "tp pp cp", "gemma": "tp pp cp",
        "gemma2": "tp pp cp", "gemma3_text": "tp pp cp", "phi3": "tp pp cp", "olmo2": "tp pp cp",
        "qwen3_moe": "tp pp cp ep",
        "modernbert": "tp pp cp", "deberta-v2": "tp pp cp", "albert": "tp pp cp",
    }  # fmt: skip
    assert {
        kind: " ".join(a for a in ("tp", "pp", "cp", "ep") if a in _axes(kind)) for kind in FAMILY_KINDS
    } == expected


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "layout", "world"), _expected_cases(), ids=lambda v: str(v))
def test_each_family_under_each_axis_equals_one_process(runs, kind, layout, world):
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    moe_pipeline = "pp" in layout and "ep" in _axes(kind)  # its router loss is per micro-batch
    ref = runs["reference"][(kind, "accumulated") if moe_pipeline else kind]
    ranks = runs[world]
    run = ranks[0][(kind, layout)]
    assert len(run["losses"]) == len(ref["losses"]) == STEPS
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert all(rank[(kind, layout)]["losses"] == run["losses"] for rank in ranks)  # every rank logs the same loss
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    assert ref["losses"][-1] != ref["losses"][0]  # it trained
    # the gathered weights (what the export writes) load strictly into the plain class and equal the reference's
    # within 1e-5: Adam moves a weight whose gradient is near zero by lr·g/(|g| + eps), so float32 summation-order
    # noise in such a gradient (GPT-NeoX's qkv bias: 1e-9) reaches the weight as 1e-6 (tests/test_tp_plans.py)
    plain = AutoModelForSequenceClassification.from_config(tiny_config(kind, max_positions=32))
    plain.load_state_dict(run["weights"], strict=True)
    for name, tensor in ref["weights"].items():
        torch.testing.assert_close(
            run["weights"][name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def _model_folder(root, kind: str, **config_changes) -> str:
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config, tiny_tokenizer

    config = tiny_config(kind)
    for key, value in config_changes.items():
        setattr(config, key, value)
    path = root / kind
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer = tiny_tokenizer("bert" if kind in ("albert", "roberta") else "gpt2")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.save_pretrained(path)
    return str(path)


REFUSALS = {  # label -> (family, arguments, world size, the one line's text, config changes)
    "gemma2-bidirectional-cp2": ("gemma2", ["--cp", "2"], "2", "parallelism.cp: context parallelism cannot split "
                                 "this Gemma-2 model exactly: its bidirectional attention",
                                 {"use_bidirectional_attention": True}),
}  # fmt: skip


@pytest.mark.parametrize("label", list(REFUSALS))
def test_an_axis_a_family_cannot_take_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, label):
    from tests.megatron_runs import refused_as_launched_rank0
    from tests.tiny import write_csv

    kind, extra, world, message, changes = REFUSALS[label]
    model = _model_folder(tmp_path, kind, **changes)
    data = str(write_csv(tmp_path / "train.csv"))
    capsys.readouterr()  # the folders' save progress
    refused_as_launched_rank0(monkeypatch, capsys, tmp_path, model, data, extra, world, message)


def test_a_family_without_sdpa_trains_with_eager_said_in_one_line(tmp_path, capsys):
    """Gemma-2 (soft-capped attention: transformers has no SDPA path for it) under the default sdpa setting."""
    from hftrain.cli import main
    from tests.tiny import write_csv

    model = _model_folder(tmp_path, "gemma2")
    out = tmp_path / "out"
    data = str(write_csv(tmp_path / "train.csv"))
    code = main(["train", "--model_name_or_path", model, "--dataset_name", "null", "--log_with", "none",
                 "--train_file", data, "--max_steps", "2", "--per_device_train_batch_size", "8",
                 "--output_dir", str(out), "--mixed_precision", "no"])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "Gemma2ForSequenceClassification has no SDPA attention in transformers; using eager" in printed.out
    assert (out / "model" / "config.json").is_file()


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_a_plan_row_is_runnable_exactly_when_the_trainer_takes_its_layout(tmp_path, kind):
    """``hftrain plan`` reads the registry: each tp/pp/cp row of every family is marked runnable exactly when the
    megatron strategy's own model check (what ``train`` runs before any process group) accepts that layout."""
    from transformers import AutoConfig

    from hftrain.errors import ConfigError
    from hftrain.plan.hardware import Hardware
    from hftrain.plan.model import model_from_config
    from hftrain.plan.model_parallel import estimate
    from hftrain.plan.rows import Workload
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    folder = _model_folder(tmp_path, kind)
    model, config = model_from_config(folder), AutoConfig.from_pretrained(folder)
    assert model.moe == (kind == "qwen3_moe")  # a mixture of experts is counted as one
    # cp=4 at 2 heads: the ring for a family that takes it, a formula-only row for one whose attention only the
    # all-to-all splits (DeBERTa's: 2 heads do not divide by 4), as the trainer's check refuses that cp_comm
    for tp, pp, cp in ((2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 4)):
        row = estimate(tp, pp, model, Workload(dropout=False), Hardware(gpus_per_node=8), cp=cp)
        options = {key: value for key, value in row.strategy.items() if key != "name"}  # what --write-configs writes
        strategy = strategy_from_options(
            "megatron",
            options,
            launch=LaunchInfo(world_size=tp * pp * cp, local_world_size=tp * pp * cp),
            platform=Platform("cpu", "gloo"),
        )
        try:
            strategy.check_model(config, use_lora=False)
            accepted = True
        except ConfigError:
            accepted = False
        assert row.runnable == accepted, (kind, tp, pp, cp)


def test_a_family_with_llamas_layout_is_found_without_an_entry():
    """A config whose model_type the registry does not know but whose transformers tp plan names exactly Llama's
    modules takes Llama's layout (tp from the derived plan, pp and cp from the rotary decoder adapter); one whose
    plan differs is refused naming the axis and the families that have one."""
    from hftrain.errors import ConfigError
    from hftrain.parallel.families import family_of, plan_for, trainable_axes
    from tests.tiny import tiny_config

    config = tiny_config("llama")
    config.model_type = "llama_descendant"  # e.g. a family transformers adds after this release
    assert family_of(config).name == "llama_descendant (Llama architecture)"
    assert trainable_axes(config) == {"tp", "pp", "cp"}
    assert [style for path, style in plan_for(config).layer if path.endswith("k_proj")] == ["column_kv"]
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.extra_proj": "colwise"}
    assert family_of(config) is None
    with pytest.raises(ConfigError, match="tensor parallelism has no entry for model type 'llama_descendant'"):
        plan_for(config)


def test_the_registry_is_one_line_per_family_module():
    """Every module of ``hftrain/parallel/families/`` (but the ``Family`` record's) exports its entries as ``FAMILIES``
    and the registry is exactly their union, no model type in two modules: a new family is one new file and one
    registry line (a module left out of the registry fails here)."""
    import importlib
    import pkgutil

    import hftrain.parallel.families as registry

    names = [m.name for m in pkgutil.iter_modules(registry.__path__) if m.name != "family"]
    assert {"bert", "llama", "moe", "deberta_v2", "modernbert", "albert"} <= set(names)
    gathered: dict = {}
    for name in names:
        entries = importlib.import_module(f"hftrain.parallel.families.{name}").FAMILIES
        assert entries and not set(entries) & set(gathered), name
        gathered |= entries
    assert gathered.keys() == registry.FAMILIES.keys()
    assert all(gathered[t] is registry.FAMILIES[t] for t in gathered)
