"""Where things live: the repository root, the shipped zoo, the shared development data, the configs.

One place for every path the engine resolves, so entry points and library code agree. Environment
variables override the defaults: `EXPERTSPEC_ZOO` (zoo folder), `EXPERTSPEC_SHARED_DATA` (shared data),
`EXPERTSPEC_CACHE` (derived files such as recorded traces; default ~/.cache/expertspec).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
ZOO_NAMES = ("tiny-moe", "tiny-dense")


def zoo_dir() -> Path:
    """The zoo folder: `$EXPERTSPEC_ZOO` or `<repo>/zoo`."""
    return Path(os.environ.get("EXPERTSPEC_ZOO") or REPO_ROOT / "zoo")


def zoo_path(name: str = "tiny-moe") -> Path:
    """The shipped checkpoint folder `name` in the zoo; a clear error naming the fix if it is absent."""
    path = zoo_dir() / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"zoo checkpoint {name!r} not found at {path}: build the zoo with `python -m engine.zoo` "
            f"(about 20 minutes on 2 CPU cores; known names: {', '.join(ZOO_NAMES)}), "
            "or point EXPERTSPEC_ZOO at a folder that holds it"
        )
    return path


def repo_relative(path: str | os.PathLike | None) -> Path | None:
    """`path` as an absolute path, a relative one taken from the repository root; None/'' stays None."""
    if not path:
        return None
    p = Path(path).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def shared_data_dir(setting: str | None = None) -> Path:
    """setting, else $EXPERTSPEC_SHARED_DATA, else ../shared/data (relative paths from the repository root).

    The folder exists on development and CI machines only; callers check `.is_dir()` and skip cleanly.
    """
    return repo_relative(setting or os.environ.get("EXPERTSPEC_SHARED_DATA") or "../shared/data")


def cache_dir() -> Path:
    """Where derived artefacts (recorded traces, trained default policies) are cached: never the repository."""
    return Path(os.environ.get("EXPERTSPEC_CACHE") or Path.home() / ".cache" / "expertspec")
