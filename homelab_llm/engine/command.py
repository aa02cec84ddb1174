"""`homelab-llm generate MODEL --prompt TEXT`: one completion, printed."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from homelab_llm.engine.args import EngineArgs

    p = subparsers.add_parser("generate", help="generate a completion offline and print it",
                              description="Generate a completion with the engine, no server.")
    p.add_argument("model", nargs="?", default="",
                   help="GGUF file, HF folder, or model_configs JSON with --load-format dummy "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", "-p", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print tokens as they come")
    EngineArgs.add_cli_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import itertools

    from homelab_llm.engine.args import EngineArgs
    from homelab_llm.engine.core import LLMEngine
    from homelab_llm.engine.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli(args)
    engine = LLMEngine(engine_args)
    prompt: str | list[int] = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=engine_args.seed)
    engine.add_request("generate-0", prompt, params)
    pieces: list[str] = []
    for _ in itertools.count():
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            pieces.append(out.new_text)
            if args.stream:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    if not args.stream:
        sys.stdout.write("".join(pieces))
    sys.stdout.write("\n")
    engine.shutdown()
    return 0
