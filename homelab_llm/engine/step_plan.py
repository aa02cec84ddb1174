"""A step's plan as int64 words, and the batch tensors a rank makes from it.

Rank 0 turns the schedule into one PlanHeader and one flat int64 payload on the host; every rank
(rank 0 included, and each tensor-parallel worker after receiving the same words) turns them into
device tensors with a single host-to-device copy from pinned memory. Building from the same words
is what keeps the ranks' batches identical.

Payload order: input_ids[T] positions[T] slot_mapping[T] query_start_loc[B+1] seq_lens[B]
page_table[B * P] logits_rows[R] state_indices[B] has_initial_state[B] (hybrid models' state
slots, else -1), on a model with a sliding page group (header.sliding, cache/page_groups.py)
sliding_slot_mapping[T] sliding_page_table[B * P], then the cache copies to run before the
forward (cache/copies.py words).
A sequence verifying K drafts has K+1 input rows (its last token, then the drafts) and K+1 logits
rows; every rank runs the same verify forward from these words. Those rows are K+1 one-token
"sequences" sharing a page table; every decode of such a step is padded to a group of K+1 rows
(hybrid models: the group's first state word carries the slot's pending rows, cache/
verify_slots.py), placed before any varlen sequence, and the header's verify_width and
decode_rows say so (plan_rows.py); a hybrid sequence with pending rows decodes as a group of one
row in any other step. An all-decode step stays decode-only: its
graphs apply, and decode attention reads each group's K/V once.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from homelab_llm.engine.cache.copies import CacheCopies
from homelab_llm.engine.cache.verify_slots import slot_word
from homelab_llm.engine.context import ForwardContext
from homelab_llm.engine.plan_rows import PlanRows

if TYPE_CHECKING:
    from homelab_llm.engine.scheduler import ScheduledSeq

# The header's `cmd`: what rank 0 asks of the other ranks (parallel/worker.py carries it out).
CMD_STEP, CMD_PAGES, CMD_ALLOCATE, CMD_MEMORY, CMD_SHUTDOWN, CMD_GRAPHS, CMD_MTP = range(7)


@dataclass(frozen=True)
class PlanHeader:
    """The fixed words in front of every message rank 0 sends (parallel/channel.py). A step fills
    the shape fields; any other command (its code in `cmd`) carries at most `arg`."""
    cmd: int
    num_tokens: int = 0  # T
    num_seqs: int = 0  # B
    max_pages: int = 0  # P: page-table columns
    num_logits: int = 0  # R: rows that sample
    decode_only: bool = False
    max_query_len: int = 0
    max_seq_len: int = 0
    payload_len: int = 0  # int64 words after the header, the patch section included
    # The payload's tail after the plan: async scheduling's patch section (TP), or a CMD_MTP
    # step's hidden-state rows.
    patch_len: int = 0
    arg: int = 0  # a command's argument: CMD_ALLOCATE the page count, CMD_GRAPHS max_model_len,
    # CMD_MTP the draft step (spec/mtp_draft.py)
    verify_width: int = 1  # hybrid verify steps: rows per sequence group (K+1), else 1
    decode_rows: int = 0  # hybrid verify steps: the leading decode-form rows (plan_rows.py)
    sliding: bool = False  # the payload carries the sliding page group's slots and page table

    def to_words(self) -> list[int]:
        return [int(w) for w in astuple(self)]

    @classmethod
    def from_words(cls, words: list[int]) -> PlanHeader:
        header = cls(*words)
        return replace(header, decode_only=bool(header.decode_only), sliding=bool(header.sliding))


HEADER_LEN = len(fields(PlanHeader))


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    context: ForwardContext
    num_tokens: int
    plan: tuple[PlanHeader, torch.Tensor] | None = None  # the words it was made from (TP sends them)
    # KV rows and state slots every rank copies, in order, before the forward.
    copies: CacheCopies = field(default_factory=CacheCopies)
    # Async scheduling under TP: (input rows, pending rows, pending tokens) the other ranks need.
    patch: tuple[list[int], list[int], torch.Tensor] | None = None


def plan_from_lists(input_ids: list[int], positions: list[int], slot_mapping: list[int],
                    query_lens: list[int], seq_lens: list[int], page_table: list[list[int]],
                    logits_rows: list[int], state_indices: list[int] | None = None,
                    has_initial_state: list[int] | None = None,
                    copies: CacheCopies | None = None, verify_width: int = 1,
                    decode_rows: int = 0, sliding: tuple[list[int], list[list[int]]] | None = None
                    ) -> tuple[PlanHeader, torch.Tensor]:
    """`sliding`: the sliding page group's (slot_mapping, page_table), on models that have one."""
    b = len(query_lens)
    max_pages = max((len(p) for p in page_table), default=1) or 1
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    table = _padded(page_table, max_pages)
    state = (state_indices if state_indices is not None else [-1] * b) + (
        has_initial_state if has_initial_state is not None else [0] * b)
    if sliding is not None:
        state += sliding[0] + _padded(sliding[1], max_pages)
    state += (copies or CacheCopies()).words()
    words = input_ids + positions + slot_mapping + starts + seq_lens + table + logits_rows + state
    payload = torch.tensor(words, dtype=torch.long)
    header = PlanHeader(CMD_STEP, len(input_ids), b, max_pages, len(logits_rows),
                        all(q == 1 for q in query_lens), max(query_lens, default=0),
                        max(seq_lens, default=0), payload.numel(), verify_width=verify_width,
                        decode_rows=decode_rows, sliding=sliding is not None)
    return header, payload


