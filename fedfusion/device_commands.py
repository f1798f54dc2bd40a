"""The ``fedfusion`` commands for phones: ``export-device`` (a tier's on-device training program), ``gateway``
(the HTTP service phones train through) and ``device`` (the reference device). See docs/devices.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_export_device(args: argparse.Namespace) -> int:
    """Export the recipe's tier's training program and manifest into ``--out``."""
    from fedfusion.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe or tier is reported before anything is written
    from fedfusion.device_program import export_tier, tier_config

    tier_config(recipe, args.tier)
    program = export_tier(recipe, args.tier)
    paths = program.save(Path(args.out))
    m = program.manifest
    params = sum(_numel(p["shape"]) for p in m["parameters"])
    print(f"{args.tier}: {m['family']} sub-model, {params:,} parameters, input {m['inputs'][0]['shape']}, "
          f"exported in {m['export_s']} s")
    for kind, path in paths.items():
        print(f"  {kind}: {path} ({path.stat().st_size:,} bytes)")
    return 0


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def cmd_gateway(args: argparse.Namespace) -> int:
    """Serve phones until interrupted."""
    from fedfusion.gateway import Gateway, GatewayServer, Tokens

    host, _, port = args.listen.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--listen {args.listen!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    programs = Path(args.programs)
    programs.mkdir(parents=True, exist_ok=True)
    server = GatewayServer((host or "127.0.0.1", int(port)), Gateway(Tokens(Path(args.tokens)), programs))
    print(f"device gateway on {server.url} (programs in {programs}); Ctrl-C stops it", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_device(args: argparse.Namespace) -> int:
    """Run the reference device against a gateway."""
    from fedfusion.reference_device import DeviceRefused, ReferenceDevice

    device = ReferenceDevice(args.gateway, args.token, args.threads)
    try:
        done = device.serve(tasks=args.tasks, idle_s=args.idle)
    except DeviceRefused as exc:
        print(f"error: {exc}")
        return 3
    print(json.dumps({"tasks": done}))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the device commands to the ``fedfusion`` parser."""
    export = sub.add_parser("export-device", help="write a tier's on-device (ExecuTorch) training program + manifest")
    export.add_argument("recipe")
    export.add_argument("overrides", nargs="*")
    export.add_argument("--tier", required=True, help="the device tier, e.g. phone")
    export.add_argument("--out", default="device-programs", help="folder for <id>.pte, <id>.ptd, <id>.json")
    export.set_defaults(func=cmd_export_device)
    gateway = sub.add_parser("gateway", help="serve phones over HTTP for a SuperNode (docs/devices.md)")
    gateway.add_argument("--listen", default="127.0.0.1:8765", help="HOST:PORT")
    gateway.add_argument("--tokens", required=True, help='JSON file {"node": secret, "devices": {token: name}, "revoked": []}')
    gateway.add_argument("--programs", default="device-programs", help="folder of exported programs (filled on demand)")
    gateway.set_defaults(func=cmd_gateway)
    device = sub.add_parser("device", help="the reference device: train a gateway's tasks through ExecuTorch")
    device.add_argument("--gateway", required=True, help="the gateway's URL, e.g. http://127.0.0.1:8765")
    device.add_argument("--token", required=True, help="this device's token")
    device.add_argument("--tasks", type=int, help="stop after this many tasks (default: run until interrupted)")
    device.add_argument("--idle", type=float, help="stop after this many seconds without a task")
    device.add_argument("--threads", type=int, default=1, help="CPU threads of the runtime's host side")
    device.set_defaults(func=cmd_device)
