"""The one TP split rule (engine/sharding.py): valid sizes come from every split the model needs,
so the launcher never accepts a size whose MLP (or vocab) split fails later in weight loading."""

from __future__ import annotations

import pytest

from homelab_llm.engine.model.config import ModelConfig, UnsupportedModelError
from homelab_llm.engine.sharding import (ShardingError, check_tp_size, even_shard, padded_shard,
                                         required_splits, valid_tp_sizes)


def _config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=64,
                intermediate_size=192, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8)
    base.update(kw)
    return ModelConfig(**base)


def test_valid_sizes_honour_every_split() -> None:
    # heads alone allow 1, 2, 4, 8; an MLP of 196 rows (not divisible by 8) drops 8
    assert valid_tp_sizes(_config()) == [1, 2, 4, 8]
    assert valid_tp_sizes(_config(intermediate_size=196)) == [1, 2, 4]
    names = [s.name for s in required_splits(_config())]
    assert names == ["attention heads", "MLP intermediate size", "vocabulary"]


def test_check_names_the_failing_split_and_the_valid_sizes() -> None:
    with pytest.raises(ShardingError, match=r"MLP intermediate size \(196\) is not divisible by 8; "
                                            r"valid sizes: 1, 2, 4$"):
        check_tp_size(_config(intermediate_size=196), 8)
    with pytest.raises(UnsupportedModelError, match=r"multiple of the 2 KV heads.*valid sizes"):
        check_tp_size(_config(), 7)
    check_tp_size(_config(), 4)  # no error


def test_vocab_split_leaves_no_rank_empty() -> None:
    # 5 rows over 4 ranks as padded slices of 2: the last rank would start past the end
    assert valid_tp_sizes(_config(vocab_size=5, num_attention_heads=4, num_key_value_heads=4,
                                  intermediate_size=12)) == [1, 2, 3]
    assert padded_shard(320, 3, 2) == (214, 107)


def test_even_shard_is_an_error_naming_the_sizes() -> None:
    assert even_shard(192, 4, 3, "output features") == (144, 48)
    with pytest.raises(ShardingError, match=r"tensor-parallel-size 5: the output features \(192\)"):
        even_shard(192, 5, 0, "output features")
