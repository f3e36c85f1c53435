"""Registration of the graphidx custom ops from their torch references (docs/contract.md
section 5).

An op's operands are declared once, by its reference's signature: `define_op` derives the
custom op's schema and its implementation (the body that `graphidx.ops.backend.run_op`
calls) from it, so no wrapper repeats the operand list in a second function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphidx.ops.backend import implementation

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_BACKEND = inspect.Parameter("backend", _POSITIONAL, annotation=str)


def define_op(
    name: str,
    reference: Callable[..., None],
    kernels: str,
    *,
    mutates_args: Iterable[str],
) -> Callable[..., None]:
    """Register `graphidx::<name>` and return its body.

    The op takes `reference`'s parameters in their order, each positional and without its
    default, then `backend: str`; its schema is inferred from their annotations. The body
    runs `implementation(backend, reference, kernels, name)` with the reference's positional
    parameters passed positionally and its keyword-only ones by keyword, so the Triton and
    aiter functions keep the reference's calling convention.
    """
    signature = inspect.signature(reference, eval_str=True)
    params = list(signature.parameters.values())
    positional = sum(p.kind is _POSITIONAL for p in params)
    keywords = tuple(p.name for p in params[positional:])

    def body(*operands: Any) -> None:
        impl = implementation(operands[-1], reference, kernels, name)
        impl(*operands[:positional], **dict(zip(keywords, operands[positional:-1], strict=True)))

    operand_params = [p.replace(kind=_POSITIONAL, default=inspect.Parameter.empty) for p in params]
    body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*operand_params, _BACKEND], return_annotation=signature.return_annotation
    )
    body.__name__ = body.__qualname__ = f"{name}_body"
    torch.library.custom_op(f"graphidx::{name}", body, mutates_args=tuple(mutates_args))
    return body
