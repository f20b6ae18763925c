"""The fixed-order fp32 GEMM of kernels/csrc/fixed_order_gemm.c, compiled on first use and called via ctypes.

`bmm(a [B, M, K], packed_b, n) -> [B, M, N]` float32: every output element is one FMA chain over K
in order, so its bits depend on its row of `a` and its column of `b` only (batch-invariant), and
exact zero terms anywhere in K change nothing (padding-invariant: a KV-cache step equals a full
forward). It is the default matmul of the invariant kernels (`exact_matmul.SCHEME = "fixed"`):
float32 arithmetic at 0.5-0.9x BLAS speed, where the exact-integer schemes need three float64 GEMMs
plus the splitting.

Build: `cc -O3 -march=native -ffp-contract=fast -shared -fPIC` into
`~/.cache/flywheel/kernels/fixed_order_gemm-<hash>.so` (`FLYWHEEL_KERNELS_CACHE` moves it), the hash
over the source, the flags, the compiler's version and this CPU's feature flags; written to a temporary
name and renamed, so concurrent first uses (trainer, replicas) race safely. It compiles in about a
second. The C source refuses to build without hardware FMA, and `available()` is then False with the
reason in `unavailable_reason()`; kernels/exact_matmul.py falls back to its `float64` scheme,
which gives different bits: the trainer and every replica must run on CPUs that agree (the status
of each is logged once). The per-element arithmetic is fixed by the source (one rounding per FMA,
K in order), not by the vector width the compiler picks, so machines with and without AVX-512 agree.

Threads: the columns' panels are split over `torch.get_num_threads()` workers; ctypes releases the
GIL for the call, and the split does not change any element's arithmetic.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fixed_order_gemm.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-shared", "-fPIC")
# kernels.invariant.exp in C: every operation rounded on its own, as its torch form does
EXP_SOURCE = Path(__file__).parent / "csrc" / "invariant_exp.c"
EXP_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_PARALLEL_MIN_FLOPS = 1 << 21  # below this a call runs on the calling thread alone

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cache_dir() -> Path:
    root = os.environ.get("FLYWHEEL_KERNELS_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "flywheel" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH; set CC")
    return cc


def _compile(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(
        "\0".join(
            [source.read_text(), " ".join(flags), version, platform.machine(), _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            so = Path(tmp) / out.name
            done = subprocess.run(
                [cc, *flags, "-o", str(so), str(source)], capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
            os.replace(so, out)
        logger.info("built %s", out)
    return ctypes.CDLL(str(out))


def _build() -> ctypes.CDLL:
    lib = _compile(SOURCE, FLAGS)
    p, i = ctypes.c_void_p, ctypes.c_ssize_t
    lib.fo_gemm.argtypes = [p, i, i, p, i, p, i, i, i, i, i, i, i, i]
    lib.fo_gemm.restype = None
    lib.fo_nr.restype = ctypes.c_int
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _error = str(e)
                logger.warning("fixed-order GEMM unavailable (%s); exact-integer matmul used", e)
    return _lib


_exp_lib: ctypes.CDLL | None = None
_exp_error: str | None = None


def _load_exp() -> ctypes.CDLL | None:
    global _exp_lib, _exp_error
    if _exp_lib is not None or _exp_error is not None:
        return _exp_lib
    with _lock:
        if _exp_lib is None and _exp_error is None:
            try:
                lib = _compile(EXP_SOURCE, EXP_FLAGS)
                lib.fo_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ssize_t]
                lib.fo_exp.restype = None
                _exp_lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _exp_error = str(e)
                logger.warning("compiled exp unavailable (%s); its torch form is used", e)
    return _exp_lib


def exp(x: torch.Tensor) -> torch.Tensor | None:
    """kernels.invariant.exp of a float32 CPU tensor in one C pass, the same bits; None where the
    C form cannot be built here (the caller then runs the torch form)."""
    lib = _load_exp()
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        lib.fo_exp(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def nr() -> int:
    """Columns per packed panel of B (the compiled vector width x 2)."""
    lib = _load()
    assert lib is not None, f"fixed-order GEMM unavailable: {_error}"
    return int(lib.fo_nr())


def pack(b: torch.Tensor) -> torch.Tensor:
    """b [B, K, N] float32 -> panels [B, P, K, NR] (N zero-padded to P * NR), contiguous."""
    width = nr()
    nb, k, n = b.shape
    panels = -(-n // width)
    if panels * width != n:
        b = torch.nn.functional.pad(b, (0, panels * width - n))
    return b.reshape(nb, k, panels, width).permute(0, 2, 1, 3).contiguous()


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(workers, thread_name_prefix="fo-gemm"), workers
        return _pool


def bmm(a: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """a [B, M, K] float32 @ b (packed by `pack`, N columns) -> [B, M, N] float32."""
    lib = _load()
    assert lib is not None, f"fixed-order GEMM unavailable: {_error}"
    assert a.dtype == packed.dtype == torch.float32 and a.device.type == "cpu"
    nb, m, k = a.shape
    assert packed.shape[0] in (nb, 1) and packed.shape[2] == k and packed.is_contiguous()
    if a.stride(2) != 1 or (m > 1 and a.stride(1) < k):
        a = a.contiguous()
    out = torch.empty(nb, m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bp_stride = packed.stride(0) if packed.shape[0] == nb else 0
    args = (
        a.data_ptr(), a.stride(0), a.stride(1) if m > 1 else k,
        packed.data_ptr(), bp_stride,
        out.data_ptr(), out.stride(0), out.stride(1),
        nb, m, n, k,
    )  # fmt: skip
    panels = packed.shape[1]
    workers = min(torch.get_num_threads(), panels)
    if workers <= 1 or 2 * nb * m * n * k < _PARALLEL_MIN_FLOPS:
        lib.fo_gemm(*args, 0, panels)
    else:
        bounds = [panels * w // workers for w in range(workers + 1)]
        pool = _executor(workers)
        jobs = [pool.submit(lib.fo_gemm, *args, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        for job in jobs:
            job.result()
    return out
