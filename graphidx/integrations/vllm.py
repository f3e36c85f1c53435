"""vLLM adapter: `StepBatch` from `CommonAttentionMetadata`, `IndexerConfig` from vLLM configs.

Field names follow vLLM v1 as of v0.11 (`vllm/v1/attention/backends/utils.py`,
`CommonAttentionMetadata`): `query_start_loc`, `query_start_loc_cpu`, `seq_lens`,
`seq_lens_cpu`, `num_reqs`, `num_actual_tokens`, `max_query_len`, `block_table_tensor`.
Later versions turn `seq_lens_cpu` into a deprecated property that copies the device lengths
to the host (a sync that breaks async scheduling) and keep the host copy, when there is one,
in `_seq_lens_cpu`; this adapter never calls such a property: it reads a plain
`seq_lens_cpu` attribute, else a filled `_seq_lens_cpu`, else needs the explicit
`seq_lens_upper_bound` argument (an int such as the metadata's `max_seq_len` is a valid,
loose bound). vLLM is not imported; attributes are read by name.

CUDA graphs. An indexer metadata builder over graphidx supports vLLM's
`AttentionCGSupport.UNIFORM_BATCH` (`CUDAGRAPH_SUPPORT`): FULL graphs for uniform decode
batches (every real request `1 + num_speculative_tokens` query rows), PIECEWISE (the indexer
eager) for everything else. Build the graphidx builder with `full_graph_decode=True`, so every
decode decision depends on the padded shape only. vLLM pads a FULL-graph batch after the real
requests (zero query rows and `seq_len` 0, or `query_start_loc = arange(., next_n)` with
`seq_len` 0); pass `num_real_reqs` or let the adapter find the trailing requests whose host
`seq_len` bound is 0 (docs/contract.md section 3.2a), so they plan as padding.

`build_for_cudagraph_capture(common_attn_metadata)` is called once per captured size with a
dummy batch of that padded shape; its lengths and block table mean nothing. Map it with
`step_batch_from_vllm(..., validate=False)` and build as for any step: under
`full_graph_decode` the metadata it returns (views of persistent buffers, widths fixed to the
shape) is what the captured kernels read, and each later `build` of a batch of the same
padded shape refills those buffers in place before the graph replays.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from graphidx.batch import StepBatch
from graphidx.config import IndexerConfig

CUDAGRAPH_SUPPORT = "UNIFORM_BATCH"
"""The `vllm.v1.attention.backends.utils.AttentionCGSupport` member an indexer builder over
graphidx declares: FULL graphs for uniform (speculative) decode batches."""

_MISSING = object()


def _attr(obj: Any, owner: str, name: str, default: Any = _MISSING) -> Any:
    """`obj.name`, or `default`, or ValueError naming `owner.name` when it is absent."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        if default is not _MISSING:
            return default
        raise ValueError(f"{owner}.{name} is missing")
    return value


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _tensor(value: Any, where: str, *, rows: int, dim: int = 1) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dim:
        raise ValueError(f"{where} must be {dim}-D, got shape {tuple(value.shape)}")
    if value.shape[0] < rows:
        raise ValueError(f"{where} has {value.shape[0]} rows, fewer than the {rows} needed")
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(f"{where} must hold integers, got {value.dtype}")
    return value[:rows]


def _device_int32(value: torch.Tensor, where: str) -> torch.Tensor:
    if value.dtype != torch.int32:
        raise ValueError(f"{where} must be int32 (graphidx reads it in place), got {value.dtype}")
    return value


def _host_int32(value: torch.Tensor, where: str) -> torch.Tensor:
    if value.device.type != "cpu":
        raise ValueError(f"{where} must be a host (CPU) tensor, got device {value.device}")
    return value.to(torch.int32)


