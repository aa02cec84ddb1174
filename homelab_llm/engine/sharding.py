"""How a model splits over tensor-parallel ranks: the one place that knows. Torch-free.

Every dimension a model shards is a Split listed by `required_splits(config)`; the sizes every
split accepts are `valid_tp_sizes(config)`, and `check_tp_size` is the one error a user sees,
naming them. The layers (layers/linear.py, layers/embedding.py) take their rank's share with the
helpers below and memory planning (memory.py) sizes with the same ones, so a size the launcher
accepts always loads and always plans.

A new model family adds its splits to `required_splits` and nothing else here: a hybrid Gated
DeltaNet model its key/value heads and conv channels, an MoE its expert intermediate size (the
dense MLP's only while some layer has one: Qwen3-Next-80B's intermediate_size is unused).
"""

from __future__ import annotations

from dataclasses import dataclass

from homelab_llm.engine.model.config import ModelConfig, UnsupportedModelError


class ShardingError(UnsupportedModelError):
    """A tensor-parallel size that does not split this model; the message names the valid ones."""


@dataclass(frozen=True)
class Split:
    """A dimension split evenly: each rank gets total / tp_size."""
    name: str
    total: int

    def problem(self, tp_size: int) -> str | None:
        """Why tp_size cannot split this dimension, or None when it can."""
        if self.total % tp_size:
            return f"the {self.name} ({self.total}) is not divisible by {tp_size}"
        return None


@dataclass(frozen=True)
class PaddedSplit(Split):
    """A dimension split in equal padded slices of ceil(total / tp_size) (the vocabulary: the
    padding rows are zero and their logits are cut off after the gather). No rank may be empty."""

    def problem(self, tp_size: int) -> str | None:
        if (tp_size - 1) * -(-self.total // tp_size) >= self.total:
            return f"the {self.name} ({self.total}) leaves a rank empty over {tp_size} ranks"
        return None


@dataclass(frozen=True)
class HeadSplit(Split):
    """Attention heads, split in whole KV groups (each KV head with its query heads). Any size up
    to the KV heads (uneven shares go to the first ranks); above that each KV head is replicated,
    so the size must be a multiple of the KV heads and divide the query heads."""
    kv_heads: int = 1

    def problem(self, tp_size: int) -> str | None:
        q, kv = self.total, self.kv_heads
        if tp_size > kv and (tp_size % kv or q % tp_size):
            return (f"above {kv} ranks the size must divide the {q} query heads and be a multiple "
                    f"of the {kv} KV heads")
        return None


def required_splits(config: ModelConfig) -> list[Split]:
    """Every dimension this model's layers split over the ranks (add a family's splits here)."""
    splits: list[Split] = [
        HeadSplit("attention heads", config.num_attention_heads, config.num_key_value_heads),
        PaddedSplit("vocabulary", config.vocab_size),
    ]
    if len(config.moe_layers) < config.num_hidden_layers:  # some layer has a dense MLP
        splits.insert(1, Split("MLP intermediate size", config.intermediate_size))
    if config.is_hybrid:  # Gated DeltaNet key and value heads (and their conv channels); a
        # Qwen3-Next checkpoint's per-key-head interleaved projections are cut into these parts
        # before the split (model/split_tensor.py), so the same heads rule holds for it
        splits += [Split("linear-attention key heads", config.linear_num_key_heads),
                   Split("linear-attention value heads", config.linear_num_value_heads)]
    if config.is_moe:  # every expert's intermediate dim (no expert parallelism)
        splits.append(Split("expert intermediate size (moe_intermediate_size)",
                            config.moe_intermediate_size))
        if config.has_shared_expert:
            splits.append(Split("shared expert intermediate size",
                                config.shared_expert_intermediate_size))
    return splits


def tp_size_problems(config: ModelConfig, tp_size: int) -> list[str]:
    return [p for s in required_splits(config) if (p := s.problem(tp_size)) is not None]


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """The sizes every split accepts (never more ranks than query heads)."""
    return [n for n in range(1, config.num_attention_heads + 1) if not tp_size_problems(config, n)]


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    if tp_size < 1:
        raise ShardingError(f"--tensor-parallel-size {tp_size} must be at least 1")
    problems = tp_size_problems(config, tp_size)
    if problems:
        valid = ", ".join(map(str, valid_tp_sizes(config)))
        raise ShardingError(f"--tensor-parallel-size {tp_size} cannot split this model: "
                            f"{'; '.join(problems)}; valid sizes: {valid}")


def even_shard(total: int, tp_size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, size) of an evenly split dimension; uneven splits are an error naming the sizes."""
    problem = Split(what, total).problem(tp_size)
    if problem is not None:
        raise ShardingError(f"--tensor-parallel-size {tp_size}: {problem}")
    size = total // tp_size
    return rank * size, size


def padded_shard(total: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(start, padded size) of a PaddedSplit; the rank's real rows end at min(start + size, total)."""
    size = -(-total // tp_size)
    return rank * size, size


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns (see HeadSplit)."""
    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        # Ranks get floor or ceil of num_kv/tp groups, larger shares first: 3 kv / 2 ranks = 2 + 1.
        base, extra = divmod(num_kv_heads, tp_size)
        kv_heads = base + (rank < extra)
        kv_start = rank * base + min(rank, extra)
        return HeadShard(kv_start * group, kv_heads * group, kv_start, kv_heads)
    problem = HeadSplit("attention heads", num_heads, num_kv_heads).problem(tp_size)
    if problem is not None:
        raise ShardingError(f"--tensor-parallel-size {tp_size}: {problem}")
    replicas = tp_size // num_kv_heads
    q_heads = num_heads // tp_size
    return HeadShard(rank * q_heads, q_heads, rank // replicas, 1)
