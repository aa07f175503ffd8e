"""Properties of the pure flat-buffer layout (``shardopt.layout``).

Everything else (step, checkpoint, export) reads these records, so the
invariants below are what keeps them in agreement. Interval arithmetic only:
params of billions of elements cost nothing to check.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardopt.layout import Layout, ParamSpec, Range, build_layout

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# ---------------------------------------------------------------- strategies

shapes = st.one_of(
    st.just(()),  # 0-d scalar, one element
    st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),  # small, often zero-size
    st.lists(st.integers(1, 400), min_size=1, max_size=2).map(tuple),  # medium
    st.tuples(st.integers(1, 1 << 16), st.integers(1, 1 << 16)),  # huge (up to 2**32)
)


@st.composite
def param_lists(draw: st.DrawFn, max_size: int = 24) -> list[ParamSpec]:
    entries = draw(st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), max_size=max_size))
    return [ParamSpec(f"layers.{i}.w{len(shape)}", shape, dtype)
            for i, (shape, dtype) in enumerate(entries)]


bucket_numels = st.one_of(st.integers(1, 64), st.integers(1, 5000), st.just(40_000_000))
align_numels = st.one_of(st.sampled_from([1, 2, 4, 8, 64, 128]), st.integers(1, 100))
dp_sizes = st.integers(1, 8)


# ------------------------------------------------------------------- checker

def tiles(ranges: list[Range], start: int, end: int) -> bool:
    """True if ``ranges`` cover ``[start, end)`` exactly once (no gap, no overlap)."""
    cursor = start
    for r in sorted(ranges, key=lambda r: r.start):
        if r.start != cursor:
            return False
        cursor = r.end
    return cursor == end


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_layout(layout: Layout, specs: list[ParamSpec], dp_size: int,
                 bucket_numel: int, align_numel: int, param_align: int = 1) -> None:
    """Assert every structural invariant of ``layout`` for ``specs``."""
    by_fqn = {s.fqn: s for s in specs}
    assert layout.dp_size == dp_size
    assert set(layout.fqns) == set(by_fqn)
    assert len(layout.fqns) == len(specs)

    # One buffer per dtype, holding exactly that dtype's params.
    assert len({b.dtype for b in layout.buffers}) == len(layout.buffers)
    assert {b.dtype for b in layout.buffers} == {s.dtype for s in specs}
    registration = {s.fqn: i for i, s in enumerate(specs)}
    for bi, buf in enumerate(layout.buffers):
        assert buf.index == bi
        assert {p.fqn for p in buf.params} == {s.fqn for s in specs if s.dtype == buf.dtype}
        # Reverse registration order, so the first bucket fills first in backward.
        order = [p.fqn for p in sorted(buf.params, key=lambda p: p.range_global.start)]
        assert order == sorted(order, key=lambda f: -registration[f])

        # Buckets: contiguous, padded to dp_size * align_numel, evenly sharded.
        assert buf.buckets, "a buffer exists only for a dtype that has params"
        cursor = 0
        for k, bucket in enumerate(buf.buckets):
            assert (bucket.buffer_index, bucket.index) == (bi, k)
            assert bucket.range_global.start == cursor
            cursor = bucket.range_global.end
            size = bucket.range_global.size
            assert size > 0 and size % (dp_size * align_numel) == 0
            assert bucket.shard_numel * dp_size == size
            assert bucket.shard_numel % align_numel == 0
            assert bucket.numel_unpadded == sum(_up(by_fqn[f].numel, param_align)
                                                for f in bucket.param_fqns)
            # Padding is minimal: less than one more round of dp_size * align_numel.
            assert size - max(bucket.numel_unpadded, 1) < dp_size * align_numel
            assert (sum(by_fqn[f].numel for f in bucket.param_fqns) <= bucket_numel
                    or len(bucket.param_fqns) == 1)
            shards = [bucket.shard_range_global(r) for r in range(dp_size)]
            assert all(s.size == bucket.shard_numel for s in shards)
            assert tiles(shards, bucket.range_global.start, bucket.range_global.end)
            # The bucket's params sit back to back from its start (padding at the end),
            # each at the first multiple of param_align.
            offset = bucket.range_global.start
            for fqn in bucket.param_fqns:
                slot = layout.slots[fqn]
                assert slot.range_global.start == _up(offset, param_align)
                offset = slot.range_global.end
        assert cursor == buf.numel
        assert buf.local_numel * dp_size == buf.numel
        assert buf.local_offset(len(buf.buckets)) == buf.local_numel

    # Slots: right shape and size; a param never spans two buckets.
    bucket_of: dict[str, tuple[int, int]] = {}
    for buf in layout.buffers:
        for bucket in buf.buckets:
            for fqn in bucket.param_fqns:
                assert fqn not in bucket_of, f"{fqn} listed in two buckets"
                bucket_of[fqn] = (buf.index, bucket.index)
    assert set(bucket_of) == set(by_fqn)
    for fqn, slot in layout.slots.items():
        spec = by_fqn[fqn]
        assert slot.shape == spec.shape
        assert slot.range_global.size == spec.numel == math.prod(spec.shape)
        assert (slot.buffer_index, slot.bucket_index) == bucket_of[fqn]
        buf = layout.buffers[slot.buffer_index]
        assert buf.dtype == spec.dtype
        bucket = buf.buckets[slot.bucket_index]
        assert bucket.range_global.start <= slot.range_global.start
        assert slot.range_global.end <= bucket.range_global.end

    # Shards: consistent coordinates, one range per (param, rank), full coverage.
    param_pieces: dict[str, list[Range]] = {f: [] for f in by_fqn}
    for rank in range(dp_size):
        shards = layout.shards(rank)
        seen: set[str] = set()
        local_by_buffer: dict[int, list[Range]] = {}
        for s in shards:
            assert s.dp_rank == rank
            assert s.fqn not in seen, f"{s.fqn} has two ranges on rank {rank}"
            seen.add(s.fqn)
            assert s.range_param.size == s.range_global.size == s.range_local.size > 0
            slot = layout.slots[s.fqn]
            assert (s.buffer_index, s.bucket_index) == (slot.buffer_index, slot.bucket_index)
            buf = layout.buffers[s.buffer_index]
            bucket = buf.buckets[s.bucket_index]
            assert s.range_global.start - slot.range_global.start == s.range_param.start
            assert 0 <= s.range_param.start and s.range_param.end <= by_fqn[s.fqn].numel
            own = bucket.shard_range_global(rank)
            assert own.start <= s.range_global.start and s.range_global.end <= own.end
            # Local position = this bucket's offset in the rank's tensor + offset in its shard.
            assert (s.range_local.start - buf.local_offset(bucket.index)
                    == s.range_global.start - own.start)
            assert 0 <= s.range_local.start and s.range_local.end <= buf.local_numel
            local_by_buffer.setdefault(s.buffer_index, []).append(s.range_local)
            param_pieces[s.fqn].append(s.range_param)
            # Blockwise state: each rank's piece starts on a block of the flattened param
            # and ends on one, or at the param's end.
            assert s.range_param.start % param_align == 0
            assert s.range_param.end % param_align == 0 or s.range_param.end == slot.range_global.size
        for ranges in local_by_buffer.values():
            ranges.sort(key=lambda r: r.start)
            assert all(a.end <= b.start for a, b in zip(ranges, ranges[1:])), "local overlap"
        # "buffer then position order"
        keys = [(s.buffer_index, s.range_global.start) for s in shards]
        assert keys == sorted(keys)
    for fqn, pieces in param_pieces.items():
        assert tiles(pieces, 0, by_fqn[fqn].numel), f"{fqn} not covered exactly once"


# ---------------------------------------------------------------- properties

@given(param_lists(), dp_sizes, bucket_numels, align_numels)
def test_layout_invariants(specs, dp_size, bucket_numel, align_numel):
    layout = build_layout(specs, dp_size, bucket_numel, align_numel)
    check_layout(layout, specs, dp_size, bucket_numel, align_numel)


@given(param_lists(), dp_sizes, bucket_numels, st.sampled_from([1, 16, 64, 128]),
       st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 16, 64, 128]))
def test_param_align_puts_blocks_whole_on_one_rank(specs, dp_size, bucket_numel, block,
                                                   align_factor, param_align):
    """With 8-bit moments every param starts on a block boundary and shards cut on them."""
    param_align = min(param_align, block)
    align_numel = block * align_factor
    layout = build_layout(specs, dp_size, bucket_numel, align_numel, param_align)
    check_layout(layout, specs, dp_size, bucket_numel, align_numel, param_align)
    for slot in layout.slots.values():
        assert slot.range_global.start % param_align == 0


def test_param_align_one_is_the_default_layout():
    specs = [ParamSpec(f"w{i}", (i * 7 + 1,), torch.bfloat16) for i in range(5)]
    assert build_layout(specs, 3, 100, 64, 1) == build_layout(specs, 3, 100, 64)


@given(param_lists(), dp_sizes, bucket_numels, align_numels)
def test_layout_is_deterministic(specs, dp_size, bucket_numel, align_numel):
    first = build_layout(specs, dp_size, bucket_numel, align_numel)
    again = build_layout(list(specs), dp_size, bucket_numel, align_numel)
    assert first == again
    assert all(first.shards(r) == again.shards(r) for r in range(dp_size))


@given(param_lists(max_size=10), dp_sizes, st.integers(1, 300), st.integers(1, 16), st.data())
def test_round_trip_through_local_shards(specs, dp_size, bucket_numel, align_numel, data):
    """Scatter real values into per-rank local tensors by the records, rebuild every param."""
    specs = [s for s in specs if s.numel <= 4096]
    layout = build_layout(specs, dp_size, bucket_numel, align_numel)
    values = {s.fqn: torch.arange(s.numel, dtype=torch.float64) + 1e6 * i
              for i, s in enumerate(specs)}

    # What each rank would own: its shard of every bucket of the full buffer.
    full = [torch.full((buf.numel,), float("nan"), dtype=torch.float64) for buf in layout.buffers]
    for fqn, slot in layout.slots.items():
        full[slot.buffer_index][slot.range_global.as_slice()] = values[fqn]
    local = {
        (r, buf.index): torch.cat([full[buf.index][b.shard_range_global(r).as_slice()]
                                   for b in buf.buckets])
        for r in range(dp_size) for buf in layout.buffers
    }
    rebuilt = {s.fqn: torch.full((s.numel,), float("nan"), dtype=torch.float64) for s in specs}
    for r in range(dp_size):
        for s in layout.shards(r):
            rebuilt[s.fqn][s.range_param.as_slice()] = local[(r, s.buffer_index)][
                s.range_local.as_slice()]
    for fqn, want in values.items():
        assert torch.equal(rebuilt[fqn], want), fqn


# -------------------------------------------------------------------- examples

def test_two_params_split_across_two_ranks():
    specs = [ParamSpec("a", (10,), torch.float32), ParamSpec("b", (2, 3), torch.float32)]
    layout = build_layout(specs, dp_size=2, bucket_numel=100, align_numel=1)
    (buf,) = layout.buffers
    (bucket,) = buf.buckets
    # Reverse registration order: b first.
    assert layout.slots["b"].range_global == Range(0, 6)
    assert layout.slots["a"].range_global == Range(6, 16)
    assert bucket.range_global == Range(0, 16) and bucket.shard_numel == 8
    r0 = {(s.fqn, s.range_param, s.range_local) for s in layout.shards(0)}
    r1 = {(s.fqn, s.range_param, s.range_local) for s in layout.shards(1)}
    assert r0 == {("b", Range(0, 6), Range(0, 6)), ("a", Range(0, 2), Range(6, 8))}
    assert r1 == {("a", Range(2, 10), Range(0, 8))}


def test_padding_to_dp_size_times_align():
    layout = build_layout([ParamSpec("w", (10,), torch.float32)], 3, 1000, align_numel=4)
    (bucket,) = layout.buffers[0].buckets
    assert bucket.numel_unpadded == 10
    assert bucket.range_global == Range(0, 12) and bucket.shard_numel == 4
    pieces = [[(s.range_param, s.range_local) for s in layout.shards(r)] for r in range(3)]
    assert pieces == [[(Range(0, 4), Range(0, 4))],
                      [(Range(4, 8), Range(0, 4))],
                      [(Range(8, 10), Range(0, 2))]]


def test_big_param_gets_its_own_bucket():
    specs = [ParamSpec("small1", (3,), torch.float32), ParamSpec("big", (50,), torch.float32),
             ParamSpec("small2", (4,), torch.float32)]
    layout = build_layout(specs, 2, bucket_numel=10, align_numel=1)
    buckets = layout.buffers[0].buckets
    assert [b.param_fqns for b in buckets] == [("small2",), ("big",), ("small1",)]
    assert [b.range_global for b in buckets] == [Range(0, 4), Range(4, 54), Range(54, 58)]
    assert layout.buffers[0].local_numel == 2 + 25 + 2


def test_mixed_dtypes_make_one_buffer_each():
    specs = [ParamSpec("emb", (8, 4), torch.bfloat16), ParamSpec("norm", (4,), torch.float32),
             ParamSpec("proj", (4, 4), torch.bfloat16), ParamSpec("router", (4, 2), torch.float32),
             ParamSpec("half", (), torch.float16)]
    layout = build_layout(specs, 4, bucket_numel=20, align_numel=2)
    # First appearance in reverse registration order: fp16, fp32, bf16.
    assert [b.dtype for b in layout.buffers] == [torch.float16, torch.float32, torch.bfloat16]
    assert [p.fqn for p in layout.buffers[1].params] == ["router", "norm"]
    assert [p.fqn for p in layout.buffers[2].params] == ["proj", "emb"]
    check_layout(layout, specs, 4, 20, 2)


def test_scalar_and_zero_size_params():
    specs = [ParamSpec("scale", (), torch.float32), ParamSpec("empty", (0, 5), torch.float32),
             ParamSpec("w", (3,), torch.float32)]
    layout = build_layout(specs, 2, bucket_numel=1, align_numel=1)
    assert layout.slots["scale"].range_global.size == 1
    assert layout.slots["empty"].range_global.size == 0
    assert all(s.fqn != "empty" for r in range(2) for s in layout.shards(r))
    check_layout(layout, specs, 2, 1, 1)


def test_no_params():
    layout = build_layout([], 3, 10)
    assert layout.buffers == () and layout.fqns == () and layout.shards(2) == ()


def test_huge_param_is_pure_arithmetic():
    specs = [ParamSpec("huge", (1 << 20, 1 << 15), torch.bfloat16)]  # 2**35 elements
    layout = build_layout(specs, 7, bucket_numel=1 << 20, align_numel=128)
    check_layout(layout, specs, 7, 1 << 20, 128)


@pytest.mark.parametrize(
    "kwargs",
    [dict(dp_size=0), dict(dp_size=-2), dict(bucket_numel=0), dict(bucket_numel=-1),
     dict(align_numel=0), dict(align_numel=-64), dict(param_align=0),
     dict(align_numel=8, param_align=16), dict(align_numel=8, param_align=3)],
)
def test_invalid_arguments_raise(kwargs):
    args = dict(dp_size=2, bucket_numel=100, align_numel=8) | kwargs
    with pytest.raises(ValueError):
        build_layout([ParamSpec("w", (4,), torch.float32)], **args)


def test_duplicate_names_raise():
    specs = [ParamSpec("w", (4,), torch.float32), ParamSpec("w", (2,), torch.bfloat16)]
    with pytest.raises(ValueError, match="'w'"):
        build_layout(specs, 2, 100)


@pytest.mark.parametrize("rank", [-1, 2, 5])
def test_rank_out_of_range_raises(rank):
    layout = build_layout([ParamSpec("w", (4,), torch.float32)], 2, 100)
    with pytest.raises(ValueError):
        layout.shards(rank)


@pytest.mark.parametrize("start,end", [(-1, 3), (5, 4)])
def test_invalid_range_raises(start, end):
    with pytest.raises(ValueError):
        Range(start, end)


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 70))
def test_range_blocks_are_the_blocks_it_touches(start, size, block):
    got = Range(start, start + size).blocks(block)
    assert list(range(got.start, got.end)) == sorted({i // block for i in range(start, start + size)})


def _buffer_rows(buffers):
    return [(b.dtype, b.numel, b.dp_size, [(k.index, k.range_global, k.numel_unpadded,
                                            k.shard_numel, k.param_fqns) for k in b.buckets],
             [(p.fqn, p.shape, p.bucket_index, p.range_global) for p in b.params])
            for b in buffers]


def _shard_rows(shards):
    return [(s.fqn, s.dp_rank, s.bucket_index, s.range_global, s.range_local, s.range_param)
            for s in shards]


@given(param_lists(), st.lists(st.integers(0, 2), min_size=24, max_size=24),
       st.lists(dp_sizes, min_size=3, max_size=3), bucket_numels, align_numels,
       st.integers(0, 7))
def test_each_dp_group_is_laid_out_as_if_alone(specs, groups, sizes, bucket_numel,
                                               align_numel, rank):
    """Params of several DP groups (experts): buffers per (group, dtype), no bucket mixes
    groups, and each group's buffers and shards are those of its params alone at its size."""
    specs = [dataclasses.replace(s, dp_group=g) for s, g in zip(specs, groups)]
    layout = build_layout(specs, sizes[0], bucket_numel, align_numel,
                          group_sizes=dict(enumerate(sizes)))
    assert layout.dp_size == sizes[0]
    ranks = {g: rank % size for g, size in enumerate(sizes)}
    shards = layout.shards(ranks[0], ranks)
    for g, size in enumerate(sizes):
        mine = [dataclasses.replace(s, dp_group=0) for s in specs if s.dp_group == g]
        alone = build_layout(mine, size, bucket_numel, align_numel)
        check_layout(alone, mine, size, bucket_numel, align_numel)
        in_group = [b for b in layout.buffers if b.dp_group == g]
        assert _buffer_rows(in_group) == _buffer_rows(alone.buffers)
        indices = {b.index for b in in_group}
        assert (_shard_rows(s for s in shards if s.buffer_index in indices)
                == _shard_rows(alone.shards(ranks[g])))


def test_a_param_in_a_dp_group_without_a_size_is_refused():
    with pytest.raises(ValueError, match="'w' is in DP group 1"):
        build_layout([ParamSpec("w", (4,), torch.float32, dp_group=1)], 2, 100)
