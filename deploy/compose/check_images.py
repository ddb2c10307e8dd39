"""The compose check's images and what they are made of: the wheelhouse, a Debian base, the build context, the builds.

No image registry is needed: the base is debootstrapped from Debian's packages and `docker import`ed,
the project's image installs from a wheelhouse of the host venv's versions (`python
deploy/compose/check.py wheelhouse DIR`), and a digest of the inputs (`images_key`) names the
`docker save` that a later run loads instead of building again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from check_common import DEPLOY, REPO, CheckFailed, debian_mirror, need, run

EXTRAS = "agents"  # the gateway of profile `train` imports the official openai client: one image serves all
SUITE = "bookworm"  # Debian 12: its python3 is 3.11, the project's Python
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates"]
IMAGES = {"ROSE_IMAGE": "rose:local", "ROSE_AGENTS_IMAGE": "rose:local-agents", "ROSE_PROMETHEUS_IMAGE": "rose-prometheus:local"}
BASE_IMAGE = "rose-base:bookworm"


# ---- the wheelhouse ---------------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def manifest(extras: Iterable[str] = (EXTRAS,)) -> list[str]:
    """`name==version` of every distribution `rose-rl[extras]` needs, as installed in this Python.

    The image installs exactly these (pip --no-index, `-c manifest.txt`): the versions the host's
    tests ran, torch's local version (`+cpu`) included. Markers are evaluated here: the image is
    the same platform (Linux x86_64, CPython 3.11).
    """
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    pins: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [("rose-rl", frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, want = todo.pop()
        if (name, want) in seen:
            continue
        seen.add((name, want))
        try:
            dist = distribution(name)
        except PackageNotFoundError as exc:
            raise CheckFailed(f"{name} is required but not installed in {sys.prefix}: run ./scripts/bootstrap.sh") from exc
        if name != "rose-rl":
            pins[_norm(dist.metadata["Name"])] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (want or {""})):
                todo.append((_norm(req.name), frozenset(req.extras)))
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


def _wheel_pin(path: Path) -> str | None:
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        return None
    return f"{_norm(name)}=={version}"


def missing_wheels(directory: Path, pins: list[str]) -> list[str]:
    """The pins that no wheel in `directory` provides (name and exact version, local label included)."""
    have = {_wheel_pin(p) for p in directory.glob("*.whl")}
    return [p for p in pins if p not in have]


def build_wheelhouse(directory: Path, extras: Iterable[str] = (EXTRAS,)) -> dict[str, int]:
    """Fill `directory` with a wheel per manifest pin (kept across runs) and this tree's own wheel (always rebuilt).

    pip takes each wheel where the host's pip does (its index and find-links: torch's CPU wheel
    from a local folder where the host has one); a distribution without a wheel is built here.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pins = manifest(extras)
    (directory / "manifest.txt").write_text("# deploy/compose/check.py wheelhouse: the host venv's versions\n" + "\n".join(pins) + "\n")
    absent = missing_wheels(directory, pins)
    if absent:
        req = directory / "requirements.txt"
        req.write_text("\n".join(absent) + "\n")
        run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(directory), "-r", str(req)])
        req.unlink()
    still = missing_wheels(directory, pins)
    need(not still, f"no wheel for {still} after pip wheel")
    for old in directory.glob("rose_rl-*.whl"):
        old.unlink()
    had_build = (REPO / "build").exists()
    with tempfile.TemporaryDirectory() as build:
        run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(directory), str(REPO)],
            capture=False,
            cwd=build,
        )
    if not had_build:  # setuptools' staging folder in the tree
        shutil.rmtree(REPO / "build", ignore_errors=True)
    return {"pins": len(pins), "downloaded": len(absent), "bytes": sum(p.stat().st_size for p in directory.glob("*.whl"))}


# ---- images -----------------------------------------------------------------------------------


