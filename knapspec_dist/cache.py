"""Where knapspec_dist keeps what it makes once and reuses: converted models, built kernels,
measured profiles. Its own module (no torch, no transformers), so that what only needs the
folder, a kernel build or a profile store in every Ray actor, imports nothing heavy."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """Root cache directory of knapspec_dist.

    ``$KNAPSPEC_CACHE`` if set; otherwise the platform's user cache directory plus
    ``knapspec_dist``: ``$XDG_CACHE_HOME/knapspec_dist`` (default
    ``~/.cache/knapspec_dist``) on Linux and other POSIX systems,
    ``~/Library/Caches/knapspec_dist`` on macOS and
    ``%LOCALAPPDATA%\\knapspec_dist`` on Windows.  The directory is not created here.
    """
    env = os.environ.get("KNAPSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        root = Path(base) if base else Path.home() / "AppData" / "Local"
    elif sys.platform == "darwin":
        root = Path.home() / "Library" / "Caches"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        # The XDG spec says relative values are invalid and must be ignored.
        root = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return root / "knapspec_dist"
