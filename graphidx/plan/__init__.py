"""Pure host planning of a step (docs/contract.md sections 3.2-3.4): imports metadata and
config only, never ops.

Host values (offsets, upper bounds, query lengths) decide counts, index vectors and launch
shapes; device values are written by device ops into caller-given persistent buffers and never
read back.
"""

from graphidx.plan.decode import (
    DecodeRows,
    build_decode_rows,
    decode_row_index,
    derive_request_rows,
    native_decode,
    split_decodes_prefills,
)
from graphidx.plan.gather import plan_gather_launches
from graphidx.plan.prefill import (
    build_prefill_chunks,
    plan_prefill_chunks,
    rows_per_slice,
    split_prefill_chunks,
)

__all__ = [
    "DecodeRows",
    "build_decode_rows",
    "build_prefill_chunks",
    "decode_row_index",
    "derive_request_rows",
    "native_decode",
    "plan_gather_launches",
    "plan_prefill_chunks",
    "rows_per_slice",
    "split_decodes_prefills",
    "split_prefill_chunks",
]
