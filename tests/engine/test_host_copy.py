"""host_copy: row selection and uploads equal plain indexing (the GPU path's point, no host wait,
is measured in benchmarks/w4a16_regress.py; here the values and the view/gather choice)."""

import pytest
import torch

from homelab_llm.engine.host_copy import select_rows, upload_pinned


def test_select_rows_matches_indexing():
    g = torch.Generator().manual_seed(3)
    t = torch.randn(7, 5, generator=g)
    for rows in ([0, 1, 2, 3, 4, 5, 6], [2, 3, 4], [5], [0, 2, 3], [6, 1], [3, 3]):
        got = select_rows(t, rows)
        assert torch.equal(got, t[rows]), rows
    assert select_rows(t, [1, 2, 3]).data_ptr() == t[1].data_ptr()  # one run: a view, no copy


def test_select_rows_refuses_empty():
    with pytest.raises(ValueError):
        select_rows(torch.zeros(2, 2), [])


def test_upload_pinned_cpu_target_is_a_copy_of_the_values():
    h = torch.arange(6, dtype=torch.int32)
    assert torch.equal(upload_pinned(h, torch.device("cpu")), h)
