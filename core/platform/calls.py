"""Calling hook implementations one by one, the way pluggy's own hook loop does.

Most hooks are called through pluggy (`pm.hook.<name>(**kwargs)`). Where the facade needs each
plugin's answer with the plugin's name (kernel tables merged entry by entry, detection results
recorded per plugin), it walks the implementations in pluggy's call order and calls each with
only the arguments it declares (`impl.argnames`), so an implementation that takes fewer
arguments than the hookspec offers works unchanged ("arguments only grow").
"""

from __future__ import annotations

from typing import Any

import pluggy


def ordered_impls(caller: pluggy.HookCaller) -> list:
    """A hook's implementations in call order: tryfirst ones, then the others with the most
    recently registered first, then trylast ones (pluggy keeps them in reverse)."""
    impls = list(reversed(caller.get_hookimpls()))
    for impl in impls:
        if impl.hookwrapper or getattr(impl, "wrapper", False):
            raise TypeError(f"plugin {impl.plugin_name!r}: {caller.name} is a wrapper; k3's hooks take plain "
                            "implementations only")
    return impls


def call_impl(impl, kwargs: dict[str, Any]) -> Any:
    """One implementation's answer, given only the arguments it declares: its plain parameters
    positionally, its keyword parameters with defaults by name when the call offers them."""
    args = [kwargs[name] for name in impl.argnames]
    options = {name: kwargs[name] for name in getattr(impl, "kwargnames", ()) if name in kwargs}
    return impl.function(*args, **options)


def answers(caller: pluggy.HookCaller, **kwargs) -> list[tuple[str, Any]]:
    """(plugin name, answer) for every implementation in call order; None answers dropped."""
    out = []
    for impl in ordered_impls(caller):
        result = call_impl(impl, kwargs)
        if result is not None:
            out.append((impl.plugin_name, result))
    return out
