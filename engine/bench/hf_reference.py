"""transformers as the reference the benchmarks and parity tests compare against, with one clear error where it
cannot load.

transformers >= 5.25 requires Hugging Face's kernel hub package, whose import name is `kernels` — the name of our
top-level Triton package. With both installed, whichever comes first on `sys.path` wins; from a checkout that is
ours, and every transformers model class then fails on `from kernels import CUDAProperties`. pyproject.toml pins
transformers below 5.25 for that reason; this check names the conflict instead of the ImportError deep inside
transformers.
"""

from __future__ import annotations

import importlib.metadata


def kernels_conflict() -> str | None:
    """A message if Hugging Face's `kernels` distribution is installed while `import kernels` finds ours, else None."""
    try:
        hub_version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    import kernels

    if hasattr(kernels, "get_kernel"):  # the hub package itself is the one imported
        return None
    return (
        f"Hugging Face's `kernels` {hub_version} is installed (transformers >= 5.25 requires it), but `import kernels` "
        f"finds expertspec's own package ({kernels.__file__}), so transformers' model classes cannot load. Install "
        "the pinned reference: pip install 'transformers>=4.51,<5.25' && pip uninstall -y kernels "
        "(or bash scripts/setup.sh)."
    )


def require_transformers():
    """Import transformers, raising RuntimeError with `kernels_conflict()`'s message before any model is built."""
    message = kernels_conflict()
    if message:
        raise RuntimeError(message)
    import transformers

    return transformers
