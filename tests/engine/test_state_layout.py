"""cache/state_layout.py: per-rank GDN state shapes and bytes, against hand-computed numbers."""

from __future__ import annotations

import dataclasses

import pytest

from homelab_llm.engine.cache.state_layout import StateLayout
from homelab_llm.engine.dtype_sizes import MemoryPlanError
from tests.engine.hybrid_shapes import QWEN36_27B


def test_qwen36_27b_tp2_shapes_and_bytes_per_card() -> None:
    layout = StateLayout.for_model(QWEN36_27B, 2, "auto")
    assert layout.num_layers == 48
    assert layout.layers[:4] == (0, 1, 2, 4)
    # 8 key heads and 24 value heads per card: q, k (8 x 128 each) and v (24 x 128) channels.
    assert layout.conv_shape == (3, 2 * 8 * 128 + 24 * 128) == (3, 5120)
    assert layout.conv_dtype == "bfloat16"
    assert layout.recurrent_shape == (24, 128, 128)
    assert layout.recurrent_dtype == "float32"
    assert layout.conv_bytes_per_layer == 3 * 5120 * 2
    assert layout.recurrent_bytes_per_layer == 24 * 128 * 128 * 4
    assert layout.bytes_per_sequence == 48 * (3 * 5120 * 2 + 24 * 128 * 128 * 4) == 76_972_032
    assert layout.bytes_per_sequence / 1e6 == pytest.approx(77, abs=0.05)


def test_tp1_holds_twice_the_tp2_state() -> None:
    one = StateLayout.for_model(QWEN36_27B, 1, "bfloat16")
    two = StateLayout.for_model(QWEN36_27B, 2, "bfloat16")
    assert one.recurrent_shape == (48, 128, 128)
    assert one.bytes_per_sequence == 2 * two.bytes_per_sequence


def test_conv_state_follows_the_model_dtype_spelling() -> None:
    layout = StateLayout.for_model(QWEN36_27B, 2, "torch.float32")
    assert layout.conv_dtype == "float32"
    assert layout.conv_bytes_per_layer == 3 * 5120 * 4


def test_non_hybrid_model_has_an_empty_layout() -> None:
    plain = dataclasses.replace(QWEN36_27B, layer_types=())
    layout = StateLayout.for_model(plain, 2, "auto")
    assert layout.num_layers == 0 and layout.bytes_per_sequence == 0


@pytest.mark.parametrize("tp", [3, 5, 32])
def test_uneven_head_split_is_refused_with_the_head_counts(tp: int) -> None:
    with pytest.raises(MemoryPlanError, match=rf"--tensor-parallel-size {tp}.*16 .*48"):
        StateLayout.for_model(QWEN36_27B, tp, "auto")


def test_incomplete_hybrid_config_is_refused() -> None:
    broken = dataclasses.replace(QWEN36_27B, linear_conv_kernel_dim=0)
    with pytest.raises(MemoryPlanError, match="linear_conv_kernel_dim"):
        StateLayout.for_model(broken, 1, "auto")


def test_snapshot_pool_defaults_to_two_per_running_sequence() -> None:
    layout = StateLayout.for_model(QWEN36_27B, 2, "auto")
    assert layout.snapshot_count(8) == 16
    assert layout.snapshot_count(8, max_state_snapshots=0) == 0
    assert layout.snapshot_count(8, max_state_snapshots=5) == 5
    assert layout.snapshot_count(8, state_snapshot_memory_bytes=3 * 76_972_032 + 1) == 3
    assert layout.snapshot_count(8, enable_prefix_caching=False) == 0


def test_plain_transformer_keeps_no_snapshots() -> None:
    plain = StateLayout.for_model(dataclasses.replace(QWEN36_27B, layer_types=()), 1, "auto")
    assert plain.snapshot_count(8, max_state_snapshots=5) == 0