def _padded(tables: list[list[int]], width: int) -> list[int]:
    """Page tables as one row-major [len(tables), width] block (padding: page 0)."""
    out: list[int] = []
    for pages in tables:
        out.extend(pages)
        out.extend([0] * (width - len(pages)))
    return out


def _decode_form(item: ScheduledSeq) -> bool:
    """A sequence whose only uncomputed token is its last one (plus drafts)."""
    return (item.samples and item.num_new_tokens == len(item.spec) + 1
            and item.seq.num_computed_tokens > 0)


def _kv_slots(table: list[int], start: int, n: int, page_size: int) -> list[int]:
    return [table[p // page_size] * page_size + p % page_size for p in range(start, start + n)]


def _add_item(rows: PlanRows, item: ScheduledSeq, page_size: int, group_width: int,
              sliding: bool) -> list[int]:
    """Add one scheduled sequence's rows; its logits rows. group_width > 0: decode rows in a
    group of that width (hybrid models: the first row's state word carries the slot's pending
    rows, cache/verify_slots.py). `sliding`: the model has a sliding page group, whose slots and
    table go along."""
    seq, n, k = item.seq, item.num_new_tokens, len(item.spec)
    start = seq.num_computed_tokens
    ids = seq.token_ids[start:start + n - k] + item.spec  # drafts: one logits row each
    pt = seq.page_table
    kv = _kv_slots(pt, start, n, page_size)
    window = (_kv_slots(seq.sliding_table, start, n, page_size), seq.sliding_table) if sliding else None
    if group_width:
        states = [slot_word(seq)] + [seq.state_slot] * k if seq.state_slot >= 0 else [-1] * n
        return rows.add_decode_rows(ids, start, kv, pt, states, group_width, window)
    assert not (k and seq.state_slot >= 0), "a hybrid verify runs as decode rows (verify_width > 1)"
    assert not seq.gdn_pending, "a sequence with pending rows runs as decode rows"
    return rows.add_varlen(ids, start, kv, pt, k + 1 if item.samples else 0, seq.state_slot, window)


def build_plan(scheduled: list[ScheduledSeq], page_size: int, copies: CacheCopies | None = None,
               verify_width: int = 1, sliding: bool = False) -> tuple[PlanHeader, torch.Tensor]:
    """The plan of a scheduled step and the cache copies to run before it. verify_width: K+1
    when speculating (hybrid models group their decode rows by it), else 1. `sliding`: the model
    has a sliding page group (seq.sliding_table), whose slots and tables travel too."""
    rows = PlanRows()
    widths, order = plan_order(scheduled, verify_width)
    logits: dict[int, list[int]] = {}
    for i in order:
        logits[i] = _add_item(rows, scheduled[i], page_size, widths[i], sliding)
    logits_rows = [r for i in range(len(scheduled)) for r in logits[i]]
    return plan_from_lists(rows.ids, rows.positions, rows.slots, rows.query_lens, rows.seq_lens, rows.tables,
                           logits_rows, rows.state_slots, rows.has_initial, copies,
                           max([1, *widths]), sum(widths),
                           (rows.sliding_slots, rows.sliding_tables) if sliding else None)


def plan_order(scheduled: list[ScheduledSeq], verify_width: int) -> tuple[list[int], list[int]]:
    """Each scheduled item's decode-group width (0: a varlen query), and the order the plan lays
    the items out in (decode groups first). A step that verifies drafts lays every decode out as
    a group of verify_width rows; otherwise only a hybrid sequence with pending verify rows
    (cache/verify_slots.py) takes a group of one row, whose decode kernels apply them."""
    grouped = verify_width > 1 and any(item.spec for item in scheduled)
    widths = [(verify_width if grouped else 1) if _decode_form(item) and (grouped or item.seq.gdn_pending)
              else 0 for item in scheduled]
    return widths, sorted(range(len(scheduled)), key=lambda i: not widths[i])


def first_rows(scheduled: list[ScheduledSeq], verify_width: int) -> list[int]:
    """Each scheduled item's first input row in build_plan's layout (a verify group's rows come
    padded to verify_width; its real rows first)."""
    widths, order = plan_order(scheduled, verify_width)
    first = [0] * len(scheduled)
    row = 0
    for i in order:
        first[i] = row
        row += max(scheduled[i].num_new_tokens, widths[i])
    return first


class HostStager:
    """Pinned host buffers for host-to-device copies that never block the host behind queued GPU
    work (a pageable copy waits for the stream). Buffers rotate; before one is refilled, the copy
    that last read it must have finished (an event per buffer, almost always already passed)."""

    def __init__(self, device: torch.device, slots: int = 4) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a contiguous CPU tensor."""
        if not self.pinned:
            return host.to(self.device)
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        nbytes = host.numel() * host.element_size()
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[i] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        elif self._events[i] is not None:
            self._events[i].synchronize()
        staged = buf[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        event = self._events[i] = self._events[i] or torch.cuda.Event()
        event.record()
        return out


def batch_from_plan(header: PlanHeader, payload: torch.Tensor, device: torch.device, page_size: int,
                    stager: HostStager | None = None) -> StepBatch:
    t, b, max_pages = header.num_tokens, header.num_seqs, header.max_pages
    sizes = [t, t, t, b + 1, b, b * max_pages, header.num_logits, b, b]
    sizes += [t, b * max_pages] if header.sliding else [0, 0]
    sizes.append(payload.numel() - sum(sizes))  # the cache copies
    host_parts = torch.split(payload, sizes)
    starts = host_parts[3].tolist()
    dev_payload = stager.upload(payload) if stager is not None else payload.to(device)
    (ids, pos, slots, qsl, lens, table, logits_idx, state_idx, has_init, sliding_slots,
     sliding_table, _) = torch.split(dev_payload, sizes)
    ctx = ForwardContext(
        positions=pos, slot_mapping=slots,
        query_start_loc=qsl.to(torch.int32), seq_lens=lens.to(torch.int32),
        page_table=table.view(b, max_pages).to(torch.int32),
        max_query_len=header.max_query_len, max_seq_len=header.max_seq_len, page_size=page_size,
        decode_only=header.decode_only,
        query_lens_host=[starts[i + 1] - starts[i] for i in range(b)],
        seq_lens_host=host_parts[4].tolist(),
        state_indices=state_idx.to(torch.int32), has_initial_state=has_init.to(torch.bool),
        verify_width=header.verify_width, decode_rows=header.decode_rows)
    if header.sliding:
        ctx.sliding_slot_mapping = sliding_slots
        ctx.sliding_page_table = sliding_table.view(b, max_pages).to(torch.int32)
    return StepBatch(input_ids=ids, positions=pos, logits_indices=logits_idx, context=ctx, num_tokens=t,
                     plan=(header, payload), copies=CacheCopies.from_words(host_parts[11].tolist()))
