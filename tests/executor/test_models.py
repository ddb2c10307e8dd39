import dataclasses
import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rose.cli.main import main as cli_main
from rose.shared.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    ALL_LINEAR,
    ATTENTION_MODULES,
    DEFAULT_LORA,
    ROSE_ADAPTER_FILE,
    AdapterError,
    LoraShape,
    adapter_targets,
    adapter_tensor_name,
    base_dir_of,
    check_base,
    is_adapter_dir,
    model_fingerprint,
    read_adapter,
)
from rose.shared.models import (
    DEMO_POLICY_SHAPE,
    EOS_TOKEN,
    POLICY_SHAPE,
    SERVING_SHAPE,
    build_model,
    init_models,
    load_for_inference,
    load_model,
)


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


# ---- a LoRA policy: an adapter of the serving model (shared/lora.py) ---------------------------------

LORA = LoraShape(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def lora_paths(tmp_path_factory):
    return init_models(tmp_path_factory.mktemp("lora-models"), seed=0, preset="demo", lora=LORA)


def test_init_models_with_lora_writes_a_peft_adapter_of_the_serving_model(lora_paths, tmp_path):
    assert is_adapter_dir(lora_paths.policy) and not is_adapter_dir(lora_paths.serving)
    base = load_model(lora_paths.serving)
    assert base.config.hidden_size == DEMO_POLICY_SHAPE.hidden_size  # the demo preset's LoRA layout
    adapter = read_adapter(lora_paths.policy)
    assert adapter.shape == LORA and adapter.base == str(lora_paths.serving.resolve())
    assert adapter.base_fingerprint == model_fingerprint(base.state_dict())
    config = json.loads((lora_paths.policy / ADAPTER_CONFIG_FILE).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"], config["bias"]) == ("LORA", 4, 8.0, "CAUSAL_LM", "none")
    assert config["target_modules"] == list(ALL_LINEAR) and config["use_rslora"] is False
    assert "base_fingerprint" not in config  # ROSE's facts live in the sidecar: peft warns on keys it does not know
    assert (lora_paths.policy / "tokenizer.json").is_file()  # every service loads a tokenizer from the policy dir
    targets = adapter_targets(adapter.tensors)
    assert len(targets) == DEMO_POLICY_SHAPE.num_layers * len(ALL_LINEAR)
    for (layer, module), (a, b) in targets.items():
        parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
        weight = base.get_parameter(f"model.layers.{layer}.{parent}.{module}.weight")
        assert a.shape == (4, weight.shape[1]) and b.shape == (weight.shape[0], 4)
        assert a.abs().sum() > 0 and not b.any()  # peft's init: B = 0, so version 0 is the base
    # peft loads it unchanged, and version 0's logits are the base's exactly
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(load_model(lora_paths.serving), str(lora_paths.policy))
        assert torch.equal(peft_model(input_ids=ids).logits, expected)
    # deterministic: the same seed writes the same bytes (the config's base path aside: another directory)
    again = init_models(tmp_path, seed=0, preset="demo", lora=LORA)
    for name in (ADAPTER_WEIGHTS_FILE, ROSE_ADAPTER_FILE):
        assert (again.policy / name).read_bytes() == (lora_paths.policy / name).read_bytes()
    config_again = json.loads((again.policy / ADAPTER_CONFIG_FILE).read_text())
    assert config_again.pop("base_model_name_or_path") == str(again.serving.resolve())
    assert config_again == {k: v for k, v in config.items() if k != "base_model_name_or_path"}


def test_the_fingerprint_tells_bases_apart_and_ignores_how_they_were_loaded(lora_paths):
    base = load_model(lora_paths.serving)
    fingerprint = model_fingerprint(base.state_dict())
    # the files (a tied head is not stored), the loaded model, the executor's light load and a bf16 load agree
    assert model_fingerprint(load_file(str(lora_paths.serving / "model.safetensors"))) == fingerprint
    assert model_fingerprint(load_for_inference(lora_paths.serving).state_dict()) == fingerprint
    assert model_fingerprint(load_model(lora_paths.serving, dtype=torch.bfloat16).state_dict()) == fingerprint
    # another base of the same shape, and a fine-tune of this one (every weight moved a little), differ
    other = build_model(DEMO_POLICY_SHAPE, base.config.vocab_size, base.config.eos_token_id, seed=7)
    assert model_fingerprint(other.state_dict()) != fingerprint
    g = torch.Generator().manual_seed(1)
    tuned = {k: v * (1 + 1e-2 * torch.randn(v.shape, generator=g)) for k, v in base.state_dict().items()}
    assert model_fingerprint(tuned) != fingerprint


def test_an_adapter_over_another_base_is_refused(lora_paths, tmp_path):
    adapter = read_adapter(lora_paths.policy)
    base = load_model(lora_paths.serving)
    check_base(adapter, base.state_dict(), "serving")  # its own base passes
    other = build_model(DEMO_POLICY_SHAPE, base.config.vocab_size, base.config.eos_token_id, seed=7)
    with pytest.raises(AdapterError, match="not the base this adapter was built on"):
        check_base(adapter, other.state_dict(), "other")
    wider = build_model(SERVING_SHAPE, base.config.vocab_size, base.config.eos_token_id, seed=0)
    with pytest.raises(AdapterError, match="is not this adapter's base"):
        check_base(dataclasses.replace(adapter, base_fingerprint=None), wider.state_dict(), "wider")  # without a fingerprint: shapes
    # the base is found by base_model_name_or_path, else as serving/ beside the adapter, else a clear error
    assert base_dir_of(lora_paths.policy, adapter) == lora_paths.serving.resolve()
    moved = dataclasses.replace(adapter, base="/nowhere/serving")
    assert base_dir_of(lora_paths.policy, moved) == lora_paths.serving
    with pytest.raises(AdapterError, match="no base model found"):
        base_dir_of(tmp_path / "policy", moved)


def test_adapter_names_parse_and_bad_names_or_shapes_are_refused(lora_paths, tmp_path):
    adapter = read_adapter(lora_paths.policy)
    for (layer, module), (a, b) in adapter_targets(adapter.tensors).items():  # one definition of the naming, both ways
        assert adapter.tensors[adapter_tensor_name(layer, module, "A")] is a and adapter.tensors[adapter_tensor_name(layer, module, "B")] is b
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    good = {adapter_tensor_name(0, "q_proj", "A"): a, adapter_tensor_name(0, "q_proj", "B"): b}
    bad_cases = {
        "is not a LoRA tensor name": {**good, "base_model.model.lm_head.lora_A.weight": a},
        "is not a linear layer of mlp": {
            "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.mlp.q_proj.lora_B.weight": b,
        },
        "is missing": {adapter_tensor_name(0, "q_proj", "A"): a},
        "A is \\[rank, in\\]": {**good, adapter_tensor_name(0, "q_proj", "B"): torch.zeros(64, 3)},
        "two dimensions": {**good, adapter_tensor_name(0, "q_proj", "A"): torch.zeros(4)},
        "one rank per adapter": {
            **good,
            adapter_tensor_name(1, "v_proj", "A"): torch.zeros(2, 64),
            adapter_tensor_name(1, "v_proj", "B"): torch.zeros(32, 2),
        },
    }
    for needle, tensors in bad_cases.items():
        with pytest.raises(AdapterError, match=needle):
            adapter_targets(tensors)
    with pytest.raises(AdapterError, match="not an adaptable module"):
        adapter_tensor_name(0, "lm_head", "A")
    assert issubclass(AdapterError, ValueError)
    # directories: not an adapter, an adapter peft could write but ROSE cannot run, a rank that disagrees with the tensors
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(lora_paths.serving)
    for change, needle in (
        ({"use_dora": True}, "use_dora"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 8}, "says rank 8"),
        ({"target_modules": ["q_proj"]}, "does not name"),
    ):
        copy = tmp_path / f"bad-{next(iter(change))}"
        shutil.copytree(lora_paths.policy, copy)
        config = json.loads((copy / ADAPTER_CONFIG_FILE).read_text())
        (copy / ADAPTER_CONFIG_FILE).write_text(json.dumps({**config, **change}))
        with pytest.raises(AdapterError, match=needle):
            read_adapter(copy)


def test_models_init_lora_warm_starts_the_base_and_builds_the_adapter_over_it(lora_paths, tmp_path, capsys):
    """`rose models init --preset demo --lora --warm-start-steps N`: the serving model is trained by the trainer's warm
    start, and the adapter's fingerprint is the warm base's (not the random one `init_models` built first)."""
    assert cli_main(["models", "init", str(tmp_path), "--preset", "demo", "--lora", "--lora-rank", "2", "--warm-start-steps", "3"]) == 0
    assert "serving model warm-started: 3 steps" in capsys.readouterr().out
    warm = load_model(tmp_path / "serving")
    adapter = read_adapter(tmp_path / "policy")
    assert adapter.shape == LoraShape(rank=2, alpha=DEFAULT_LORA.alpha)
    assert adapter.base_fingerprint == model_fingerprint(warm.state_dict()) != read_adapter(lora_paths.policy).base_fingerprint
    with pytest.raises(SystemExit, match="goes with --lora"):
        cli_main(["models", "init", str(tmp_path / "full"), "--warm-start-steps", "3"])


def test_an_adapter_is_never_written_over_a_policy_model(model_paths, tmp_path):
    """`rose models init DIR --lora` over a DIR whose policy/ is a model refuses before writing anything."""
    shutil.copytree(model_paths.serving, tmp_path / "serving")
    shutil.copytree(model_paths.policy, tmp_path / "policy")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError, match="holds a model, not an adapter"):
        init_models(tmp_path, seed=0, preset="demo", lora=LORA)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
