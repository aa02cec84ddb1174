"""The topology as text, one renderer for `homelab-llm hwcheck` and the app's Hardware screen.

Two views of the same facts: the nvidia-smi-style matrix (how each pair of GPUs connects, CPU and
NUMA affinity, P2P) with its legend, and the PCIe tree from each root port down to the GPUs with
the link each hop trained at (and could train at). Both take plain data, as `hwcheck --json`
writes it, so the app renders what a child process reported without importing the scanner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MATRIX_LEGEND = ("Legend: X self, PIX one PCIe bridge, PXB several bridges, PHB host bridge "
                 "(CPU root complex), NODE between host bridges in a NUMA node, SYS across NUMA "
                 "nodes; P2P: OK, NS not supported, ? unknown")


@dataclass(frozen=True)
class Matrix:
    connection: tuple[tuple[str, ...], ...]
    p2p: tuple[tuple[str, ...], ...]
    cpus: tuple[str | None, ...]
    numa: tuple[int | None, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Matrix:
        """hwcheck's topology JSON: connection, p2p, cpu_affinity, numa_affinity."""
        def grid(key: str) -> tuple[tuple[str, ...], ...]:
            return tuple(tuple(str(c) for c in row) for row in data.get(key) or [])

        connection = grid("connection")
        n = len(connection)
        cpus = tuple(data.get("cpu_affinity") or [None] * n)
        numa = tuple(data.get("numa_affinity") or [None] * n)
        return cls(connection, grid("p2p") or tuple(("?",) * n for _ in range(n)),
                   tuple(None if c is None else str(c) for c in cpus),
                   tuple(v if isinstance(v, int) else None for v in numa))


def render_matrix(matrix: Matrix) -> str:
    names = [f"GPU{i}" for i in range(len(matrix.connection))]
    header = ["", *names, "CPU Affinity", "NUMA Affinity"]
    rows = [header]
    for i, name in enumerate(names):
        rows.append([name, *matrix.connection[i], matrix.cpus[i] or "N/A",
                     "N/A" if matrix.numa[i] is None else str(matrix.numa[i])])
    rows.append([])
    rows.append(["P2P", *names])
    for i, name in enumerate(names):
        rows.append([name, *matrix.p2p[i]])
    widths = [max(len(r[c]) for r in rows if c < len(r)) for c in range(len(header))]
    text = ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join([*text, "", MATRIX_LEGEND])


@dataclass(frozen=True)
class TreeGpu:
    """One GPU and its path: hops from the GPU end up to the root port (hwcheck's `path`)."""

    label: str  # "GPU0 Radeon RX 7900 XTX"
    address: str
    attached_to: str  # "cpu" | "chipset" | ""
    hops: tuple[Mapping[str, Any], ...]


def _link(hop: Mapping[str, Any]) -> str:
    def one(gen: Any, width: Any) -> str:
        return f"Gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"

    now = one(hop.get("current_gen"), hop.get("current_width"))
    best = one(hop.get("max_gen"), hop.get("max_width"))
    return now if now == best else f"{now} of {best}"


def render_tree(gpus: Sequence[TreeGpu]) -> str:
    """Root ports, switches and GPUs as a tree; each line names the link into that node."""
    children: dict[str, list[str]] = {}
    edge: dict[str, str] = {}  # node -> link text of the hop into it
    label: dict[str, str] = {}
    roots: list[str] = []
    for gpu in gpus:
        chain = list(reversed(gpu.hops))  # root port end first
        if not chain:
            roots.append(gpu.address)
            label[gpu.address] = f"{gpu.label} {gpu.address} (on the host bridge, no link)"
            continue
        top = str(chain[0].get("upstream"))
        if top not in roots:
            roots.append(top)
            label.setdefault(top, f"{top} root port")
        for hop in chain:
            up, down = str(hop.get("upstream")), str(hop.get("downstream"))
            siblings = children.setdefault(up, [])
            if down not in siblings:
                siblings.append(down)
            edge[down] = _link(hop)
            label.setdefault(down, down)
        label[gpu.address] = f"{gpu.address} {gpu.label}" + (
            f" · {gpu.attached_to} lanes" if gpu.attached_to else "")
    lines: list[str] = []

    def walk(node: str, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└─ " if last else "├─ ")
        link = f"[{edge[node]}] " if node in edge else ""
        lines.append(f"{prefix}{branch}{link}{label.get(node, node)}")
        kids = children.get(node, [])
        deeper = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        for i, kid in enumerate(kids):
            walk(kid, deeper, i == len(kids) - 1, depth + 1)

    for root in roots:
        walk(root, "", True, 0)
    return "\n".join(lines)
