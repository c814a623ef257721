"""Host-side planning of the Triton tier: split counts and the fall-back ladder for configs that do not fit."""

import pytest

from anymla.triton_kernels.fit import shrinking
from anymla.triton_kernels.splits import MAX_SPLITS, choose_num_splits
from anymla.triton_kernels.tuning import TileConfig


@pytest.mark.parametrize("programs, per_core, expected", [
    (64, 1, 2),     # 64 programs of a whole-SM tile on 132 SMs: two splits fill them once
    (64, 2, 4),     # half-SM tiles: two run on each SM
    (128, 1, 1),    # already one round
    (128, 2, 2),
    (2, 1, MAX_SPLITS),  # one long request: as many as allowed
])
def test_splits_fill_every_core_once(programs, per_core, expected):
    assert choose_num_splits(programs, 1024, 132, per_core, False) == expected


def test_splits_keep_two_key_blocks_each_and_never_split_batch_invariant_calls():
    assert choose_num_splits(1, 6, 132, 1, False) == 3
    assert choose_num_splits(1, 1, 132, 1, False) == 1
    assert choose_num_splits(1, 1024, 132, 1, True) == 1


def test_programs_per_core_follow_the_register_file():
    assert TileConfig(64, 64, 8, 1).programs_per_core == 1
    assert TileConfig(16, 32, 4, 6).programs_per_core == 2


def test_shrinking_halves_stages_before_key_blocks():
    got = [(t.block_n, t.num_stages) for t in shrinking(TileConfig(16, 32, 4, 6))]
    assert got == [(32, 6), (32, 3), (32, 1), (16, 1)]


def test_compile_report_reads_prefetch_depth_per_loop():
    from anymla.triton_kernels.compile_report import _prefetch_groups
    loop = "scf.for %i {{\n  %t = ttg.async_wait %a {{num = {} : i32}}\n  scf.yield %x\n}}\n"
    drain = "%d = ttg.async_wait {num = 0 : i32}\n"  # after the loop: not a prefetch depth
    assert _prefetch_groups("module {\n" + loop.format(5) + drain + loop.format(2) + drain) == 2
    assert _prefetch_groups("module {\n" + loop.format(0) + drain) == 0
    assert _prefetch_groups("module { scf.for %i { scf.yield } }") == -1
