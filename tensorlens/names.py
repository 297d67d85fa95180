"""Names users give (module and parameter names, ``summarize_*``, ``save_scalar``, losses), made
safe to record.

A Python ``str`` may hold a lone surrogate (``"layer\\udc80"``: a name decoded with
``surrogateescape``, or built by hand and passed to ``add_module`` or as a ``ModuleDict`` key).
It cannot be encoded as UTF-8, so a run that recorded it breaks every reader that writes it out
(the report, the explorer, ``export``, ``sync``, every tracker). Each tensor's record name is
escaped once, where the engine lays out a step's statistics (the plan is built once and reused,
so this costs nothing per step), and the names of values derived on the device (training
dynamics) where they are made: a name that is valid UTF-8 is kept as it is, and one that is
not has each offending code point written as ``\\uXXXX`` (``backslashreplace``), so
``"layer\\udc80"`` is recorded as the ten characters ``layer\\udc80``. Collections are still
matched against the name as given.
"""

from __future__ import annotations


def record_safe(name: str) -> str:
    """``name`` when it is valid UTF-8, else with every code point UTF-8 cannot hold escaped.

    >>> record_safe("encoder.fc1.weight"), record_safe("layer\\udc80.weight")
    ('encoder.fc1.weight', 'layer\\\\udc80.weight')
    """
    if name.isascii():
        return name
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name
