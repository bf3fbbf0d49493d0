"""The interp custom ops. What they do at a site is read from persistent buffers.

``interp::site(x, extra, site)`` adds the row's steering vector for that site to ``x`` in place, patches the rows
the step patches there, and, on steps that capture, copies the selected rows of the result (plus ``extra``: the
other half of the residual stream that vLLM keeps apart) out before any later op can change them in place.
``interp::site_pair(x, extra, site)`` does the same at residual-stream sites that patch, on both halves in place,
since a patched row must own the whole stream. Both mutate their inputs and return nothing: under torch.compile
they are functionalized and put back in place where nothing else reads the old values (Inductor's re-inplacing), so
a site with nothing to do in a step costs its call and no copy.
``interp::capture_only(x, site)`` copies the selected rows of ``x`` out at a capture-only site (``router_logits``)
and returns nothing: like ``flag_rows``, it is kept in compiled graphs as a side effect.
``interp::flag_rows(bad)`` marks the requests of the rows where ``bad`` holds as computed through a non-finite
value (``nonfinite``); it returns nothing and is kept in compiled graphs as a side effect.

The ops act on the state of the engine that runs (``activate``: set by the model runner's patch each step, and
while an engine's model is built).
"""

import torch
import torch.fx

from typing import Optional

_ops_registered = False
_active = None  # the InterpState of the engine that runs


def activate(state) -> None:
    global _active
    _active = state


def deactivate(state) -> None:
    """Forget ``state`` if it is the active one (its engine is closing: its buffers must not outlive it)."""
    global _active
    if _active is state:
        _active = None


def active_state():
    if _active is None:
        raise RuntimeError("interp op called outside an instrumented engine")
    return _active


def _site_impl(x: torch.Tensor, extra: Optional[torch.Tensor], site: int) -> None:
    active_state().apply_site(x, extra, site)


def _site_pair_impl(x: torch.Tensor, extra: torch.Tensor, site: int) -> None:
    active_state().apply_pair(x, extra, site)


def _capture_only_impl(x: torch.Tensor, site: int) -> None:
    active_state().capture_only(x, site)


def _flag_rows_impl(bad: torch.Tensor) -> None:
    active_state().flag_rows(bad)


# (name, implementation, the arguments it mutates, whether it acts by side effect alone)
_OPS = (
    ("site", _site_impl, ("x",), False),
    ("site_pair", _site_pair_impl, ("x", "extra"), False),
    ("capture_only", _capture_only_impl, (), True),
    ("flag_rows", _flag_rows_impl, (), True),
)
_library: torch.library.Library | None = None


def register_ops() -> None:
    """Define the ops through ``torch.library.Library`` (as vLLM defines its own): a call is dispatched straight to
    its implementation, without ``torch.library.custom_op``'s per-call wrappers and checks (about 10 us a call on
    a CPU, and every site's op is called in each step that runs outside CUDA graphs)."""
    global _ops_registered, _library
    if _ops_registered:
        return
    _library = torch.library.Library("interp", "FRAGMENT")
    for name, impl, mutated, side_effect in _OPS:
        _library.define(name + torch.library.infer_schema(impl, mutates_args=mutated))
        _library.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"interp::{name}", _returns_nothing, lib=_library)
        if side_effect:  # no output and no mutated argument: without this, dead-code elimination would drop it
            torch.fx.node.has_side_effect(getattr(torch.ops.interp, name).default)
    _ops_registered = True


def _returns_nothing(*args) -> None:  # every op's fake: none has an output
    return None


def apply_site(x: torch.Tensor, extra: torch.Tensor | None, site: int) -> torch.Tensor:
    """x after the site's op (the same tensor, changed in place)."""
    torch.ops.interp.site(x, extra, site)
    return x


def capture_only(x: torch.Tensor, site: int) -> None:
    torch.ops.interp.capture_only(x, site)


def flag_rows(bad: torch.Tensor) -> None:
    torch.ops.interp.flag_rows(bad)


def apply_pair(x: torch.Tensor, extra: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, extra) after the site's op (the same tensors, changed in place)."""
    torch.ops.interp.site_pair(x, extra, site)
    return x, extra
