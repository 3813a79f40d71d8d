"""A pipeline rank's model, loaded with the other stages left on ``meta`` (``hftrain.models.partial``), equals the
whole model on every tensor it materializes, and leaves the random stream where the whole model leaves it.

One process, tiny BERT / GPT-2 / Llama checkpoints saved as a task model (with the base-model prefix) and as a
base model (without it, like BERT or GPT-2 on the hub), plus a checkpoint lacking a layer the rank leaves out:
the whole model would initialise that layer from the random stream, so only the whole build is exact and the
builder must build it whole (and say so).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_config


def _builder(folder):
    from hftrain.config import ModelConfig
    from hftrain.models import PretrainedBuilder

    return PretrainedBuilder(ModelConfig(model_name_or_path=str(folder), num_labels=2), pad_token_id=0)


def _leave_out_first_layer_and_embeddings(model):
    from hftrain.parallel.families import stages_of

    family = stages_of(model)
    names = {id(m): n for n, m in model.named_modules()}
    modules = [family.layers(model)[0], *family.embed_modules(model).values()]
    return [names[id(m)] for m in modules if any(True for _ in m.parameters())]


def _whole_and_partial(folder):
    torch.manual_seed(7)
    whole = _builder(folder)()
    whole_state = torch.get_rng_state()
    torch.manual_seed(7)
    partial = _builder(folder).build(leave_out=_leave_out_first_layer_and_embeddings)
    return whole, partial, whole_state


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("saved_as", ["task model", "base model"])
def test_left_out_modules_stay_on_meta_and_the_rest_equals_the_whole_model(tmp_path, kind, saved_as):
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = tiny_config(kind)
    auto = AutoModel if saved_as == "base model" else AutoModelForSequenceClassification
    auto.from_config(config).save_pretrained(tmp_path)
    whole, partial, whole_state = _whole_and_partial(tmp_path)
    assert torch.equal(torch.get_rng_state(), whole_state)  # the head drew the same numbers
    assert type(partial) is type(whole)
    left_out = set(_leave_out_first_layer_and_embeddings(whole))
    full = dict(whole.named_parameters())
    on_meta = 0
    for name, param in partial.named_parameters():
        if any(name.startswith(path + ".") for path in left_out):
            assert param.device.type == "meta", name
            on_meta += 1
        else:
            assert param.device.type == "cpu" and torch.equal(param, full[name]), name
    assert on_meta > 0 and set(dict(partial.named_parameters())) == set(full)
    for name, buffer in partial.named_buffers():
        if not any(name.startswith(path + ".") for path in left_out):
            assert torch.equal(buffer, dict(whole.named_buffers())[name]), name


def test_a_left_out_layer_missing_from_the_checkpoint_builds_the_whole_model(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.0.mlp." not in k}, tmp_path / "model.safetensors")
    whole, partial, whole_state = _whole_and_partial(tmp_path)
    assert torch.equal(torch.get_rng_state(), whole_state)
    assert all(p.device.type == "cpu" for p in partial.parameters())
    for (name, p), q in zip(partial.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert "building the whole model" in capsys.readouterr().out
