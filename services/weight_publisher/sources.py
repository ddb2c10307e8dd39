"""Where a version's dense weights come from: a shared safetensors path, or the staging bucket.

A path is memory-mapped (no copy until the shards are packed); a staged object is fetched
with the fast store path into one buffer and parsed in place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rose.contracts.weights import WeightPublishRequest
from rose.shared.errors import WeightError
from rose.shared.weight_layout import LayoutError, parse_safetensors, read_safetensors_dir
from rose.shared.weight_store import WeightStore

from .config import PublisherSettings
from .versions import PublishError, Tensors


def check_path(path: str, settings: PublisherSettings) -> Path:
    """The resolved path, if it exists and lies under an allowed root."""
    resolved = Path(path).resolve()
    if settings.allowed_roots and not any(resolved.is_relative_to(Path(r).resolve()) for r in settings.allowed_roots):
        raise PublishError(f"path {path} is not under an allowed root {settings.allowed_roots}")
    if not resolved.exists():
        raise PublishError(f"path {path} does not exist on the publisher")
    return resolved


async def load(request: WeightPublishRequest, staging: WeightStore, settings: PublisherSettings) -> tuple[Tensors, Callable[[], None]]:
    """The request's tensors and a function that releases them (unmaps files)."""
    try:
        if request.source == "path":
            tensors, files = read_safetensors_dir(check_path(request.path, settings))

            def close() -> None:
                for f in files:
                    f.close()
                if request.delete_source:
                    for f in files:
                        f.path.unlink(missing_ok=True)

            return tensors, close
        buf = await staging.get(request.object_name, max_bytes=settings.max_source_bytes)
        return parse_safetensors(buf, request.object_name), lambda: None
    except (LayoutError, WeightError) as exc:
        raise PublishError(str(exc)) from exc
