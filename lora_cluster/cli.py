"""The `lora-cluster` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`handler` to a `_run_<name>(args) -> int` function; add a new subcommand by writing that pair and
listing the `_add_` function in `SUBCOMMANDS`. Handlers import what they need lazily, so `--help`
stays fast. `main` returns the exit status (0 on success).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lora_cluster import __version__

if TYPE_CHECKING:
    from lora_cluster.client import LoraClusterClient


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="write the demo model zoo (random-weight Llama model + LoRA adapters) offline",
        description="Write, deterministically from a seed, a small random-weight Llama model and N PEFT "
        "LoRA adapters. Rerunning with the same arguments is a no-op; other arguments into an existing "
        "zoo are refused unless --force. The weights are random: the outputs are gibberish by design.",
    )
    p.add_argument("--out", type=Path, required=True, help="folder to write the zoo into")
    p.add_argument("--num-adapters", type=int, default=64, help="number of adapters a0..a{N-1} (default 64)")
    p.add_argument("--size", choices=["tiny", "base", "1b"], default="tiny",
                   help="tiny (~0.1M), base (~88M) or 1b (~1.0B parameters, Llama-3.2-1B's dims; for GPUs)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument("--arch", default=None, metavar="NAME",
                   help="instead of the Llama demo, a tiny model of the family NAME (llama3, mistral, "
                   "qwen2, qwen3, gemma2, gemma3, gemma3mm, phi3, phi4mini, granite, olmo2, smollm3, "
                   "qwen3moe, mixtral) with PEFT adapters as PEFT writes them for it "
                   "(docs/model_families.md); --size is ignored")
    p.add_argument("--force", action="store_true",
                   help="replace a zoo at --out that was built with other arguments (default: refuse)")
    p.add_argument("--progress", action="store_true", default=None,
                   help="show a progress bar even when stderr is not a terminal")
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from lora_cluster.demo import build_demo_zoo

    if args.num_adapters < 0:
        print("lora-cluster demo: --num-adapters must be >= 0", file=sys.stderr)
        return 2
    if args.arch is not None:
        from lora_cluster.demo_families import ARCHS

        if args.arch not in ARCHS:
            print(f"lora-cluster demo: unknown --arch {args.arch!r}; one of {', '.join(ARCHS)}",
                  file=sys.stderr)
            return 2
    try:
        if args.arch is not None:
            from lora_cluster.demo_families import build_family_zoo

            zoo = build_family_zoo(args.out, args.arch, num_adapters=args.num_adapters, seed=args.seed,
                                   replace=args.force)
        else:
            zoo = build_demo_zoo(args.out, num_adapters=args.num_adapters, size=args.size, seed=args.seed,
                                 replace=args.force, progress=args.progress)
    except FileExistsError as e:
        hint = "; pass --force to replace it" if "refusing to replace" in str(e) else ""
        print(f"lora-cluster demo: {e}{hint}", file=sys.stderr)
        return 1
    print(f"model: {zoo.model_dir}")
    print(f"adapters: {zoo.adapters_dir} ({len(zoo.adapter_ids)} adapters)")
    return 0


def _add_encrypt(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "encrypt",
        help="write an AES-256-GCM encrypted copy of an adapter folder (or of every adapter below it)",
        description="Encrypt adapter weights at rest (docs/adapter-store.md): adapter_config.json stays in "
        "clear text, adapter_model.safetensors becomes adapter_model.safetensors.enc, and checksums.sha256 "
        "covers both. Upload the output folder to the adapter source; engines decrypt with the same key.",
    )
    p.add_argument("src", type=Path, help="an adapter folder, or a folder of adapter folders")
    p.add_argument("dst", type=Path, help="output folder (must not exist or be empty)")
    p.add_argument("--key-file", type=Path, help="file holding the 32-byte key (hex, base64 or raw)")
    p.add_argument("--key-env", default="LORA_CLUSTER_ADAPTER_KEY",
                   help="environment variable holding the key when no --key-file (default %(default)s)")
    p.add_argument("--generate-key", action="store_true",
                   help="create --key-file with a new random key first")
    p.set_defaults(handler=_run_encrypt)


def _run_encrypt(args: argparse.Namespace) -> int:
    from lora_cluster.errors import LoraClusterError
    from lora_cluster.store.crypto import encrypt_tree, generate_key_file, load_key

    try:
        if args.generate_key:
            if args.key_file is None:
                print("lora-cluster encrypt: --generate-key needs --key-file", file=sys.stderr)
                return 2
            generate_key_file(args.key_file)
            print(f"key: {args.key_file} (new; keep it secret)")
        key = load_key(args.key_env, str(args.key_file) if args.key_file else None)
        if key is None:
            print(f"lora-cluster encrypt: no key: pass --key-file or set ${args.key_env}", file=sys.stderr)
            return 2
        written = encrypt_tree(args.src, args.dst, key)
    except (LoraClusterError, OSError) as e:
        print(f"lora-cluster encrypt: {e}", file=sys.stderr)
        return 1
    for folder in written:
        print(f"encrypted: {folder}")
    return 0


def _add_server_options(p: argparse.ArgumentParser) -> None:
    from lora_cluster.client import DEFAULT_URL

    p.add_argument("--url", default=DEFAULT_URL, help="the server (default %(default)s)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer <key>`")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer (default 30)")


def _client(args: argparse.Namespace) -> LoraClusterClient:
    from lora_cluster.client import LoraClusterClient

    return LoraClusterClient(args.url, api_key=args.api_key, timeout_s=args.timeout)


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="show the cluster of a running server: nodes, replicas, adapters per tier, queues",
        description="Print the cluster controller's view (GET /v1/cluster) of a running server.")
    _add_server_options(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON view")
    p.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from lora_cluster.client import ServerError, status_lines

    try:
        view = _client(args).cluster()
    except ServerError as e:
        print(f"lora-cluster status: {e}", file=sys.stderr)
        return 1
    lines = [json.dumps(view, indent=2, sort_keys=True)] if args.json else status_lines(view, url=args.url)
    print("\n".join(lines))
    return 0


def _add_adapters(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("adapters", help="list, load or unload adapters on a running server",
                              description="Adapters of a running server: list (GET /v1/models), load and "
                              "unload (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="the base model and every adapter the server offers")
    listing.add_argument("--json", action="store_true", help="print the raw JSON list")
    load = actions.add_parser("load", help="serve the adapter folder PATH as NAME on every replica")
    load.add_argument("name", help="the adapter's name in requests (`model`)")
    load.add_argument("path", help="the adapter's folder, as the replicas see it")
    unload = actions.add_parser("unload", help="stop serving the adapter NAME loaded with `load`")
    unload.add_argument("name")
    for action in (listing, load, unload):
        _add_server_options(action)
    p.set_defaults(handler=_run_adapters)


def _run_adapters(args: argparse.Namespace) -> int:
    from lora_cluster.client import ServerError

    client = _client(args)
    try:
        if args.action == "list":
            models = client.models()
            if args.json:
                print(json.dumps(models, indent=2))
            for m in [] if args.json else models:
                where = "base model" if m.get("parent") is None else m.get("root", "")
                print(f"{m['id']}\t{where}")
        elif args.action == "load":
            print(client.load_adapter(args.name, args.path))
        else:
            print(client.unload_adapter(args.name))
    except ServerError as e:
        print(f"lora-cluster adapters {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def _add_usage(subparsers: argparse._SubParsersAction) -> None:
    from lora_cluster.tenancy.usage_store import GROUPS

    p = subparsers.add_parser("usage", help="usage for chargeback: requests, tokens, device-seconds",
                              description="Read the usage store (docs/metering.md): its file on the "
                              "UsageSink deployment's node, or a server's GET /v1/usage (--url): sums per "
                              "group over a time range, as a table or CSV.")
    p.add_argument("--db", default=None, help="the store's SQLite file or postgresql:// URL (default: "
                   "usage_store_uri of the config, else usage_db_path; LORA_CLUSTER_USAGE_STORE_URI, "
                   "LORA_CLUSTER_USAGE_DB_PATH)")
    p.add_argument("--url", default=None, help="read a running server's GET /v1/usage instead of a file")
    p.add_argument("--api-key", default=None, help="with --url: sent as `Authorization: Bearer <key>`")
    p.add_argument("--timeout", type=float, default=30.0, help="with --url: seconds to wait (default 30)")
    p.add_argument("--group-by", default="tenant", help=f"comma-separated, of {', '.join(GROUPS)} "
                   "(default tenant)")
    p.add_argument("--tenant", default=None, help="only this tenant's usage")
    p.add_argument("--adapter", default=None, help="only this adapter's usage")
    p.add_argument("--since", type=float, default=None, help="from this Unix time (seconds)")
    p.add_argument("--until", type=float, default=None, help="to this Unix time (seconds), excluded")
    p.add_argument("--format", choices=("table", "csv"), default="table", help="output (default table)")
    p.set_defaults(handler=_run_usage)


def _run_usage(args: argparse.Namespace) -> int:
    from lora_cluster.config import ServeConfig
    from lora_cluster.errors import LoraClusterError
    from lora_cluster.tenancy.usage_db import POSTGRES_SCHEMES
    from lora_cluster.tenancy.usage_store import UsageStore

    groups = tuple(g for g in args.group_by.split(",") if g)
    if args.url is not None:
        from lora_cluster.client import LoraClusterClient, ServerError

        try:
            rows = LoraClusterClient(args.url, api_key=args.api_key, timeout_s=args.timeout).usage(
                group_by=",".join(groups), tenant=args.tenant, adapter=args.adapter, since=args.since,
                until=args.until)
        except ServerError as e:
            print(f"lora-cluster usage: {e}", file=sys.stderr)
            return 1
        return _print_usage(rows, groups, args.format)
    tenancy = ServeConfig(model="-").tenancy
    location = args.db or tenancy.usage_store_uri or tenancy.usage_db_path
    if not location.startswith(POSTGRES_SCHEMES) and not Path(location).expanduser().is_file():
        print(f"lora-cluster usage: no usage store at {Path(location).expanduser()}", file=sys.stderr)
        return 1
    try:
        store = UsageStore(location)
    except Exception as e:  # a database that cannot be reached, psycopg missing: one line, no trace
        print(f"lora-cluster usage: cannot open the usage store: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    try:
        rows = store.query(group_by=groups, tenant=args.tenant, adapter=args.adapter, since=args.since,
                           until=args.until, residency=True)
    except LoraClusterError as e:
        print(f"lora-cluster usage: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return _print_usage(rows, groups, args.format)


def _print_usage(rows: list[dict[str, object]], groups: tuple[str, ...], fmt: str) -> int:
    import csv

    from lora_cluster.tenancy.usage_store import SUMS

    columns = [*groups, *SUMS, *(c for c in ("slot_s", "load_s") if rows and c in rows[0])]
    if fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([row[c] for c in columns] for row in rows)
        return 0
    cells = [columns, *([f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
                        for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return 0


def _add_release(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("release", help="stage a new adapter version as a canary release",
                              description="Adapter releases of a running server (/v1/adapters/NAME/"
                              "releases): create one, show them, promote, pause, resume or roll one back, "
                              "read its audit log. Answers are printed as JSON.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="load PATH as NAME's next version and release it")
    create.add_argument("name")
    create.add_argument("path", help="the candidate's folder, as the replicas see it")
    create.add_argument("--steps", help="canary steps in percent, comma-separated (e.g. 1,5,25,50,100)")
    create.add_argument("--min-requests", type=int, help="candidate requests a step needs")
    create.add_argument("--dwell", type=float, help="seconds a step lasts at least")
    create.add_argument("--eval-set", type=Path, help="a JSONL evaluation set ({prompt, expected}, {prompt, "
                        "choices, answer} or {prompt, schema} per line)")
    create.add_argument("--shadow", type=float, metavar="PERCENT",
                        help="percent of the stable version's greedy requests copied to the candidate")
    show = actions.add_parser("status", help="NAME's releases, or one release's status")
    show.add_argument("name")
    show.add_argument("id", nargs="?")
    parsers = [create, show]
    for action in ("promote", "pause", "resume", "rollback", "events"):
        command = actions.add_parser(action, help=f"{action} the release ID of NAME")
        command.add_argument("name")
        command.add_argument("id")
        parsers.append(command)
    for action_parser in parsers:
        _add_server_options(action_parser)
    p.set_defaults(handler=_run_release)


def _release_body(args: argparse.Namespace) -> dict[str, object]:
    body: dict[str, object] = {"lora_path": args.path}
    if args.steps:
        body["steps"] = [float(step) for step in args.steps.split(",")]
    if args.min_requests is not None:
        body["step_min_requests"] = args.min_requests
    if args.dwell is not None:
        body["step_dwell_s"] = args.dwell
    if args.shadow is not None:
        body["shadow_percent"] = args.shadow
    if args.eval_set is not None:
        lines = args.eval_set.read_text().splitlines()
        body["eval_set"] = [json.loads(line) for line in lines if line.strip()]
    return body


def _run_release(args: argparse.Namespace) -> int:
    from lora_cluster.client import ServerError

    client = _client(args)
    try:
        if args.action == "create":
            answer = client.create_release(args.name, _release_body(args))
        elif args.action == "status":
            answer = client.releases(args.name) if args.id is None else client.release(args.name, args.id)
        else:
            answer = client.release(args.name, args.id, args.action)
    except (ServerError, OSError, ValueError) as e:
        print(f"lora-cluster release {args.action}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_demo, _add_encrypt, _add_status, _add_adapters, _add_usage, _add_release]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(prog="lora-cluster", description="Serve many LoRA adapters on one model")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lora-cluster` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
