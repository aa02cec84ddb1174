"""`homelab-llm pull REPO_ID`: download a model from the Hugging Face Hub into its cache, after
saying whether it fits this machine. Progress goes to stderr (one updating line on a terminal,
a line per step otherwise); the snapshot folder is printed on stdout, ready for a preset."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from homelab_llm.models.pull import FitCheck, PullProgress


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from homelab_llm.models.command import add_machine_args

    p = subparsers.add_parser(
        "pull", help="download a model from the Hugging Face Hub",
        description="Download REPO_ID into the Hugging Face cache (resumable; HF_TOKEN and "
                    "HF_ENDPOINT honoured). The fit is checked first (config.json against "
                    "`plan` at int8 KV); a model that is unsupported or does not fit is refused "
                    "unless --force.")
    p.add_argument("repo_id", metavar="REPO_ID", help="e.g. Qwen/Qwen3-8B-AWQ")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="only files matching this glob (repeatable), e.g. '*Q4_K_M.gguf'")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    add_machine_args(p)
    p.add_argument("--force", action="store_true", help="download even if it does not fit")
    p.set_defaults(run=run)
    return p


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:,.1f}"


class ProgressPrinter:
    """Renders PullProgress: a carriage-return line on a terminal, sparse lines in a log."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, progress: PullProgress) -> None:
        p = progress.file
        if progress.file_index == 0:  # config.json for the fit check
            return
        pct = f"{100 * p.done_bytes / p.total_bytes:5.1f}%" if p.total_bytes else "     "
        resumed = f" (resumed at {_mb(p.resumed_from)} MB)" if p.resumed_from else ""
        line = (f"[{progress.file_index}/{progress.file_count}] {p.filename}  {_mb(p.done_bytes)} / "
                f"{_mb(p.total_bytes)} MB  {pct}  {p.rate_bps / 1e6:,.1f} MB/s{resumed}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if p.finished else ""))
        elif p.finished or p.done_bytes == p.resumed_from:
            self.stream.write(line + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from homelab_llm.models.command import machine_from_args
    from homelab_llm.models.pull import pull

    machine = machine_from_args(args.gpu_memory, args.tensor_parallel_size)

    def say_fit(check: FitCheck) -> None:
        print(check.verdict, file=sys.stderr, flush=True)

    result = pull(args.repo_id, include=args.include, revision=args.revision, machine=machine,
                  force=args.force, on_fit=say_fit, on_progress=ProgressPrinter(sys.stderr))
    print(f"{args.repo_id}: {len(result.repo.files)} files, {result.repo.total_bytes / 1e6:,.1f} MB "
          f"at {result.repo.commit[:12]}", file=sys.stderr)
    print(result.path)
    return 0
