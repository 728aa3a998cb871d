"""``st-prompts replicas``: several ``st-prompts serve`` replicas behind a load balancer, checked and changed as one.

    st-prompts replicas check --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000
    st-prompts replicas add-set legal /models/legal-prompts --replica http://10.0.0.5:8000 --replica ...
    st-prompts replicas remove-set legal --replica http://10.0.0.5:8000 --replica ...
    st-prompts replicas reload-index docs --replica http://10.0.0.5:8000 --replica ...

``check`` reads every replica's ``/health``: each must be ready and all must serve the same sets (the same
``fingerprint``); exit status 0, else one line naming those that differ (status 2). The changes are the admin
endpoint's, sent to each replica in turn (the first one's checks decide: a change it refuses reaches no other), then
checked as ``check`` does: after status 0, every replica serves the added set (or none the removed one). The admin
token is the server's: ``$ST_PROMPTS_ADMIN_TOKEN`` or ``--admin-token-file``. An added set's folder is read by each
replica from its own disk: shared storage, or the same folder on every machine. Changes live in the replicas'
memory: change the bank folder too (``st-prompts bank add``) so that a restarted replica serves the same sets.
See docs/serving.md (Replicas).
"""

from __future__ import annotations

import argparse

from st_prompts.commands._numbers import positive_float
from st_prompts.commands.options import cli_text, missing_subcommand
from st_prompts.errors import ConfigurationError, printable


def add_parser(subparsers) -> None:
    """Register ``replicas`` and its sub-commands (``check``, ``add-set``, ``remove-set``, ``reload-index``)."""
    parser = subparsers.add_parser(
        "replicas", help="check several serve replicas, and change their prompt sets and indexes as one",
        description=cli_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="replicas_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: missing_subcommand(parser))

    check = actions.add_parser("check", help="every replica ready and serving the same sets (exit 0), else one line")
    _common(check, admin=False)
    check.set_defaults(func=run_check)

    add = actions.add_parser("add-set", help="add a prompt set to every replica, then check that all serve it")
    add.add_argument("name", help="the task name to serve the set under")
    add.add_argument("source", help="a saved st_prompts model folder or prompts-only checkpoint, at this path on every "
                     "replica's disk")
    _common(add)
    add.set_defaults(func=run_change, op="add_set")

    remove = actions.add_parser("remove-set", help="remove a prompt set from every replica, then check that none "
                                "serves it")
    remove.add_argument("name", help="the task name of the set")
    _common(remove)
    remove.set_defaults(func=run_change, op="remove_set", source=None)

    reload = actions.add_parser("reload-index", help="reload an index on every replica (after st-prompts index add or "
                                "remove on their shared folder)")
    reload.add_argument("name", help="the index's name (serve --index NAME=PATH)")
    _common(reload)
    reload.set_defaults(func=run_change, op="reload_index", source=None)


def _common(parser: argparse.ArgumentParser, admin: bool = True) -> None:
    parser.add_argument("--replica", action="append", required=True, metavar="URL", dest="replicas",
                        help="a replica's base URL (http://HOST:PORT), addressed directly, not through the load "
                        "balancer; repeat for every replica")
    parser.add_argument("--probe-timeout", type=positive_float(600.0), default=5.0, metavar="SECONDS",
                        help="how long a replica's /health may take to answer (default 5)")
    if admin:
        parser.add_argument("--timeout", type=positive_float(3600.0), default=120.0, metavar="SECONDS",
                            help="how long one replica's admin call may take (default 120)")
        parser.add_argument("--admin-token-file", metavar="FILE",
                            help="read the servers' admin token from FILE (default: $ST_PROMPTS_ADMIN_TOKEN)")


def _urls(args: argparse.Namespace) -> list[str]:
    from st_prompts.serving.replicas import replica_url

    urls = [replica_url(text) for text in args.replicas]
    if len(set(urls)) != len(urls):
        raise ConfigurationError("a --replica is given twice")
    return urls


def run_check(args: argparse.Namespace) -> int:
    from st_prompts.errors import ReplicasDisagreeError
    from st_prompts.serving.replicas import disagreement, probe_all

    states = probe_all(_urls(args), args.probe_timeout)
    for state in states:
        print(state.describe())
    problem = disagreement(states)
    if problem is not None:
        raise ReplicasDisagreeError(problem)
    print(f"{len(states)} replica{'s' * (len(states) != 1)} ready, serving the same sets (fingerprint "
          f"{states[0].fingerprint})")
    return 0


def run_change(args: argparse.Namespace) -> int:
    from st_prompts.commands.serve import admin_token
    from st_prompts.serving.replicas import apply_everywhere

    urls = _urls(args)
    token = admin_token(args.admin_token_file)
    if token is None:
        raise ConfigurationError("the admin routes need the servers' token: set $ST_PROMPTS_ADMIN_TOKEN or give "
                                 "--admin-token-file")
    states = apply_everywhere(urls, args.op, args.name, args.source, token, args.timeout, args.probe_timeout)
    verb = {"add_set": "serve", "remove_set": "no longer serve", "reload_index": "reloaded"}[args.op]
    print(f"{len(states)} replica{'s' * (len(states) != 1)} {verb} {printable(repr(args.name))}; every one ready, "
          f"serving the same sets (fingerprint {states[0].fingerprint})")
    return 0
