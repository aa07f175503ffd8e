"""The norm pass's reading plan: shards that lie back to back are read as one run."""

import torch

from shardopt.grad_norm import LONG_RUN, contiguous_runs, sum_of_squares


def test_neighbouring_views_merge_and_the_sum_is_unchanged():
    flat = torch.randn(1000)
    other = torch.randn(50)
    views = [flat[0:100], flat[100:400], flat[500:600], flat[600:1000], other[10:50]]
    runs = contiguous_runs(views)
    assert [(r.storage_offset(), r.numel()) for r in runs] == [(0, 400), (500, 500), (10, 40)]
    assert runs[0].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert all(r.is_contiguous() for r in runs)
    want = sum(float(v.double().square().sum()) for v in views)
    assert abs(float(sum_of_squares(runs, flat.device)) - want) <= 1e-4 * want


def test_views_of_two_dtypes_never_merge():
    flat = torch.zeros(16)
    views = [flat[0:8], flat[8:16].view(torch.int32)]
    assert len(contiguous_runs(views)) == 2


def test_long_and_short_runs_are_summed_alike():
    long = torch.ones(LONG_RUN, dtype=torch.bfloat16)
    short = torch.full((10,), 2.0, dtype=torch.bfloat16)
    assert float(sum_of_squares([long, short], long.device)) == LONG_RUN + 40
    assert float(sum_of_squares([], torch.device("cpu"))) == 0.0
