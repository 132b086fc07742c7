"""Records the kernel variants that Triton's interpreter launches, in the form `scripts/compile_kernels.py
--recorded` compiles: each argument specialised as the JIT specialises it on a GPU (Triton's own rule: an
integer 1 becomes a constexpr, integers and pointers divisible by 16 are declared so), the constexprs and the
launch options. Import `triton_interpreter` before this module."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager

from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import native_specialize_impl

__all__ = ["recorded_launches"]


def _variant(fn, args: tuple, kwargs: dict) -> dict:
    types, constexprs, divisible = {}, {}, []
    for i, param in enumerate(inspect.signature(fn).parameters.values()):
        value = args[i] if i < len(args) else kwargs.get(param.name, param.default)
        if "constexpr" in str(param.annotation):  # the annotation, or its text under postponed evaluation
            constexprs[param.name] = value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            constexprs[param.name] = value
        else:
            types[param.name] = kind
            if key == "D":
                divisible.append(param.name)
    return {"kernel": f"{fn.__module__}:{fn.__name__}", "types": types, "constexprs": constexprs,
            "divisible": divisible, "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3),
            "maxnreg": kwargs.get("maxnreg")}


@contextmanager
def recorded_launches() -> Iterator[list[dict]]:
    """The distinct variants launched inside the block, in launch order (the list fills as they launch)."""
    variants, seen = [], set()
    launch = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        variant = _variant(self.fn, args, kwargs)
        key = json.dumps(variant, sort_keys=True)
        if key not in seen:
            seen.add(key)
            variants.append(variant)
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield variants
    finally:
        InterpretedFunction.run = launch
