"""How many running state slots speculative decoding adds on hybrid models: the spares the verify
rows write their Gated DeltaNet states into (cache/verify_slots.py takes and returns them). The
runner allocates them and the memory plan counts them from this one rule; torch-free, since
`homelab-llm plan` imports it."""

from __future__ import annotations

MAX_VERIFYING_SEQS = 8


def spare_slot_count(max_num_seqs: int, num_speculative_tokens: int, disable_by_batch_size: int = 0) -> int:
    """Running slots beyond max_num_seqs that speculation needs (K per verifying sequence). With
    --speculative-config's disable_by_batch_size B, no step with more than B running sequences
    drafts, so at most B verify at once."""
    verifying = min(max_num_seqs, MAX_VERIFYING_SEQS, disable_by_batch_size or max_num_seqs)
    return num_speculative_tokens * verifying
