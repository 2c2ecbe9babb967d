"""The Triton kernel of flagged_checks.py, in a module of its own: importing it imports
triton, which only the accelerator path without a scaler's skip needs."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "position"])  # one compile per dtype
def check(flag_ptr, x_ptr, n, first_ptr, position, BLOCK: tl.constexpr):  # noqa: N803
    """One output: if the flag is set, lower `first` to `position` when any element is
    inf/NaN. On a healthy step each program reads the flag and nothing else."""
    if tl.load(flag_ptr) != 0:
        start = tl.program_id(0) * BLOCK
        stride = tl.num_programs(0) * BLOCK
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for offset in range(start, n, stride):
            index = offset + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + index, mask=index < n, other=0.0).to(tl.float32)
            bad = bad | ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
        if tl.max(bad, axis=0) != 0:
            tl.atomic_min(first_ptr, position)