def _host_seq_lens(
    metadata: Any, num_reqs: int, upper: torch.Tensor | Sequence[int] | int | None
) -> torch.Tensor:
    """Per-request host upper bounds of the sequence lengths (never a device read)."""
    if upper is not None:
        if isinstance(upper, (int, np.integer)) and not isinstance(upper, bool):
            return torch.full((num_reqs,), _int(upper, "seq_lens_upper_bound"), dtype=torch.int32)
        tensor = torch.as_tensor(upper)
        tensor = _tensor(tensor, "seq_lens_upper_bound", rows=num_reqs)
        return _host_int32(tensor, "seq_lens_upper_bound")
    static = inspect.getattr_static(metadata, "seq_lens_cpu", _MISSING)
    if static is not _MISSING and not isinstance(static, property):
        value = metadata.seq_lens_cpu
        if value is not None:
            where = "common_attn_metadata.seq_lens_cpu"
            return _host_int32(_tensor(value, where, rows=num_reqs), where)
    cached = getattr(metadata, "_seq_lens_cpu", None)
    if cached is not None:
        where = "common_attn_metadata._seq_lens_cpu"
        return _host_int32(_tensor(cached, where, rows=num_reqs), where)
    raise ValueError(
        "common_attn_metadata.seq_lens_cpu is missing (or only a property that would copy the "
        "device lengths to the host): pass seq_lens_upper_bound, e.g. "
        "common_attn_metadata.max_seq_len"
    )


def _trailing_padding(upper: torch.Tensor) -> int:
    """Requests before the trailing run of zero-length bounds (vLLM's padding requests)."""
    nonzero = np.flatnonzero(upper.numpy())
    return int(nonzero[-1]) + 1 if nonzero.size else 0


def step_batch_from_vllm(
    common_attn_metadata: Any,
    config: IndexerConfig,
    *,
    num_pages: int | None = None,
    validate: bool = True,
    num_real_reqs: int | None = None,
    seq_lens_upper_bound: torch.Tensor | Sequence[int] | int | None = None,
    num_tokens: int | None = None,
) -> StepBatch:
    """A `StepBatch` over a vLLM v1 `CommonAttentionMetadata` (device tensors are views).

    Reads `num_reqs`, `query_start_loc_cpu`, `query_start_loc`, `seq_lens`,
    `block_table_tensor` (its first `num_reqs` rows, at most `config.max_blocks_per_seq`
    columns), `num_actual_tokens`, `max_query_len`, and the host sequence lengths (module
    docstring; `seq_lens_upper_bound` overrides them). `num_tokens` defaults to the larger of
    `num_actual_tokens` and the last query offset (the arange padding form has rows past the
    real tokens). `num_real_reqs` defaults to the requests before the trailing ones whose host
    length bound is 0 (vLLM's padding; a real request with rows has `seq_len >= 1`); pass
    `num_reqs` to treat every request as real. `num_pages` is the indexer cache's page count
    (a runner needs it). `validate=False` skips `StepBatch`'s device reads (hot paths).
    Raises ValueError naming the vLLM attribute that is missing or malformed, or, from
    `StepBatch`, the batch field and request.
    """
    if not isinstance(config, IndexerConfig):
        raise ValueError(f"config must be an IndexerConfig, got {type(config).__name__}")
    md, owner = common_attn_metadata, "common_attn_metadata"
    num_reqs = _int(_attr(md, owner, "num_reqs"), f"{owner}.num_reqs")
    if num_reqs > config.max_num_seqs:
        raise ValueError(
            f"{owner}.num_reqs = {num_reqs} exceeds config.max_num_seqs = {config.max_num_seqs}"
        )
    where = f"{owner}.query_start_loc_cpu"
    qsl_cpu = _host_int32(
        _tensor(_attr(md, owner, "query_start_loc_cpu"), where, rows=num_reqs + 1), where
    )
    where = f"{owner}.query_start_loc"
    qsl = _device_int32(
        _tensor(_attr(md, owner, "query_start_loc"), where, rows=num_reqs + 1), where
    )
    where = f"{owner}.seq_lens"
    seq_lens = _device_int32(_tensor(_attr(md, owner, "seq_lens"), where, rows=num_reqs), where)
    where = f"{owner}.block_table_tensor"
    table = _tensor(_attr(md, owner, "block_table_tensor"), where, rows=num_reqs, dim=2)
    table = _device_int32(table, where)[:, : config.max_blocks_per_seq]
    actual = _int(_attr(md, owner, "num_actual_tokens"), f"{owner}.num_actual_tokens")
    max_query_len = _int(_attr(md, owner, "max_query_len"), f"{owner}.max_query_len")
    upper = _host_seq_lens(md, num_reqs, seq_lens_upper_bound)

    if num_real_reqs is None:
        num_real_reqs = _trailing_padding(upper)
    num_real_reqs = _int(num_real_reqs, "num_real_reqs")
    if num_real_reqs > num_reqs:
        raise ValueError(f"num_real_reqs = {num_real_reqs} exceeds {owner}.num_reqs = {num_reqs}")
    query_lens = np.diff(qsl_cpu.numpy().astype(np.int64))
    if num_real_reqs and query_lens.size and (query_lens[:num_real_reqs] > max_query_len).any():
        r = int(np.flatnonzero(query_lens[:num_real_reqs] > max_query_len)[0])
        raise ValueError(
            f"{owner}.max_query_len = {max_query_len} is below request {r}'s query length "
            f"{int(query_lens[r])}"
        )
    last = int(qsl_cpu[num_reqs])
    if num_tokens is None:
        num_tokens = max(actual, last)
    return StepBatch(
        qsl_cpu,
        upper,
        qsl,
        seq_lens,
        table,
        config=config,
        num_tokens=_int(num_tokens, "num_tokens"),
        num_pages=num_pages,
        num_real_reqs=num_real_reqs,
        validate=validate,
    )


