"""Tensor parallelism on the mixture-of-experts families (Mixtral, Qwen2-MoE): attention split, MoE block replicated.

- tp=2 (2 gloo processes) through the megatron strategy's Trainer on tiny Mixtral and Qwen2-MoE classifiers (4
  experts, top-2; Qwen2-MoE with a shared expert and a dense second layer), fp32: losses, learning rates and the
  final full weights equal the 1-process run's within 1e-5 over 10 steps (measured: 9e-8 relative in the losses,
  3.4e-7 in the weights). Both sides produce their losses by the same code path (the job's loss, with whatever it
  adds to the head's, such as the routers' auxiliary loss).
- Each rank holds half of q/k/v/o and the vocabulary and the whole MoE block (router, 3-D experts, shared expert).
- Sequence parallelism with a MoE family is refused in one line naming ``parallelism.sequence_parallel``, exit 2,
  nothing written (the replicated MoE block needs the full sequence).
"""

from __future__ import annotations

import pytest

from hftrain.errors import ConfigError
from tests.distributed import run_distributed
from tests.megatron_runs import assert_parity, assert_same_weights, megatron_job_args
from tests.tiny import run_tiny_training, tiny_config

KINDS = ("mixtral", "qwen2_moe")
MICRO = 8  # the global micro-batch: tp=2 has one data-parallel replica, as the 1-process run
# per layer q, k, v, o weights (+ Qwen2-MoE's q, k, v biases), and the word embeddings
SPLIT = {"mixtral": 2 * 4 + 1, "qwen2_moe": 2 * 7 + 1}


def _held(trainer) -> dict:
    """This rank's split parameter names and the local shapes of the attention and MoE parameters of layer 0."""
    from hftrain.parallel import split_over

    model = trainer.runtime.unwrap_model(trainer.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("model.layers.0.")}
    return {"split": sorted(split_over(model, "tp")), "shapes": shapes}


def _runs(strategy: str, options: dict | None) -> dict:
    return {
        kind: run_tiny_training(
            kind=kind,
            micro=MICRO,
            steps=10,
            strategy=strategy,
            strategy_options=options,
            return_weights=True,
            inspect=_held if strategy == "megatron" else None,
        )
        for kind in KINDS
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    two = run_distributed(_runs, nprocs=2, timeout=900, strategy="megatron", options={"tp": 2})
    (one,) = run_distributed(_runs, nprocs=1, timeout=900, strategy="ddp", options=None)
    return {"two": two, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_equals_one_process(runs, kind):
    ref = runs["one"][kind]
    for rank in runs["two"]:
        assert_parity(rank[kind], ref)
        assert rank[kind]["losses"] == runs["two"][0][kind]["losses"]  # every rank logs the same
    main = runs["two"][0][kind]
    assert main["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
    # the full weights merged from the tp shards equal the 1-process run's
    assert_same_weights(main["weights"], ref["weights"], atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_attention_is_split_and_the_moe_block_replicated(runs, kind):
    config = tiny_config(kind)
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    experts = config.num_local_experts if kind == "mixtral" else config.num_experts
    width = config.intermediate_size if kind == "mixtral" else config.moe_intermediate_size
    layer = "model.layers.0."
    for rank in runs["two"]:
        held = rank[kind]["inspected"]
        assert len(held["split"]) == SPLIT[kind], held["split"]
        assert not any(".mlp." in name for name in held["split"])  # nothing of the MoE block is split
        shapes = held["shapes"]
        assert shapes[layer + "self_attn.q_proj.weight"] == (hidden // 2, hidden)  # 2 of the 4 query heads
        assert shapes[layer + "self_attn.k_proj.weight"] == (head_dim, hidden)  # 1 of the 2 key/value heads
        assert shapes[layer + "self_attn.o_proj.weight"] == (hidden, hidden // 2)
        # the whole router and all experts on every tp rank
        assert shapes[layer + "mlp.gate.weight"] == (experts, hidden)
        assert shapes[layer + "mlp.experts.gate_up_proj"] == (experts, 2 * width, hidden)
        assert shapes[layer + "mlp.experts.down_proj"] == (experts, hidden, width)
        if kind == "qwen2_moe":
            assert shapes[layer + "self_attn.q_proj.bias"] == (hidden // 2,)
            shared = config.shared_expert_intermediate_size
            assert shapes[layer + "mlp.shared_expert.gate_proj.weight"] == (shared, hidden)
            assert shapes[layer + "mlp.shared_expert_gate.weight"] == (1, hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_check_tensor_parallel_for_moe_families(kind):
    from hftrain.parallel import check_tensor_parallel

    config = tiny_config(kind)
    check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 4)  # 4 query heads, 2 key/value heads replicated over 2 ranks each
    check_tensor_parallel(config, 1, sequence_parallel=True)  # one rank: nothing is cut
    # the experts are not split by tp: an expert width tp does not divide is no obstacle
    config.update({"moe_intermediate_size": 25} if kind == "qwen2_moe" else {"intermediate_size": 25})
    check_tensor_parallel(config, 2)
    with pytest.raises(ConfigError, match=rf"tp=8 does not divide num_attention_heads=4 of this {kind} model; valid"):
        check_tensor_parallel(config, 8)
    with pytest.raises(ConfigError, match=r"^sequence parallelism is not supported for this") as refused:
        check_tensor_parallel(config, 2, sequence_parallel=True)
    assert "\n" not in str(refused.value) and "use sequence_parallel: false" in str(refused.value)


@pytest.mark.distributed
def test_sequence_parallel_with_moe_is_refused_in_one_line(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import (
        assert_refused,
        cli_in_process,  # hftrain train in a spawned rank: (exit code, stderr)
    )
    from tests.tiny import tiny_tokenizer, write_csv

    model = tmp_path / "mixtral"
    AutoModelForSequenceClassification.from_config(tiny_config("mixtral")).save_pretrained(model)
    tiny_tokenizer("gpt2").save_pretrained(model)
    data = write_csv(tmp_path / "data.csv")
    output_dir = tmp_path / "out"
    argv = ["train", *megatron_job_args(str(model), str(data), output_dir, "--tp", "2", "--sequence_parallel", "true")]
    (code, err), (code1, err1) = run_distributed(cli_in_process, nprocs=2, timeout=300, argv=argv)
    refusal = "parallelism.sequence_parallel: sequence parallelism is not supported for this mixtral model"
    assert_refused(err, code, refusal)
    assert code1 == 2 and "Traceback" not in err1  # the other rank stops too, silently (one message per machine)
    assert not output_dir.exists()  # nothing written
