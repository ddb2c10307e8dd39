import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rose.shared.models import EOS_TOKEN, POLICY_SHAPE, SERVING_SHAPE, init_models


def test_models_load_with_transformers_auto_classes(model_paths):
    tok = AutoTokenizer.from_pretrained(model_paths.serving, local_files_only=True)
    ids = tok.encode("What is 2+3? <tool>calc: 2+3</tool> <result>5</result>")
    assert tok.decode(ids) == "What is 2+3? <tool>calc: 2+3</tool> <result>5</result>"
    assert tok.eos_token == EOS_TOKEN
    serving = AutoModelForCausalLM.from_pretrained(model_paths.serving, local_files_only=True)
    policy = AutoModelForCausalLM.from_pretrained(model_paths.policy, local_files_only=True)
    assert serving.config.model_type == policy.config.model_type == "qwen2"
    assert serving.config.hidden_size == SERVING_SHAPE.hidden_size
    assert policy.config.hidden_size == POLICY_SHAPE.hidden_size
    assert (model_paths.serving / "model.safetensors").exists()
    assert (model_paths.policy / "tokenizer.json").exists()
    logits = serving(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), serving.config.vocab_size)


def test_init_is_deterministic(model_paths, tmp_path):
    again = init_models(tmp_path, seed=0)
    for a, b in ((model_paths.serving, again.serving), (model_paths.policy, again.policy)):
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
