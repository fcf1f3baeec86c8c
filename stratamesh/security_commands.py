"""Credentials, on the coordinator's box over its files: `stratamesh token` (join tokens), `stratamesh key` (API
keys) and `stratamesh user` (admin UI users); and `stratamesh revoke AGENT`, through the running coordinator.

The first three work on --db, else $STRATAMESH_DB, else the registry `stratamesh up` keeps, and make no registry
unless told to (--create): one made by mistake holds credentials no running mesh accepts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import os
import sys
import time
import urllib.error
from collections.abc import Callable
from typing import TYPE_CHECKING

from stratamesh.drain_command import add_api_arguments, admin_call
from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.state import DB_ENV, default_registry, is_postgres, make_private_dir

if TYPE_CHECKING:
    from stratamesh.coordinator.access import AccessStore


def add_token_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(metavar="ACTION", required=True)
    create = commands.add_parser("create", help="a join token an agent presents once for its certificate")
    create.add_argument("--expires", default="24h", help="lifetime: 90s, 30m, 24h, 7d or never (default 24h)")
    create.add_argument("--description", default="", help="a note kept with the token (which box it is for)")
    create.set_defaults(action="create")
    listing = commands.add_parser("list", help="every token: expiry, uses, revoked")
    listing.set_defaults(action="list")
    revoke = commands.add_parser("revoke", help="no agent enrolls with this token again")
    revoke.add_argument("token_id", metavar="TOKEN_ID", help="the token's id (its second field)")
    revoke.set_defaults(action="revoke")
    for sub in (create, listing, revoke):
        _add_registry_arguments(sub)
        sub.add_argument("--pki-dir", default="", help="the coordinator's CA (default: beside --db)")
        sub.add_argument("--mesh", default="default", help="names a CA created here, if there is none yet")


def run_token(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    from stratamesh.coordinator.enrollment import default_pki_dir, open_enroller, parse_duration

    try:
        db = registry_file(args)
        if not args.pki_dir and is_postgres(db):
            raise NoRegistry("a registry on PostgreSQL keeps no CA beside it: give the coordinators' --pki-dir")
        enroller, registry = open_enroller(db, args.pki_dir or default_pki_dir(db), args.mesh, time.time)
    except NoRegistry as exc:
        print(f"stratamesh token: {exc}", file=sys.stderr)
        return 1
    except MeshError as exc:
        say(f"cannot open the coordinator's files: {exc}")
        return 1
    try:
        if args.action == "create":
            token, record = enroller.create_token(parse_duration(args.expires), args.description)
            say(str(token))
            say(f"# expires {_when(record.expires)}; start an agent with: stratamesh agent --join-token {token}")
        elif args.action == "list":
            for t in enroller.tokens():
                state = "revoked" if t.revoked else "expired" if t.refusal(time.time()) else "valid"
                say(f"{t.token_id}  {state:8}  expires {_when(t.expires)}  uses {t.num_uses}  {t.description}")
        else:
            enroller.revoke_token(args.token_id)
            say(f"join token {args.token_id} revoked")
    except MeshError as exc:
        say(f"token {args.action} failed: {exc}")
        return 1
    finally:
        registry.close()
    return 0


def add_revoke_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("agent_id", metavar="AGENT", help="the agent's id (see /admin/api/agents)")
    add_api_arguments(parser)


def run_revoke(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    """Revokes an agent's certificates through the running coordinator, which cuts it off at once."""
    try:
        revocation = admin_call(f"{args.url.rstrip('/')}/admin/api/agents/{args.agent_id}/revoke", "POST",
                                args.api_key)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        say(f"revoking {args.agent_id} failed: {exc}")
        return 1
    serials = revocation["revocation"]["revoked_serials"]
    say(f"{args.agent_id} revoked ({len(serials)} certificate(s)); the mesh refuses it from now on")
    return 0


