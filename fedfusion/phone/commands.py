"""The ``fedfusion`` commands for phones: ``export-device`` (a tier's on-device training program), ``gateway``
(the HTTP service phones train through) and ``device`` (the reference device). See docs/devices.md.

Part of the CLI (``fedfusion.cli`` adds these parsers), so it may use what a run is built from (``fedfusion.run``);
the rest of ``fedfusion.phone`` needs only models, training and the wire."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from fedfusion.config.methods import LORA, SUBMODEL
from fedfusion.fusion.lora.config import LoRAConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from fedfusion.config.recipe import Recipe
    from fedfusion.models.slicing import SlicePlan
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
    for program, rounds in export_phases(recipe, args.tier):
        _report(args.tier, program, program.save(Path(args.out)), rounds)
    return 0


def export_phases(recipe: Recipe, tier: str) -> list[tuple[DeviceProgram, str]]:
    """The programs a tier trains the recipe with, each with the rounds it serves: with full-forward windows after
    ``fusion.grow_round`` rounds of the small model (the quickstart), the small model's slice program for rounds
    1..N (the gateway finds it by its shape for those rounds' messages) and the window program after; else one."""
    program = export_tier(recipe, tier)
    grow = recipe.fusion.grow_rounds() if recipe.fusion.method == SUBMODEL else 0
    if recipe.fusion.forward != "full" or not grow:
        return [(program, f"1..{recipe.rounds}")]
    from fedfusion.fusion.plan import recipe_target
    from fedfusion.fusion.submodel.plan import sliced_config
    from fedfusion.phone.program import export_program

    small = sliced_config(recipe_target(recipe.model, recipe.data_source()), min(recipe.fusion.widths.values()),
                          recipe.fusion.axes or None)
    before = export_program(small, recipe.train.batch_size, recipe.train.seq_len, recipe.train, recipe.seed)
    return [(before, f"1..{grow}"), (program, f"{grow + 1}..{recipe.rounds}")]


def _report(tier: str, program: DeviceProgram, paths: dict[str, Path], rounds: str) -> None:
    """What ``export-device`` prints for one program."""
    m = program.manifest
    params = sum(_numel(p["shape"]) for p in m["parameters"])
    if "adapter" in m:
        a = m["adapter"]
        what = (f"rank-{a['rank']} LoRA adapter ({params:,} trained parameters) on a "
                f"{a['base_bits'] or 32}-bit frozen {m['family']} base of {a['base_params']:,} parameters (the ptd)")
    elif "window" in m:
        w = m["window"]
        units = ", ".join(f"{n} {axis}" for axis, n in w["per_layer"].items())
        what = (f"full-forward window ({params:,} trained parameters: {units} of every layer"
                f"{', shared tensors' if w['shared'] else ''}) in a frozen {w['frozen_dtype']} {m['family']} target of "
                f"{w['target_params']:,} parameters (in the data file, {w['frozen_bytes']:,} bytes)")
    else:
        what = f"{m['family']} sub-model, {params:,} parameters"
    print(f"{tier} (rounds {rounds}): {what}, input {m['inputs'][0]['shape']}, exported in {m['export_s']} s")
    for kind, path in paths.items():
        print(f"  {kind}: {path} ({path.stat().st_size:,} bytes)")


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
    except OSError as exc:  # registration: the gateway cannot be reached at all (a wrong URL, nothing listening)
        print(f"error: gateway {args.gateway} unreachable: {exc}")
        return 4
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
    (or full-forward windows) and LoRA, a tier without a width or a rank, or a setting the program cannot follow."""
    if recipe.fusion.method == LORA:
        lora = recipe.section(LoRAConfig)
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
    """The model config a tier trains under the recipe: its width's slice of the target along the recipe's axes
    (the shape every slicing policy gives that width), or with ``fusion.forward=full`` the whole target."""
    from fedfusion.fusion.plan import recipe_target
    from fedfusion.fusion.submodel.plan import fit_widths, sliced_config  # torch: after the recipe is checked

    if recipe.fusion.method != SUBMODEL:
        raise ValueError(f"fusion.method {recipe.fusion.method!r}: on-device programs exist for width slices "
                         "(fusion.method=submodel) and LoRA adapters (fusion.method=lora) only")
    fit_widths(recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
    if tier not in recipe.fusion.widths:
        raise ValueError(f"--tier {tier!r}: the recipe's fusion.widths has {', '.join(recipe.fusion.widths)}")
    if recipe.fusion.forward == "full":
        check_window(recipe)
        return recipe_target(recipe.model, recipe.data_source())
    return sliced_config(recipe_target(recipe.model, recipe.data_source()), recipe.fusion.widths[tier],
                         recipe.fusion.axes or None)


def check_window(recipe: Recipe) -> None:
    """ValueError (one line, naming the setting) for a full-forward window the program cannot train: a window's
    shape must stay fixed for the run and it must be a window of units (:mod:`fedfusion.phone.window`)."""
    f = recipe.fusion
    if f.window_rank:
        raise ValueError(f"fusion.window_rank={f.window_rank}: a device program trains a window of units, not "
                         "low-rank updates of every matrix; on-device full-forward windows need fusion.window_rank=0")
    if f.window_core and not f.window_outside_core:
        raise ValueError("fusion.window_core=true: the core's union with a window moving over every unit changes the "
                         "window's size round to round, and a device program's shape is fixed; set "
                         "fusion.window_outside_core=true (each window drawn outside the core) or fusion.window_core=false")
    if f.window_core and f.core_forward == "small":
        raise ValueError("fusion.core_forward=small: the core trains in the small model's own forward pass, which a "
                         "window program does not run; on-device core windows need fusion.core_forward=full")
    if "depth" in (f.axes or ()):
        raise ValueError("fusion.axes with depth: a window's layers change round to round, and with them which target "
                         "tensor each window tensor is; an on-device window slices units (heads, neurons)")


def tier_window(recipe: Recipe, tier: str, target: PretrainedConfig) -> SlicePlan:
    """The window a full-forward tier trains in ``target`` (:func:`tier_config`'s), at the static policy's positions:
    its shape (units per axis, the shared tensors or not) is the one every round's window of that tier has."""
    from fedfusion.models.full_forward import window_axes, with_core
    from fedfusion.models.slicing import plan_slice

    f = recipe.fusion
    axes = window_axes(target, tuple(f.axes) if f.axes else None)
    core = min(f.widths.values()) if f.window_core else 0.0
    plan = replace(plan_slice(target, f.window_widths.get(tier, f.widths[tier]), "static", axes=axes, scale=False,
                              skip=core), shared=f.window_shared)
    if not core:
        return plan
    return with_core(plan, plan_slice(target, core, "static", axes=tuple(f.axes) if f.axes else None))  # one shape


def export_tier(recipe: Recipe, tier: str) -> DeviceProgram:
    """The training program of ``tier``'s sub-model, of its LoRA adapter on the recipe's frozen base (loaded in
    float32, held in the tier's ``lora.quantize`` bits) or of its full-forward window, fed the recipe's batch and
    sequence shape."""
    from fedfusion.phone.program import export_lora_program, export_program
    from fedfusion.phone.window import export_window_program

    check_tier(recipe, tier)
    if recipe.fusion.method == LORA:
        from fedfusion.models.pretrained import load_base

        lora = recipe.section(LoRAConfig)
        return export_lora_program(load_base(lora.base), list(lora.target_modules), lora.ranks[tier], lora.alpha,
                                   recipe.train.batch_size, recipe.train.seq_len, recipe.train, recipe.seed,
                                   lora.quantize.get(tier, 0), lora.base)
    config = tier_config(recipe, tier)
    if recipe.fusion.forward == "full":
        return export_window_program(config, tier_window(recipe, tier, config), recipe.train.batch_size,
                                     recipe.train.seq_len, recipe.train, recipe.seed, recipe.fusion.frozen_dtype)
    return export_program(config, recipe.train.batch_size, recipe.train.seq_len, recipe.train, recipe.seed)
