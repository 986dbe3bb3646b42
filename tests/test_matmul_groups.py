"""ops.Blocking.group: an f32 weight's panels in groups (ops.matmul_blocking), the heuristic
that picks them, and the group's bad input."""
import numpy as np
import pytest

import ops
import tpp
from tpp.core.errors import ArgumentError

from test_ops_matmul import test_matmul_matches_numpy as _matches_numpy

# (m, n, k, dtype, out_dtype, bias, activation, blocking)
CASES = [
    (130, 256, 100, "f32", None, True, "gelu", None),        # the default: one group of 4 panels
    (70, 384, 1100, "f32", None, False, None, ops.Blocking(64, 512, group=2)),  # 3 groups, chunks
    (65, 320, 70, "f32", None, True, "relu", ops.Blocking(8, 70, group=4)),  # 5 panels: groups of 1
    (50, 200, 64, "f32", None, True, None, ops.Blocking(64, 64, group=2)),   # a narrow last panel: ungrouped
    (33, 256, 67, "bf16", "f32", True, None, ops.Blocking(16, 67, group=2)),  # bf16, odd K, grouped
]


@pytest.mark.parametrize("m,n,k,dtype,out_dtype,has_bias,act,blocking", CASES)
def test_grouped_panels_match_numpy(m, n, k, dtype, out_dtype, has_bias, act, blocking):
    _matches_numpy(m, n, k, dtype, out_dtype, has_bias, act, blocking)


@pytest.mark.parametrize("group", [0, -1, 2.5, True])
def test_a_bad_group_is_an_argument_error(group):
    a, b = np.ones((5, 7), np.float32), np.ones((7, 3), np.float32)
    with pytest.raises(ArgumentError, match="blocking.group must be a positive int"):
        ops.matmul(a, b, blocking=ops.Blocking(4, 4, group=group))


def test_heuristic_blocking_groups_f32_panels():
    """f32 weights in equal groups of panels of at most GROUP_BYTES; a narrow last panel, a
    single panel or bf16 ungrouped."""
    from ops.matmul_blocking import GROUP_BYTES, heuristic_blocking
    f32, bf = tpp.F32, tpp.BF16
    assert GROUP_BYTES == 512 << 10
    assert heuristic_blocking(384, 1152, 64, f32, f32) == ops.Blocking(64, 384, group=3)
    assert heuristic_blocking(384, 384, 64, f32, f32) == ops.Blocking(64, 384, group=3)
    assert heuristic_blocking(1536, 384, 64, f32, f32) == ops.Blocking(64, 1536, group=1)
    assert heuristic_blocking(100, 256, 64, f32, f32) == ops.Blocking(64, 100, group=4)
    assert heuristic_blocking(100, 200, 64, f32, f32) == ops.Blocking(64, 100)
    assert heuristic_blocking(100, 64, 64, f32, f32) == ops.Blocking(64, 100)
    assert heuristic_blocking(384, 1152, 64, bf, bf).group is None
