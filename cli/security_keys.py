"""`rose security weights-key DIR [--name NAME]`: an Ed25519 key pair that signs weight manifests.

Writes `DIR/NAME.key` (PKCS#8 PEM, mode 0600: the weight publisher's `publisher.signing_key_file`)
and `DIR/NAME.pub` (give it to every executor: `weights.trusted_keys`), and with `--public-dir`
a copy of the `.pub` there (the executors' trusted-keys directory; docker compose keeps the
private key and the public one on separate volumes). Never overwrites a key; `--if-missing`
makes an existing pair a success (a one-shot container that runs on every `compose up`).

Rotation: make a pair under a new name, add its `.pub` to every executor's trusted keys (they
re-read them for every manifest), point the publisher at the new `.key` and restart it, then
remove the old `.pub` from the executors.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from rose.shared.weight_signing import DEFAULT_KEY_NAME, SigningError, generate_keypair, key_id, load_public_key


def weights_key(args: argparse.Namespace) -> int:
    private, public = Path(args.dir) / f"{args.name}.key", Path(args.dir) / f"{args.name}.pub"
    try:
        if args.if_missing and private.exists() and public.exists():
            kid = key_id(load_public_key(public))
            print(f"key pair {private} (id {kid}) exists; kept")
        else:
            paths = generate_keypair(args.dir, args.name)
            kid = paths.key_id
            print(f"key id:      {kid}")
            print(f"private key: {private}  (mode 0600; weight publisher: ROSE_PUBLISHER__SIGNING_KEY_FILE)")
            print(f"public key:  {public}  (executors: ROSE_WEIGHTS__TRUSTED_KEYS='[\"{public}\"]')")
    except SigningError as exc:
        print(f"rose security weights-key: {exc}", file=sys.stderr)
        return 1
    if args.public_dir:
        Path(args.public_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(public, Path(args.public_dir) / public.name)
        print(f"trusted copy: {Path(args.public_dir) / public.name}")
    return 0


def add_parser(security_sub: argparse._SubParsersAction) -> None:
    """Register `weights-key` under the `rose security` command group."""
    p = security_sub.add_parser(
        "weights-key",
        help="an Ed25519 key pair that signs weight manifests (NAME.key for the publisher, NAME.pub for executors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", help="where to write NAME.key and NAME.pub")
    p.add_argument("--name", default=DEFAULT_KEY_NAME, help=f"file name of the pair (default: {DEFAULT_KEY_NAME}; a rotation uses a new one)")
    p.add_argument("--public-dir", default=None, help="also copy NAME.pub into this directory (the executors' trusted keys)")
    p.add_argument("--if-missing", action="store_true", help="succeed without a change when DIR/NAME.key and NAME.pub exist")
    p.set_defaults(func=weights_key)
