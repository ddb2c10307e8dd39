"""The executors' model load reads config.json and safetensors itself, without transformers' modeling code: what it
gives the paged forward must be what transformers' own load gives, for every checkpoint shape we accept (Qwen2 and
Llama, tied and untied heads, one file and shards); what it cannot read exactly goes through transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from rose.services.executor.forward_item import ForwardItem
from rose.services.executor.kv_pool import KVPool
from rose.services.executor.model_runner import ModelWeights, PagedModelRunner, kv_shape_of
from rose.shared.models import InferenceModel, load_for_inference, load_model

MIB = 1 << 20


def _llama(directory, tie: bool, **extra):
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        **extra,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _same_as_transformers(directory) -> InferenceModel:
    light, hf = load_for_inference(directory), load_model(directory)
    assert isinstance(light, InferenceModel)
    ours, theirs = light.state_dict(), hf.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    named = dict(light.named_parameters(remove_duplicate=False))
    assert sorted(named) == sorted(dict(hf.named_parameters(remove_duplicate=False)))
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert (named["lm_head.weight"] is named["model.embed_tokens.weight"]) == tied
    assert torch.equal(light.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert ModelWeights.of(light).arch == ModelWeights.of(hf).arch and kv_shape_of(light) == kv_shape_of(hf)
    # and the paged forward over it gives transformers' logits
    runner = PagedModelRunner(light, KVPool("t", kv_shape_of(light), 2 * MIB, 16, torch.device("cpu")))
    ids = list(range(3, 14))
    out = runner.forward([ForwardItem(runner.pool.allocate(1), 0, ids)])[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    return light


def test_the_default_qwen2_pair_loads_as_transformers_loads_it(model_paths):
    for directory in (model_paths.serving, model_paths.policy):
        _same_as_transformers(directory)


@pytest.mark.parametrize("tie", [True, False])
def test_a_llama_checkpoint_tied_or_not(tmp_path, tie):
    _same_as_transformers(_llama(tmp_path, tie))


def test_a_sharded_checkpoint_reads_every_shard(tmp_path):
    directory = _llama(tmp_path / "one", tie=False)
    tensors = load_for_inference(directory).state_dict()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(sharded / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (sharded / "config.json").write_text((directory / "config.json").read_text())
    _same_as_transformers(sharded)


def test_a_rope_it_does_not_compute_goes_through_transformers(tmp_path):
    """Scaled rope (here Llama 3's) is transformers' to compute: the load gives its model, with its frequencies."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    directory = _llama(tmp_path, tie=True, rope_scaling=scaling)
    model = load_for_inference(directory)
    assert not isinstance(model, InferenceModel)
    assert torch.equal(model.model.rotary_emb.inv_freq, load_model(directory).model.rotary_emb.inv_freq)


def test_an_unsupported_model_type_is_refused_by_name(tmp_path):
    directory = _llama(tmp_path, tie=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_for_inference(directory)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_for_inference(tmp_path / "nowhere")


def test_a_field_left_to_transformers_defaults_goes_through_transformers(tmp_path):
    """Without ``tie_word_embeddings`` in config.json the tie is transformers' default to decide, not ours."""
    directory = _llama(tmp_path, tie=True)
    config = json.loads((directory / "config.json").read_text())
    del config["tie_word_embeddings"]
    (directory / "config.json").write_text(json.dumps(config))
    assert not isinstance(load_for_inference(directory), InferenceModel)
