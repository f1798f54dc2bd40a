"""The ``fedfusion`` commands for phones: ``export-device`` (a tier's on-device training program), ``gateway``
(the HTTP service phones train through) and ``device`` (the reference device). See docs/devices.md.

Part of the CLI (``fedfusion.cli`` adds these parsers), so it may use what a run is built from (``fedfusion.run``);
the rest of ``fedfusion.phone`` needs only models, training and the wire."""

from __future__ import annotations

import argparse
import json
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from fedfusion.config.methods import LORA, SUBMODEL

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from fedfusion.config.recipe import Recipe
    from fedfusion.phone.program import DeviceProgram


def needs_executorch(command: str) -> None:
    """The device commands run ExecuTorch, the ``device`` extra: without it, say how to install it (a ValueError,
    which the CLI prints as one line) instead of failing on the first import."""
    if find_spec("executorch") is None:
        raise ValueError(f"fedfusion {command} needs ExecuTorch: pip install 'fedfusion[device]'")


def cmd_export_device(args: argparse.Namespace) -> int:
    """Export the recipe's tier's training program and manifest into ``--out``."""
    from fedfusion.run.check import load_checked

    needs_executorch("export-device")  # first: it takes no torch, so a missing extra is said in a second
    recipe = load_checked(args.recipe, args.overrides)  # a bad recipe or tier is reported before anything is written
    check_tier(recipe, args.tier)
    program = export_tier(recipe, args.tier)
    paths = program.save(Path(args.out))
    m = program.manifest
    params = sum(_numel(p["shape"]) for p in m["parameters"])
    if "adapter" in m:
        a = m["adapter"]
        what = (f"rank-{a['rank']} LoRA adapter ({params:,} trained parameters) on a "
                f"{a['base_bits'] or 32}-bit frozen {m['family']} base of {a['base_params']:,} parameters (the ptd)")
    else:
        what = f"{m['family']} sub-model, {params:,} parameters"
    print(f"{args.tier}: {what}, input {m['inputs'][0]['shape']}, exported in {m['export_s']} s")
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
    needs_executorch("gateway")
    from fedfusion.phone.gateway import Gateway, GatewayServer, Tokens

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
    needs_executorch("device")
    from fedfusion.phone.reference import DeviceRefused, ReferenceDevice

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


def check_tier(recipe: Recipe, tier: str) -> None:
    """ValueError (one line) where the recipe's ``tier`` has no on-device program: a method other than width slices
    and LoRA, a tier without a width or a rank, or a LoRA setting the program cannot follow."""
    if recipe.fusion.method == LORA:
        lora = recipe.lora
        if tier not in lora.ranks:
            raise ValueError(f"--tier {tier!r}: the recipe's lora.ranks has {', '.join(lora.ranks)}")
        if lora.method == "flora":
            raise ValueError("lora.method=flora: each round sends a frozen merged update (m.merged_*), which a device "
                             "program has no input for; on-device LoRA takes fedavg, zeropad, hetlora or flexlora")
        if lora.dropout:
            raise ValueError(f"lora.dropout={lora.dropout}: a device program would draw its own dropout masks, "
                             "unlike torch's; on-device LoRA needs lora.dropout=0")
        return
    tier_config(recipe, tier)


def tier_config(recipe: Recipe, tier: str) -> PretrainedConfig:
    """The sub-model config a tier trains under the recipe: its width's slice of the target along the recipe's
    axes (the shape every slicing policy gives that width)."""
    from fedfusion.run.planner import fit_widths, recipe_target, sliced_config  # torch: after the recipe is checked

    if recipe.fusion.method != SUBMODEL:
        raise ValueError(f"fusion.method {recipe.fusion.method!r}: on-device programs exist for width slices "
                         "(fusion.method=submodel) and LoRA adapters (fusion.method=lora) only")
    if recipe.fusion.forward == "full":
        raise ValueError("fusion.forward=full: no on-device program exists yet for a full-forward window (the frozen "
                         "target with a trainable window written in); phones take width slices (fusion.forward=slice)")
    fit_widths(recipe)
    if tier not in recipe.fusion.widths:
        raise ValueError(f"--tier {tier!r}: the recipe's fusion.widths has {', '.join(recipe.fusion.widths)}")
    return sliced_config(recipe_target(recipe), recipe.fusion.widths[tier], recipe.fusion.axes or None)



def export_tier(recipe: Recipe, tier: str) -> DeviceProgram:
    """The training program of ``tier``'s sub-model, or of its LoRA adapter on the recipe's frozen base (loaded in
    float32, held in the tier's ``lora.quantize`` bits), fed the recipe's batch and sequence shape."""
    from fedfusion.phone.program import export_lora_program, export_program

    check_tier(recipe, tier)
    if recipe.fusion.method == LORA:
        from fedfusion.models.pretrained import load_base

        lora = recipe.lora
        return export_lora_program(load_base(lora.base), list(lora.target_modules), lora.ranks[tier], lora.alpha,
                                   recipe.train.batch_size, recipe.train.seq_len, recipe.train, recipe.seed,
                                   lora.quantize.get(tier, 0), lora.base)
    return export_program(tier_config(recipe, tier), recipe.train.batch_size, recipe.train.seq_len, recipe.train,
                          recipe.seed)
