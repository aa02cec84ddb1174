"""`homelab-llm router`: one OpenAI-compatible endpoint in front of every routable preset.

Presets start when a request names them, unload after --ttl idle seconds (a preset's own `ttl`
wins), and swap when the GPUs cannot hold them together (claims estimated from the presets'
memory settings and `plan`; budget: the GPUs hwcheck finds, or --gpu-memory x --gpus).
"""

from __future__ import annotations

import argparse

from homelab_llm.errors import HomelabError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from homelab_llm.engine.args import parse_bytes

    p = subparsers.add_parser(
        "router", help="one OpenAI endpoint in front of every preset",
        description="Serve /v1/* on one port; a request's `model` names a preset, which starts on "
                    "demand and unloads when idle. Default port and preset come from the settings "
                    "file (router_port, default_preset).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: router_port from the "
                   "settings file, else 8000")
    p.add_argument("--ttl", type=float, default=300.0,
                   help="seconds a preset may sit idle before it is stopped (0: never)")
    p.add_argument("--gpu-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="memory per GPU for the swap budget (default: the GPUs hwcheck finds)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the budget (with --gpu-memory)")
    p.add_argument("--preset", action="append", default=[], metavar="NAME",
                   help="route only these presets (repeatable; default: every routable one)")
    p.set_defaults(run=run)
    return p


def budget_from_args(gpu_memory: int | None, gpus: int | None) -> tuple[int, int | None]:
    """(memory per GPU, total budget); (0, None) on a machine without GPUs: no swapping."""
    from homelab_llm.models.fit import this_machine

    if gpus is not None and gpus < 1:
        raise HomelabError(f"--gpus must be >= 1, got {gpus}")
    if gpu_memory is not None:
        return gpu_memory, gpu_memory * (gpus or 1)
    found = this_machine()
    if found is None:
        return 0, None
    count = gpus or found.tensor_parallel_size
    return found.gpu_memory_bytes, found.gpu_memory_bytes * count


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from homelab_llm.presets import list_presets
    from homelab_llm.router.app import build_router_app
    from homelab_llm.router.pool import Pool
    from homelab_llm.settings import load_settings

    settings = load_settings()
    port = args.port if args.port is not None else settings.router_port
    if not 1 <= port <= 65535:
        raise HomelabError(f"--port must be 1-65535, got {port}")
    if args.ttl < 0:
        raise HomelabError(f"--ttl must be >= 0 seconds, got {args.ttl}")
    presets = [p for p in list_presets() if p.routable]
    if args.preset:
        known = {p.name for p in presets}
        missing = [n for n in args.preset if n not in known]
        if missing:
            raise HomelabError(f"--preset {missing[0]!r} is not a routable preset "
                               f"(known: {', '.join(sorted(known)) or 'none'})")
        presets = [p for p in presets if p.name in args.preset]
    if settings.default_preset and settings.default_preset not in {p.name for p in presets}:
        raise HomelabError(f"default_preset {settings.default_preset!r} in the settings file is "
                           "not a routable preset; fix it or remove it")
    from homelab_llm.tui.service import check_port_free

    check_port_free(args.host, port)
    gpu_memory, budget = budget_from_args(args.gpu_memory, args.gpus)
    pool = Pool(presets, ttl_s=args.ttl, gpu_memory=gpu_memory, gpu_budget=budget)
    app = build_router_app(pool, default_preset=settings.default_preset)
    names = ", ".join(sorted(pool.slots)) or "none"
    print(f"router on http://{args.host}:{port}/v1 for presets: {names}", flush=True)
    uvicorn.run(app, host=args.host, port=port, log_level="warning")
    return 0
