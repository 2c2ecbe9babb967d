"""The Triton kernel of flagged_checks.py, in a module of its own: importing it imports
triton, which only the accelerator path without a scaler's skip needs."""

import torch
import triton
import triton.language as tl

# the element types the kernel reads (a held output of another dtype is checked as made)
TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
         torch.float64: tl.float64}
# what each is tested in: float32 holds every 16-bit value exactly, and a float64 stays
# itself (in float32 a finite 1e300 would be inf)
COMPUTE = {dtype: tl.float64 if dtype is torch.float64 else tl.float32 for dtype in TYPES}


@triton.jit(do_not_specialize=["count"])  # one compile per dtype
def check(flag_ptr, table_ptr, count, first_ptr, DTYPE: tl.constexpr,  # noqa: N803
          COMPUTE: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    """Every output of one dtype in one launch: `table` holds, per output, its address,
    its element count and its call position (3 rows of `count` int64). If the flag is
    set, lower `first` to the position of each output holding inf/NaN. On a healthy step
    each program reads the flag and nothing else."""
    if tl.load(flag_ptr) != 0:
        start = tl.program_id(0) * BLOCK
        stride = tl.num_programs(0) * BLOCK
        for t in range(0, count):
            x_ptr = tl.load(table_ptr + t).to(tl.pointer_type(DTYPE))
            n = tl.load(table_ptr + count + t)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            for offset in range(start, n, stride):
                index = offset + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + index, mask=index < n, other=0.0).to(COMPUTE)
                bad = bad | ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
            if tl.max(bad, axis=0) != 0:
                tl.atomic_min(first_ptr, tl.load(table_ptr + 2 * count + t))
