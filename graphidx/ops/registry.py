"""Registration of the graphidx custom ops from their torch references (docs/contract.md
section 5).

An op's operands are declared once, by its reference's signature: `define_op` derives the
custom op's schema and its implementation (its body) from it and returns the launcher a
public wrapper calls once its arguments are validated and its backend resolved.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphidx.ops.backend import implementation, run_op

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_BACKEND = inspect.Parameter("backend", _POSITIONAL, annotation=str)


def _forwarding_body(
    name: str, reference: Callable[..., None], kernels: str, params: list[inspect.Parameter]
) -> Callable[..., None]:
    """`body(<params>, backend)`: runs the backend's implementation, passing the positional
    params positionally and the keyword-only ones by keyword.

    Compiled from source with the params spelled out, as dataclasses does, so a call costs
    what a hand-written body costs (the eager path runs it once per op launch).
    """
    names = [p.name for p in params]
    passed = [p.name if p.kind is _POSITIONAL else f"{p.name}={p.name}" for p in params]
    source = (
        f"def body({', '.join(names)}, backend):\n"
        f"    implementation(backend, reference, kernels, name)({', '.join(passed)})\n"
    )
    scope: dict[str, Any] = {
        "implementation": implementation,
        "reference": reference,
        "kernels": kernels,
        "name": name,
    }
    exec(source, scope)
    body: Callable[..., None] = scope["body"]
    return body


def define_op(
    name: str,
    reference: Callable[..., None],
    kernels: str,
    *,
    mutates_args: Iterable[str],
) -> Callable[..., None]:
    """Register `graphidx::<name>` and return its launcher.

    The op takes `reference`'s parameters in their order, each positional and without its
    default, then `backend: str`; its schema is inferred from their annotations. Its body
    forwards to `implementation(backend, reference, kernels, name)` in the reference's
    calling convention, which the Triton and aiter functions share. The launcher takes the op's
    operands positionally, the resolved backend last, and runs them through
    `run_op(torch.ops.graphidx.<name>, body, ...)`.
    """
    signature = inspect.signature(reference, eval_str=True)
    params = list(signature.parameters.values())
    body = _forwarding_body(name, reference, kernels, params)
    operand_params = [p.replace(kind=_POSITIONAL, default=inspect.Parameter.empty) for p in params]
    body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*operand_params, _BACKEND], return_annotation=signature.return_annotation
    )
    body.__name__ = body.__qualname__ = f"{name}_body"
    torch.library.custom_op(f"graphidx::{name}", body, mutates_args=tuple(mutates_args))
    op = getattr(torch.ops.graphidx, name)

    def launch(*operands: Any) -> None:
        run_op(op, body, *operands)

    launch.__name__ = launch.__qualname__ = name
    return launch
