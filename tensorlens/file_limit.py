"""``tl.setup()``: raise the open-file limit before trackers start opening files."""

from __future__ import annotations

import sys
import warnings

MACOS_OPEN_MAX = 10240  # macOS refuses a soft limit above OPEN_MAX


def setup() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (on macOS at most 10240).

    Returns ``(old_soft, new_soft)``; on Windows, where there is no such limit, warns and returns
    ``None``. Child processes (DataLoader workers, DDP ranks) inherit the raised limit.

    >>> old, new = setup()  # doctest: +SKIP
    """
    try:
        import resource
    except ImportError:
        warnings.warn("tensorlens.setup(): this platform has no RLIMIT_NOFILE (Windows); nothing changed", stacklevel=2)
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        target = MACOS_OPEN_MAX if sys.platform == "darwin" else max(soft, 1 << 20)
    if sys.platform == "darwin":
        target = min(target, MACOS_OPEN_MAX)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:
            warnings.warn(f"tensorlens.setup(): could not raise the open-file limit to {target}: {err}", stacklevel=2)
            return soft, soft
        return soft, target
    return soft, soft
