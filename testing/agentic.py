"""Helpers shared by the agentic tests."""

from __future__ import annotations

from pathlib import Path

from rose.shared.agentic.env_arithmetic import ArithmeticEnv
from rose.shared.agentic.tools import Tool
from rose.shared.models import ModelShape, build_model, load_tokenizer


class BrokenEnv(ArithmeticEnv):
    """A tool that crashes, one that floods, and a scorer that crashes."""

    name = "broken"

    def tools(self, problem=None):
        def crash(_: str) -> str:
            raise RuntimeError("database is down")

        return {"crash": Tool("crash", crash), "flood": Tool("flood", lambda _: "x" * 100_000)}

    def score(self, problem, answer):
        raise KeyError("no ground truth")


TINY_POLICY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def save_tiny_policy(directory: Path, models_dir: Path) -> Path:
    """A tiny policy saved like any HF model directory (the trainer loads it as it would a real one),
    with the tokenizer of the session's models."""
    tokenizer = load_tokenizer(models_dir / "policy")
    path = directory / "policy"
    build_model(TINY_POLICY, len(tokenizer), tokenizer.eos_token_id, seed=1).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
