"""Properties of the N-D box arithmetic (``shardopt.boxes``) against brute force on small
tensors: flat ranges of blocks as boxes, the runs two boxes share, and tilings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardopt.boxes import Box, disjoint_cover, flat_boxes, runs
from shardopt.layout import Range

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    offsets, lengths = [], []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        offsets.append(start)
        lengths.append(draw(st.integers(1, n - start)))
    return Box(tuple(offsets), tuple(lengths))


def _region(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]


@given(st.data(), shapes)
def test_flat_boxes_are_the_range_in_order(data, shape):
    block = data.draw(boxes_in(shape))
    start = data.draw(st.integers(0, block.numel))
    end = data.draw(st.integers(start, block.numel))
    glob = torch.arange(math.prod(shape)).reshape(shape)
    want = _region(glob, block).reshape(-1)[start:end]
    got = flat_boxes(block, Range(start, end))
    assert len(got) <= max(1, 2 * len(shape) - 1)
    assert all(b.within(shape) and b.numel for b in got)
    pieces = [_region(glob, b).reshape(-1) for b in got]
    assert torch.equal(torch.cat(pieces) if pieces else want[:0], want)


@given(st.data(), shapes)
def test_runs_copy_exactly_the_shared_elements(data, shape):
    src, dst = data.draw(boxes_in(shape)), data.draw(boxes_in(shape))
    glob = torch.arange(1, math.prod(shape) + 1).reshape(shape)
    src_data = _region(glob, src).reshape(-1)
    out = torch.zeros(dst.numel, dtype=glob.dtype)
    copied = 0
    for r in runs(src, dst):
        assert r.numel > 0
        out[r.dst:r.dst + r.numel] = src_data[r.src:r.src + r.numel]
        copied += r.numel
    hit = src.intersect(dst)
    assert copied == (0 if hit is None else hit.numel)
    mask = torch.zeros(shape, dtype=torch.bool)
    if hit is not None:
        _region(mask, hit).fill_(True)
    expect = torch.where(_region(mask, dst), _region(glob, dst), 0).reshape(-1)
    assert torch.equal(out, expect)


@given(st.data(), shapes, st.integers(1, 6))
def test_flat_pieces_of_blocks_tile_the_tensor(data, shape, pieces):
    """Cut the tensor into blocks along dim 0, each block's flattening into ranges: their
    boxes tile it; one box more overlaps, one less leaves a gap."""
    if not shape:
        shape = (1,)
    cuts = sorted(data.draw(st.lists(st.integers(0, shape[0]), max_size=2)))
    edges = [0, *cuts, shape[0]]
    found = []
    for a, b in zip(edges, edges[1:]):
        if a == b:
            continue
        block = Box((a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:])
        stops = sorted(data.draw(st.lists(st.integers(0, block.numel), max_size=pieces)))
        for lo, hi in zip([0, *stops], [*stops, block.numel]):
            found += flat_boxes(block, Range(lo, hi))
    assert disjoint_cover(found, shape) is None
    assert "overlap" in disjoint_cover(found + [found[0]], shape)
    assert "cover" in disjoint_cover(found[1:], shape)


def test_a_box_outside_the_shape_is_named():
    assert "outside" in disjoint_cover([Box((0, 2), (2, 3))], (2, 4))


def test_a_range_past_the_block_is_refused():
    with pytest.raises(ValueError, match="outside a block of 6"):
        flat_boxes(Box((0, 0), (2, 3)), Range(0, 7))