def base_tarball(cache: Path) -> Path:
    """Debian bookworm (minbase, python3 and venv) from Debian's packages, as a tarball for `docker import`."""
    tar = cache / f"base-{SUITE}.tar"
    if tar.exists():
        return tar
    rootfs = Path(tempfile.mkdtemp(prefix="rose-rootfs-", dir=cache))
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs), debian_mirror()], capture=True)
        run(["chroot", str(rootfs), "apt-get", "clean"])
        partial = tar.with_suffix(".tar.partial")
        run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."])
        partial.rename(tar)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return tar


def build_context(wheels: Path) -> Path:
    """The image's build context: the package's files as the Dockerfile copies them, the wheelhouse beside."""
    ctx = Path(tempfile.mkdtemp(prefix="rose-context-"))
    files = run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"]).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not rel.startswith(("tests/", ".")):
            (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, ctx / rel)
    house = ctx / "deploy/compose/wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    for whl in [*wheels.glob("*.whl"), wheels / "manifest.txt"]:
        try:
            os.link(whl, house / whl.name)  # 300 MB: a hard link where the cache is on the same file system
        except OSError:
            shutil.copy2(whl, house / whl.name)
    return ctx


# What the Dockerfile copies into the image, the key of a saved image (images_key). README.md is
# copied too, only as the project wheel's long description: a change to it alone keeps a saved image.
IMAGE_INPUTS = (
    "deploy/compose/Dockerfile",
    "constraints.txt",
    "deploy/compose/wheelhouse",
    "pyproject.toml",
    "__init__.py",
    "bench",
    "cli",
    "client",
    "integrations",
    "contracts",
    "services",
    "shared",
    "sim",
    "testing",
)


def images_key(ctx: Path, base_tar: Path) -> str:
    """A digest of what the images are made of: the Dockerfile's inputs in the build context (the project's
    own wheel aside: it is built from the same tree files, which are hashed), the Prometheus image's
    Dockerfile, the base tarball."""
    h = hashlib.sha256()
    st = base_tar.stat()
    h.update(f"{base_tar.name}:{st.st_size}:{st.st_mtime_ns}:{EXTRAS}:{sorted(IMAGES.items())}".encode())
    files = [p for rel in IMAGE_INPUTS for p in ([ctx / rel] if (ctx / rel).is_file() else (ctx / rel).rglob("*"))]
    files.append(DEPLOY / "prometheus" / "Dockerfile")  # its only input (the configs are mounted)
    for path in sorted(files):
        if path.is_file() and not path.name.startswith("rose_rl-") and "__pycache__" not in path.parts:
            h.update(f"{path.relative_to(ctx if path.is_relative_to(ctx) else REPO).as_posix()}\0".encode())
            with path.open("rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:16]


def build_images(engine, ctx: Path, base_tar: Path) -> None:
    """The base imported (once), then the project's images from `ctx` with no network, and the Prometheus image."""
    if engine.docker_cmd("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        engine.docker_cmd("import", "--change", 'CMD ["/bin/bash"]', str(base_tar), BASE_IMAGE)
    build = ["build", "--network", "none", "--build-arg", f"BASE={BASE_IMAGE}", "--build-arg", "WHEELHOUSE=1"]
    engine.docker_cmd(
        *build,
        "--build-arg",
        f"ROSE_EXTRAS=[{EXTRAS}]",
        "-f",
        str(ctx / "deploy/compose/Dockerfile"),
        "-t",
        IMAGES["ROSE_IMAGE"],
        "-t",
        IMAGES["ROSE_AGENTS_IMAGE"],
        str(ctx),
        timeout=900,
    )
    # Debian's prometheus, fetched from Debian's packages during the build (host network: no bridge here)
    engine.docker_cmd(
        "build",
        "--network",
        "host",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "-f",
        str(DEPLOY / "prometheus/Dockerfile"),
        "-t",
        IMAGES["ROSE_PROMETHEUS_IMAGE"],
        str(DEPLOY / "prometheus"),
        timeout=600,
    )
