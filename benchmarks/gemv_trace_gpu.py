"""Where each 1-2 row W4A16 GEMV of a graph-replayed decode step spends its time, per program.

    python3 benchmarks/gemv_trace_gpu.py [--config Llama-3.1-8B.json] [--batch 1] [--early]
                                         [--dump stamps.pt]

Builds the dummy W4A16 engine with kernels/program_trace.py enabled (every w4a16_h2 launch gets
a slice of the trace pool), decodes greedily with graphs as w4a16_regress.py does, then reads the
last replay's stamps and prints, per GEMV shape, medians over the layers (us):

  gap       the previous traced GEMV's last program end -> this one's first program start
            (negative: launched early under PDL; other kernels between two GEMVs count in it)
  lead      first start -> first program past its PDL wait
  rstd      per program, past the wait -> the norm's row scale computed (norm calls only)
  prologue  per program, past the wait -> the activation pairs written (norm, SiLU-and-mul)
  loop      per program, the K loop
  epilogue  per program, the split-K store, ticket and (last program) reduction
  work      first program past its wait -> last program's end
  SMs, most on one SM   how the programs spread

--early launches the GEMVs with PDL (HOMELAB_LLM_PDL_PLAIN without h2 and h2_wide), which
docs/BENCHMARKS.md 32.1 measured this way. The traced build's step is ~1% slower than untraced.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from w4a16_regress import graph_decode, make_engine  # noqa: E402


def program_rows(stamps) -> dict[str, float]:
    """One traced launch's summary (us) from its [programs, SLOTS] stamps (a CPU int64 tensor)."""
    from homelab_llm.engine.kernels.program_trace import START, WAITED

    sm, start, waited = stamps[:, 0], stamps[:, START], stamps[:, WAITED]
    marks = stamps[:, 3:6].double()
    per_sm = Counter(sm.tolist())

    def med(values) -> float:
        return float(values.median()) / 1e3

    rstd = stamps[:, 6].double()
    return dict(start=int(start.min()), end=int(marks[:, 2].max()),
                lead=(int(waited.min()) - int(start.min())) / 1e3,
                rstd=med(rstd - waited.double()) if bool((rstd > 0).all()) else float("nan"),
                prologue=med(marks[:, 0] - waited.double()), loop=med(marks[:, 1] - marks[:, 0]),
                epilogue=med(marks[:, 2] - marks[:, 1]),
                work=(int(marks[:, 2].max()) - int(waited.min())) / 1e3,
                sms=len(per_sm), most=max(per_sm.values()))


def last_replay(step_ms: float) -> list[tuple[str, dict]]:
    """(label, summary) of the launches the last graph replay wrote, in launch order: those whose
    programs started within one step of the latest end (older graphs' slices keep older times)."""
    from homelab_llm.engine.kernels import program_trace

    rows = [(c.label, c.stamps.cpu()) for c in program_trace.calls()]
    rows = [(label, program_rows(s)) for label, s in rows if int(s[:, 5].min()) > 0]
    latest = max(r["end"] for _, r in rows)
    recent = [(label, r) for label, r in rows if r["start"] >= latest - step_ms * 1e6]
    return sorted(recent, key=lambda lr: lr[1]["start"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="Llama-3.1-8B.json")
    p.add_argument("--batch", type=int, default=1, help="requests (1-2 rows take the traced GEMV)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--early", action="store_true", help="launch the 1-2 row GEMVs early under PDL")
    p.add_argument("--dump", help="also torch.save every traced launch's (label, raw stamps) here")
    a = p.parse_args()
    if a.early:
        os.environ["HOMELAB_LLM_PDL_PLAIN"] = "dot,dense,moe_w4"
    import torch

    from homelab_llm.engine.kernels import program_trace

    program_trace.enable(torch.device("cuda"))  # before the engine captures its graphs
    eng = make_engine(a.config, max_num_seqs=max(a.batch, 1))
    prompt = [100 + i % 1000 for i in range(32)]
    wall, gpu, _ = graph_decode(eng, prompt, a.tokens, batch=a.batch)
    print(f"GEMVTRACE {a.config} b{a.batch}{' early' if a.early else ''}: {a.batch * 1e3 / wall:.1f} tok/s, "
          f"graph {gpu:.3f} ms a step", flush=True)
    if a.dump:
        torch.save([(c.label, c.stamps.cpu()) for c in program_trace.calls()], a.dump)
    launches = last_replay(gpu)
    by_label: dict[str, list[dict]] = defaultdict(list)
    prev_end = None
    for label, r in launches:
        r["gap"] = (r["start"] - prev_end) / 1e3 if prev_end is not None else float("nan")
        prev_end = r["end"]
        by_label[label].append(r)
    fields = ("gap", "lead", "rstd", "prologue", "loop", "epilogue", "work", "sms", "most")
    for label, rs in by_label.items():
        cells = []
        for f in fields:
            values = [r[f] for r in rs if not math.isnan(r[f])]
            cells.append(f"{f} {statistics.median(values):.{0 if f in ('sms', 'most') else 2}f}"
                         if values else f"{f} -")
        print(f"GEMVTRACE {label}: {len(rs)} launches, {' '.join(cells)}", flush=True)
    total = sum(r["work"] for _, r in launches) / 1e3
    gaps = sum(r["gap"] for _, r in launches[1:]) / 1e3
    print(f"GEMVTRACE step: {len(launches)} GEMVs, work {total:.3f} ms, gaps before them {gaps:.3f} ms",
          flush=True)
    program_trace.disable()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
