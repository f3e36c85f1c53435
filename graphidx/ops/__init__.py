"""The indexer's kernels as torch custom ops (docs/contract.md section 5).

Every op writes only into caller-given outputs, returns None and takes `backend`
("reference", "triton", "aiter" or None for the device's default, see
`graphidx.ops.backend`); the logits ops also take `precision` ("exact", "fp8" or None).
The wrappers here validate arguments from tensor metadata only and then call
`torch.ops.graphidx.<name>`, so the ops trace under torch.compile and record as one op on
the capture tape.
"""

from graphidx.ops.backend import (
    BACKENDS,
    FP8_LOGIT_BOUND,
    PRECISIONS,
    resolve_backend,
    resolve_precision,
)
from graphidx.ops.candidates import apply_candidate_mask, resolve_candidate_pool
from graphidx.ops.gather import gather_mqa_logits, remap_compact_topk
from graphidx.ops.logits import paged_mqa_logits
from graphidx.ops.topk import topk_per_row
from graphidx.ops.validate import check_block_table

__all__ = [
    "BACKENDS",
    "FP8_LOGIT_BOUND",
    "PRECISIONS",
    "apply_candidate_mask",
    "check_block_table",
    "gather_mqa_logits",
    "paged_mqa_logits",
    "remap_compact_topk",
    "resolve_backend",
    "resolve_candidate_pool",
    "resolve_precision",
    "topk_per_row",
]
