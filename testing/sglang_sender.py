"""What slime's sending side pickles for a `flattened_bucket` weight push, without SGLang installed.

slime pickles `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`; the tests install a
dataclass of that module path and name (for the test's duration, through `monkeypatch`) so that the
pickle names exactly what slime's does.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch

MODULE = "sglang.srt.weight_sync.tensor_bucket"


def flattened_tensor_metadata(monkeypatch) -> type:
    """The stand-in class, installed as `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`."""

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    module = types.ModuleType(MODULE)
    FlattenedTensorMetadata.__module__, FlattenedTensorMetadata.__qualname__ = MODULE, "FlattenedTensorMetadata"
    setattr(module, "FlattenedTensorMetadata", FlattenedTensorMetadata)  # noqa: B010 - a module built at run time
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync", MODULE):
        monkeypatch.setitem(sys.modules, name, module if name == MODULE else types.ModuleType(name))
    return FlattenedTensorMetadata
