"""Thin adapters from serving runtimes' metadata to graphidx's inputs.

Neither runtime is imported: each adapter reads the runtime's objects by attribute name, as
they are spelled in the upstream version its module docstring names, and raises
`ValueError` naming the attribute when one is missing or malformed.

- `graphidx.integrations.vllm`: a `StepBatch` from vLLM v1's `CommonAttentionMetadata`, and
  an `IndexerConfig` from vLLM's model / speculative / cache / scheduler configs.
- `graphidx.integrations.sglang`: SGLang attention-backend CUDA-graph hooks over an
  `IndexerGraphRunner`'s persistent step buffers, and the top-k positions -> KV slot ids
  transform its sparse attention takes.
"""
