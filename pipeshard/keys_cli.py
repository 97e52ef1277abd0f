"""``pipeshard keys add|list|revoke``: the fleet's API keys (pipeshard.keys)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from pipeshard.errors import PipeshardError
from pipeshard.keys import add_key, default_key_file, read_entries, revoke_key


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="API keys: one identity per user or application (docs/SECURITY.md)")
    p.add_argument(
        "--keys-file",
        type=Path,
        default=None,
        help="the key file (default: PIPESHARD_API_KEYS, else certs/api-keys)",
    )
    actions = p.add_subparsers(dest="keys_action", required=True)
    add = actions.add_parser("add", help="make a key; it is printed once, on the last line, and not stored")
    add.add_argument("name", help="the identity's name (metrics, quotas, prefix-cache scope)")
    add.add_argument("--weight", type=float, default=1.0, help="share of a full fleet relative to others")
    add.add_argument("--max-running", type=int, default=None, help="running generations (default: fleet's)")
    add.add_argument("--max-queued", type=int, default=None, help="queued generations (default: fleet's)")
    add.set_defaults(func=_add)
    actions.add_parser("list", help="names, settings and creation times (never keys)").set_defaults(
        func=_list
    )
    revoke = actions.add_parser("revoke", help="remove a key; a running fleet refuses it within a second")
    revoke.add_argument("name")
    revoke.set_defaults(func=_revoke)


def _file(args: argparse.Namespace) -> Path:
    return args.keys_file or default_key_file()


def _fail(exc: PipeshardError) -> int:
    print(f"pipeshard keys: {exc}", file=sys.stderr)
    return 2


def _add(args: argparse.Namespace) -> int:
    path = _file(args)
    try:
        key = add_key(
            path, args.name, weight=args.weight, max_running=args.max_running, max_queued=args.max_queued
        )
    except PipeshardError as exc:
        return _fail(exc)
    print(f"key {args.name!r} added to {path}; it is shown once, here (clients send it as a bearer token):")
    print(key)
    return 0


def _limit(value: int | None) -> str:
    return "default" if value is None else str(value)


def _list(args: argparse.Namespace) -> int:
    try:
        entries = read_entries(_file(args))
    except PipeshardError as exc:
        return _fail(exc)
    print(f"{'name':24} {'weight':>6} {'running':>8} {'queued':>7}  created (UTC)")
    for e in entries:
        created = datetime.fromtimestamp(e.created, UTC).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{e.name:24} {e.weight:>6g} {_limit(e.max_running):>8} {_limit(e.max_queued):>7}  {created}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    try:
        revoke_key(_file(args), args.name)
    except PipeshardError as exc:
        return _fail(exc)
    print(f"key {args.name!r} revoked in {_file(args)}")
    return 0
