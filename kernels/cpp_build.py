"""Build and load one C++ CPU extension (`small_m.cpp`, `cpu_decode.cpp`, `tanh_mlp.cpp`) once per process, never
fatally.

    ext = CppExtension("small_m", "EXPERTSPEC_SMALL_M", cflags=("-O3",), simd=True)
    module = ext.load()      # the compiled module, or None when it is off
    ext.status()             # 'on (AVX2)', 'on (AVX-512)' or 'off (<why>)'

`torch.utils.cpp_extension` compiles the source on first use and caches it under ~/.cache/torch_extensions
(TORCH_EXTENSIONS_DIR moves it), in one folder per checkout: the folder name carries a hash of the source path, since
two checkouts sharing one folder would rebuild it each time the other one loaded it. A change to a shared header
(`sweep.h`) rebuilds too: the headers' digest is one of the flags, which torch's rebuild check covers. An extension
is off when its environment switch is "0", when `needs()` names a missing CPU feature, when no compiler or ninja is
found, or when the build fails; its Python twin then runs everywhere. A `simd` extension (written in kernels/simd.h's
vector ops) is built for the widest vector set torch detects on the CPU, AVX-512F or AVX2 + FMA (`simd_isa`;
ATEN_CPU_CAPABILITY=avx2 lowers it), and is off on a CPU with neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class CppExtension:
    """One C++ source next to this file, built on the first `load()` (thread-safe), its outcome in `state`."""

    def __init__(
        self,
        stem: str,
        switch: str,
        cflags: tuple[str, ...] = ("-O3",),
        needs: Callable[[], str | None] = lambda: None,
        on: str = "on",
        simd: bool = False,
    ) -> None:
        self.source = Path(__file__).with_name(f"{stem}.cpp")
        self.name = f"expertspec_{stem}_" + hashlib.sha256(str(self.source.resolve()).encode()).hexdigest()[:10]
        self.switch, self.cflags, self.needs, self.on, self.simd = switch, list(cflags), needs, on, simd
        # torch rebuilds when a source or a flag changes, not a header: the headers' digest rides on the flags
        headers = sorted(self.source.parent.glob("*.h"))
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:12]
        self.cflags.append(f"-DEXPERTSPEC_HEADERS_SHA=0x{digest}")
        self.state: dict[str, Any] = {"module": None, "status": None}
        self._lock = threading.Lock()

    def _build(self) -> tuple[Any, str]:
        if os.environ.get(self.switch, "1") == "0":
            return None, f"off ({self.switch}=0)"
        missing = self.needs()
        if missing:
            return None, f"off ({missing})"
        cflags, on = self.cflags, self.on
        if self.simd:
            isa = simd_isa()
            if isa is None:
                import torch

                return None, f"off (CPU capability {torch.backends.cpu.get_cpu_capability()}, needs AVX2 or AVX512)"
            cflags, on = cflags + list(SIMD_FLAGS[isa]), f"on ({SIMD_LABELS[isa]})"
        try:
            from torch.utils import cpp_extension

            clear_stale_lock(Path(cpp_extension._get_build_directory(self.name, False)))
            module = cpp_extension.load(self.name, [str(self.source)], extra_cflags=cflags, verbose=False)
        except Exception as err:  # no compiler / ninja, or a failed build: the Python twin everywhere
            return None, f"off (build failed: {type(err).__name__}: {str(err).splitlines()[0][:200]})"
        return module, on

    def load(self) -> Any:
        """The compiled extension (built on the first call), or None when it is off (see `status`)."""
        if self.state["status"] is None:
            with self._lock:
                if self.state["status"] is None:
                    self.state["module"], self.state["status"] = self._build()
        return self.state["module"]

    def status(self) -> str:
        """'on (...)' or 'off (<why>)' (builds the extension if that has not been tried yet)."""
        self.load()
        return self.state["status"]


SIMD_FLAGS = {"AVX512": ("-mavx512f", "-mfma"), "AVX2": ("-mavx2", "-mfma")}  # what kernels/simd.h builds with
SIMD_LABELS = {"AVX512": "AVX-512", "AVX2": "AVX2"}


def simd_isa() -> str | None:
    """The vector set a `simd` extension is built for: torch's CPU capability ('AVX512'; 'AVX2', which torch grants
    only with FMA), or None on a CPU with neither (or with ATEN_CPU_CAPABILITY=default)."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in SIMD_FLAGS else None


def clear_stale_lock(build_dir: Path, older_than_s: float = 600.0) -> None:
    """Remove a build lock left by a build that was killed (torch would wait on it forever); a build takes under a
    minute, so a lock older than `older_than_s` has no live owner."""
    lock = build_dir / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > older_than_s:
            lock.unlink()
