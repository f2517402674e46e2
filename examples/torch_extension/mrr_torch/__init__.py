"""mrr (MoE routing replay) for PyTorch: the C++ extension built from mrr's headers, plus a
Megatron-compatible RouterReplay backed by it.

    import mrr_torch
    mrr_torch.load()                       # builds once (about a minute), then loads from cache
    router = mrr_torch.Router(64, 8, pre_softmax=True, normalize_topk=True)
    store = mrr_torch.open_route_file({"mode": "R2", "record_file": "routes.mrr"}, 64, 4, 8)
    replay = mrr_torch.Replay(store)

Until load() has run, the extension's names (Router, RouteFile, Replay, open_route_file,
validate_ids and the exception classes) are not attributes of this package.
"""

import os
from pathlib import Path

from .router_replay import RouterReplay, RouterReplayAction

__all__ = [
    "load",
    "extension",
    "RouterReplay",
    "RouterReplayAction",
    "Router",
    "RouteFile",
    "Replay",
    "open_route_file",
    "validate_ids",
    "InvalidArgumentError",
    "ConfigError",
    "RouteStoreError",
    "RouteFileError",
    "CommunicatorError",
    "PeerRankError",
]

_PACKAGE = Path(__file__).resolve().parent
_EXPORTS = [name for name in __all__ if name not in ("load", "extension", "RouterReplay", "RouterReplayAction")]
_module = None


def _include_dir():
    """mrr's headers: $MRR_INCLUDE_DIR, else <repo>/include (this file is <repo>/examples/torch_extension/mrr_torch)."""
    env = os.environ.get("MRR_INCLUDE_DIR")
    path = Path(env) if env else _PACKAGE.parents[2] / "include"
    if not (path / "mrr" / "torch" / "router.hpp").is_file():
        raise FileNotFoundError(
            f"mrr's headers are not under {path} (expected mrr/torch/router.hpp there); set MRR_INCLUDE_DIR"
        )
    return path


def _cuda_build(cpp_extension):
    """Whether to build the CUDA half (cuda_router.cu): CUDA torch, a GPU and nvcc, unless
    MRR_TORCH_CUDA=0; MRR_TORCH_CUDA=1 makes a missing piece an error instead of a CPU-only build."""
    import torch

    wanted = os.environ.get("MRR_TORCH_CUDA", "auto")
    if wanted == "0":
        return False
    missing = []
    if not torch.cuda.is_available():
        missing.append("torch.cuda.is_available() is False")
    if cpp_extension.CUDA_HOME is None:
        missing.append("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    if missing and wanted == "1":
        raise RuntimeError("MRR_TORCH_CUDA=1 but " + "; ".join(missing))
    return not missing


def load(build_dir=None, verbose=False):
    """Builds (when its sources changed) and imports the extension; returns the module.

    build_dir: where ninja builds it; default $MRR_TORCH_EXT_BUILD_DIR, else mrr_torch/_build.
    With CUDA torch, a GPU and nvcc, the CUDA half is built too (module.has_cuda): CUDA tensors
    then route on the GPU, on the current stream. A CPU-only build lives in its own folder.
    """
    global _module
    if _module is not None:
        return _module
    from torch.utils import cpp_extension

    cuda = _cuda_build(cpp_extension)
    build = Path(build_dir or os.environ.get("MRR_TORCH_EXT_BUILD_DIR") or _PACKAGE / "_build")
    if cuda:
        build = build / "cuda"
    build.mkdir(parents=True, exist_ok=True)
    csrc = _PACKAGE.parent / "csrc"
    includes = [str(_include_dir()), os.environ.get("MRR_EIGEN_INCLUDE_DIR", "/usr/include/eigen3")]
    sources = [str(csrc / "extension.cpp")]
    cflags = ["-std=c++20", "-O2"]
    kwargs = {}
    if cuda:
        sources.append(str(csrc / "cuda_router.cu"))
        cflags.append("-DMRR_TORCH_WITH_CUDA")
        cccl = Path(cpp_extension.CUDA_HOME) / "include" / "cccl"  # CUDA 13 keeps Thrust/CUB there
        if cccl.is_dir():
            includes.append(str(cccl))
        kwargs["extra_cuda_cflags"] = ["-std=c++20", "-O2", "-DMRR_TORCH_WITH_CUDA", "--expt-relaxed-constexpr"]
    module = cpp_extension.load(
        name="mrr_torch_C",
        sources=sources,
        extra_cflags=cflags,
        extra_include_paths=includes,
        build_directory=str(build),
        verbose=verbose,
        **kwargs,
    )
    for name in _EXPORTS:
        globals()[name] = getattr(module, name)
    _module = module
    return module


def extension():
    """The loaded extension module (load() first)."""
    if _module is None:
        raise RuntimeError("mrr_torch.load() has not been called")
    return _module