def _hf_config(model_config: Any) -> tuple[Any, str]:
    hf = getattr(model_config, "hf_config", None)
    if hf is not None:
        return hf, "model_config.hf_config"
    return model_config, "hf_config"


_HF_KEYS = (
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "compress_ratios",
    "candidate_block_size",
    "candidate_topk_blocks",
    "max_position_embeddings",
)


def indexer_config_from_vllm(
    model_config: Any,
    speculative_config: Any = None,
    cache_config: Any = None,
    scheduler_config: Any = None,
    *,
    layer: int = 0,
    **overrides: Any,
) -> IndexerConfig:
    """An `IndexerConfig` from vLLM's configs, read by attribute name.

    `model_config`: vLLM's `ModelConfig` (its `hf_config` and `max_model_len`) or the HF
    config itself. From the HF config: `index_n_heads` (required), `index_head_dim`,
    `index_topk`, `compress_ratios`, `candidate_block_size`, `candidate_topk_blocks`,
    `max_position_embeddings` (as `IndexerConfig.from_hf_config` reads them, for indexer
    layer `layer`). `speculative_config` (None: no speculation): `num_speculative_tokens`,
    `enable_adaptive_verification` (absent: False). `cache_config`: `block_size` (the
    indexer cache's page size in tokens). `scheduler_config`: `max_num_seqs`,
    `max_num_batched_tokens`. `max_model_len` comes from `model_config.max_model_len`
    when set. `overrides` win over everything. Raises ValueError naming the attribute that
    is missing or malformed.
    """
    hf, hf_owner = _hf_config(model_config)
    if getattr(hf, "index_n_heads", None) is None:
        raise ValueError(f"{hf_owner}.index_n_heads is missing: not a lightning-indexer model")
    fields: dict[str, Any] = {}
    for key in _HF_KEYS:
        value = getattr(hf, key, None)
        if value is None:
            continue
        if key == "compress_ratios" and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                _int(v, f"{hf_owner}.compress_ratios[{i}]", minimum=0)
        else:
            _int(value, f"{hf_owner}.{key}", minimum=0 if key.startswith("candidate_") else 1)
        fields[key] = value
    settings: dict[str, Any] = {}
    max_model_len = getattr(model_config, "max_model_len", None) if hf is not model_config else None
    if max_model_len is not None:
        settings["max_model_len"] = _int(max_model_len, "model_config.max_model_len", 1)
    spec = 0
    if speculative_config is not None:
        owner = "speculative_config"
        spec = _int(
            _attr(speculative_config, owner, "num_speculative_tokens"),
            f"{owner}.num_speculative_tokens",
        )
        adaptive = getattr(speculative_config, "enable_adaptive_verification", False)
        if not isinstance(adaptive, bool):
            raise ValueError(
                f"{owner}.enable_adaptive_verification must be a bool, got {adaptive!r}"
            )
        settings["adaptive_verification"] = adaptive
    settings["num_speculative_tokens"] = spec
    if cache_config is not None:
        settings["block_size"] = _int(
            _attr(cache_config, "cache_config", "block_size"), "cache_config.block_size", 1
        )
    if scheduler_config is not None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(scheduler_config, name, None)
            if value is not None:
                settings[name] = _int(value, f"scheduler_config.{name}", 1)
    settings.update(overrides)
    try:
        return IndexerConfig.from_hf_config(fields, layer=layer, **settings)
    except (TypeError, ValueError) as error:
        raise ValueError(f"IndexerConfig from vLLM configs: {error}") from None