def _when(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if unix_s else "never"


def add_key_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(metavar="ACTION", required=True)
    create = commands.add_parser("create", help="a new API key (shown once; only its hash is kept)")
    create.add_argument("--role", choices=("client", "viewer", "operator"), default="client",
                        help="client: /v1 only; viewer: also reads /admin/api; operator: also acts there")
    create.add_argument("--name", default="", help="who or what the key is for")
    create.add_argument("--expires", default="never", help="lifetime: 90s, 30m, 24h, 7d or never (default never)")
    create.set_defaults(action="create")
    listing = commands.add_parser("list", help="every key: role, expiry, revoked (never the key itself)")
    listing.set_defaults(action="list")
    revoke = commands.add_parser("revoke", help="the key is refused from its next request on")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key's id (its third field: sk-sm-<id>-...)")
    revoke.set_defaults(action="revoke")
    for sub in (create, listing, revoke):
        _add_registry_arguments(sub)


def run_key(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    from stratamesh.coordinator.enrollment import parse_duration

    def act(access: AccessStore) -> None:
        if args.action == "create":
            text, record = access.create_key(args.role, args.name, time.time(), parse_duration(args.expires))
            say(text)
            say(f"# {record.role} key {record.key_id}, expires {_when(record.expires)}; send it as "
                "`Authorization: Bearer <key>` (the SDK and `stratamesh drain` read $STRATAMESH_API_KEY)")
        elif args.action == "list":
            for k in access.keys():
                state = "revoked" if k.revoked else "expired" if k.expires and k.expires <= time.time() else "valid"
                say(f"{k.key_id}  {k.role:8}  {state:8}  expires {_when(k.expires)}  {k.name}")
        else:
            access.revoke_key(args.key_id, time.time())
            say(f"API key {args.key_id} revoked")

    return _with_access("key", args, act, say)


def add_user_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(metavar="ACTION", required=True)
    add = commands.add_parser("add", help="add an admin UI user, or set an existing one's password and role")
    add.add_argument("username")
    add.add_argument("--role", choices=("viewer", "operator"), default="viewer")
    add.add_argument("--password-stdin", action="store_true", help="read the password from stdin (else prompt)")
    add.set_defaults(action="add")
    listing = commands.add_parser("list", help="every admin user and their role")
    listing.set_defaults(action="list")
    remove = commands.add_parser("remove", help="remove a user (their sessions end)")
    remove.add_argument("username")
    remove.set_defaults(action="remove")
    for sub in (add, listing, remove):
        _add_registry_arguments(sub)


def run_user(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    def act(access: AccessStore) -> None:
        if args.action == "add":
            access.add_user(args.username, _read_password(args.password_stdin), args.role, time.time())
            say(f"user {args.username} ({args.role}) can log in to the admin UI")
        elif args.action == "list":
            for name, role in access.users():
                say(f"{name}  {role}")
        else:
            access.remove_user(args.username)
            say(f"user {args.username} removed")

    return _with_access("user", args, act, say)


class NoRegistry(MeshError):
    """The registry a credentials command would work on does not exist, and it was not told to make one."""


def registry_file(args: argparse.Namespace) -> str:
    """The registry the command works on (--db, $STRATAMESH_DB, `up`'s: a file, or a PostgreSQL URL taken as it
    is); NoRegistry if the file is missing and no --create."""
    if is_postgres(args.db or os.environ.get(DB_ENV, "")):
        return args.db or os.environ[DB_ENV]
    path = default_registry(args.db, os.environ)
    if args.create and not path.parent.exists():
        make_private_dir(path.parent)
    if not args.create and not path.is_file():
        named = "--db" if args.db else f"${DB_ENV}" if os.environ.get(DB_ENV) else "`stratamesh up`'s registry"
        raise NoRegistry(f"no registry at {path} ({named}); start the mesh first, point --db or ${DB_ENV} at its "
                         "registry, or add --create to make a new one there")
    return str(path)


def _add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default="", metavar="LOCATION", help=f"the coordinator's registry: a file or a "
                        f"postgresql:// URL (default: ${DB_ENV}, else the one `stratamesh up` keeps in its state "
                        "folder)")
    parser.add_argument("--create", action="store_true",
                        help="make the registry if there is none at that path (for a coordinator not started yet)")


def _with_access(command: str, args: argparse.Namespace, act: Callable[[AccessStore], None],
                 say: Callable[[str], None]) -> int:
    from stratamesh.coordinator.access import AccessStore
    from stratamesh.coordinator.registry_store import open_registry

    try:
        db = registry_file(args)
        registry = open_registry(db)
    except NoRegistry as exc:
        print(f"stratamesh {command}: {exc}", file=sys.stderr)
        return 1
    except MeshError as exc:
        say(f"cannot open the registry: {exc}")
        return 1
    try:
        act(AccessStore(registry))
    except MeshError as exc:
        say(f"{args.action} failed: {exc}")
        return 1
    finally:
        registry.close()
    return 0


def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass("password: ")
    if getpass.getpass("again: ") != first:
        raise SystemExit("the passwords differ")
    return first
