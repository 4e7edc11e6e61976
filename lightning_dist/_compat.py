"""Every version gate and optional-dependency probe of the pack, in one place.

Other modules import the names below instead of checking versions themselves.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Any

import torch
from lightning_utilities.core.imports import compare_version

# The releases this pack is tested on: the compatibility subset runs on both ends of the torch range
# (`make test-compat-all`), everything on the pinned release in between. pyproject.toml states the same range.
TORCH_MIN, TORCH_MAX_TESTED = "2.11.0", "2.14"
LIGHTNING_RANGE = ("2.6.0", "2.7.0")
# transformers releases whose MoE modeling modules' router loss the pack swaps for the global one
# (_integrations/transformers_moe.py; the swap also holds itself to the model's own function on first use)
TRANSFORMERS_MOE_TESTED = ("5.0.0", "6.0.0")
# transformers releases whose `GradientCheckpointingLayer._can_checkpoint_with_cache` (a layer that only reads its KV
# cache) the pack's activation checkpointing reads (_integrations/transformers_cache.py)
TRANSFORMERS_CACHE_TESTED = ("5.0.0", "6.0.0")

TORCH_GE_2_13 = compare_version("torch", lambda a, b: a >= b, "2.13.0")

# torch < 2.13: a DTensor all-gathered from uneven shards keeps the padded buffer's strides, so a later
# `view` inside F.linear fails ("view size is not compatible"); regions re-pack such inputs (parallelize/tp/apply.py).
DTENSOR_UNEVEN_GATHER_STRIDED = not TORCH_GE_2_13
# torch < 2.13: a multi-stage schedule's first step posts a gloo send/recv between two stages of the SAME rank
# (ZBV at pp=2), which gloo cannot pair ("Pair is not connected"); our stages leave those ops out.
PIPELINE_INIT_P2P_TO_SELF = not TORCH_GE_2_13
# torch < 2.13: with data parallelism around it, sequence parallelism deadlocks in a backward all-gather of the
# sequence shards under gloo (seen: tp2 x dp_shard2, ViT with 17 tokens); TensorParallelStrategy refuses the mix.
TP_SEQUENCE_PARALLEL_WITH_DP_HANGS = not TORCH_GE_2_13
# torch < 2.13: DefaultStager closes its StateDictStager after every stage (clearing its copy dispatch table), so a
# second async save through the same stager fails ("KeyError: <class 'type'>" on the optimizer's defaultdict);
# checkpoint_async.py builds a new stager per save there (the host buffers are then not reused).
DCP_STAGER_SINGLE_USE = not TORCH_GE_2_13

# torch's private list of this process's process groups (`distributed_c10d._world.pg_map`, in creation order):
# the exit flush of gloo's worker threads needs it (_integrations/torch_distributed.py). Tested 2.11-2.14; on
# another release the flush is skipped and groups are only destroyed.
TORCH_GROUP_REGISTRY = (
    compare_version("torch", lambda a, b: a >= b, TORCH_MIN)
    and compare_version("torch", lambda a, b: a < b, "2.15.0")
    and hasattr(getattr(torch.distributed, "distributed_c10d", None), "_world")
)

# torch's C++ DTensor dispatch cache can be emptied (2.11 and later): _integrations/torch_distributed.py
DTENSOR_CACHE_CLEAR = hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache")

CUDA_AVAILABLE = torch.cuda.is_available()


@lru_cache(maxsize=None)
def module_available(name: str) -> bool:
    """True when `name` can be imported (no import is performed)."""
    return importlib.util.find_spec(name) is not None


def _lightning_importable() -> bool:
    try:
        import lightning  # noqa: F401
    except ModuleNotFoundError as err:  # not installed: the Lightning-free parts work; a broken install raises
        if err.name != "lightning":
            raise
        return False
    return True


# Lightning installed: the strategies and callbacks exist (mesh, parallelize and the planner do without it)
LIGHTNING_IMPORTABLE = _lightning_importable()


def check_versions() -> None:
    """Refuse a torch or Lightning release below the supported range; warn once above the tested one."""
    import warnings

    if not compare_version("torch", lambda a, b: a >= b, TORCH_MIN):
        raise ImportError(
            f"lightning-dist needs torch>={TORCH_MIN} (FSDP2, DTensor tensor parallelism and pipelining"
            f" as tested); found torch {torch.__version__}. Upgrade: pip install 'torch>={TORCH_MIN}'."
        )
    lo, hi = LIGHTNING_RANGE
    if LIGHTNING_IMPORTABLE and not (
        compare_version("lightning", lambda a, b: a >= b, lo) and compare_version("lightning", lambda a, b: a < b, hi)
    ):
        raise ImportError(
            f"lightning-dist supports lightning>={lo},<{hi}; found lightning {_lightning_version()}."
            f" Install a supported release: pip install 'lightning>={lo},<{hi}'."
        )
    if compare_version("torch", lambda a, b: a >= b, _next_minor(TORCH_MAX_TESTED)):
        warnings.warn(
            f"lightning-dist is tested on torch {TORCH_MIN} to {TORCH_MAX_TESTED}.x; torch {torch.__version__}"
            " is newer and untested: run `make test-compat TORCH_SPEC=torch==<version>` before relying on it.",
            stacklevel=2,
        )


def _lightning_version() -> str:
    import lightning

    return lightning.__version__


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}.0"


def fully_shard_api():
    """Return (fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, FSDPModule) from their public home."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, FSDPModule


def torch_sync_batchnorm_function():
    """torch's synchronized BatchNorm autograd function (CUDA kernels), the one ``nn.SyncBatchNorm`` applies.

    It has no public home: ``torch.nn.modules._functions.SyncBatchNorm`` since torch 1.x, unchanged signature
    ``apply(input, weight, bias, running_mean, running_var, eps, momentum, process_group, world_size)``.
    """
    from torch.nn.modules._functions import SyncBatchNorm

    return SyncBatchNorm


# torch releases whose pipelining internals `_integrations/torch_pipelining.py` was tested on (min, max minor)
TORCH_PIPELINING_TESTED = ("2.11", "2.14")


@lru_cache(maxsize=1)  # asked on hot paths (each ring attention call): the release does not change in a process
def torch_pipelining_tested() -> bool:
    """True on the torch releases the pipelining patches were tested on (``TORCH_PIPELINING_TESTED``)."""
    low, high = TORCH_PIPELINING_TESTED
    return compare_version("torch", lambda a, b: a >= b, f"{low}.0") and compare_version(
        "torch", lambda a, b: a < b, _next_minor(high)
    )


def torch_pipelining_exchanges_meta() -> bool:
    """torch's pipeline stages exchange their input/output metadata with their peers (``PipelineStage._recv_meta`` /
    ``_send_meta``, and the schedules' shape-mode vote ``_warmup_p2p``), as on torch 2.13 and 2.14; older releases
    infer the shapes by running the stages, with nothing for a peer to answer."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import PipelineStage

    return hasattr(PipelineStage, "_recv_meta") and hasattr(_PipelineSchedule, "_warmup_p2p")


def check_torch_pipelining(patch: str) -> None:
    """RuntimeError naming the release and the fix when `patch` would touch an untested torch's internals."""
    if not torch_pipelining_tested():
        low, high = TORCH_PIPELINING_TESTED
        raise RuntimeError(
            f"lightning-dist's pipeline patch `{patch}` uses torch.distributed.pipelining internals tested on torch"
            f" {low} to {high}.x; found torch {torch.__version__}. Install a tested torch, or run"
            " tests/unit/test_torch_pipelining_patches.py on this release and extend TORCH_PIPELINING_TESTED."
        )


def check_torch_internals(patch: str) -> None:
    """RuntimeError naming the release and the fix when the dry run's `patch` (a subclass or replacement of a private
    part of torch: pipelining's peer metadata, MemTracker / ModTracker) would run on a torch it was not tested on
    (the same releases as the pipelining patches, ``TORCH_PIPELINING_TESTED``)."""
    if not torch_pipelining_tested():
        low, high = TORCH_PIPELINING_TESTED
        raise RuntimeError(
            f"lightning-dist's dry run `{patch}` replaces private parts of torch tested on torch {low} to {high}.x;"
            f" found torch {torch.__version__}. Install a tested torch for the dry run (training is not affected), or"
            " run tests/distributed/test_dry_run.py on this release and extend TORCH_PIPELINING_TESTED."
        )


def check_torch_ring_attention() -> None:
    """RuntimeError naming the release and the fix when ``cp_style="ring"`` would call torch's private ring attention
    functions (``_integrations/torch_ring_attention.py``) on a torch they were not tested on (the same releases as the
    pipelining patches, ``TORCH_PIPELINING_TESTED``)."""
    if not torch_pipelining_tested():
        low, high = TORCH_PIPELINING_TESTED
        raise RuntimeError(
            f"cp_style='ring' calls torch's private ring attention (torch.distributed.tensor.experimental."
            f"_context_parallel), tested on torch {low} to {high}.x; found torch {torch.__version__}. Install a tested"
            " torch, use cp_style='ulysses', or run tests/unit/test_context_parallel.py on this release and extend"
            " TORCH_PIPELINING_TESTED."
        )


def deepspeed_available() -> bool:
    return module_available("deepspeed")


# The DeepSpeed releases the patches of `_integrations/deepspeed.py` were tested on; pyproject.toml's
# `deepspeed` extra states the same range.
DEEPSPEED_RANGE = ("0.19.0", "0.20.0")


def _installed_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError as err:
        raise RuntimeError(f"{package} is not installed.") from err


def require_tested(package: str, tested: tuple[str, str], *, patch: str, version: str | None = None) -> None:
    """Refuse to apply ``patch`` (a change to ``package``'s private parts) outside the ``tested`` [low, high) range.

    ``version``: the release to check (default: the installed one). RuntimeError names the release, the
    tested range and the fix.
    """
    from packaging.version import Version

    found = version if version is not None else _installed_version(package)
    lo, hi = tested
    if not Version(lo) <= Version(found) < Version(hi):
        raise RuntimeError(
            f"lightning-dist's {patch} reaches into private parts of {package} and was tested with"
            f" {package}>={lo},<{hi}; found {package} {found}. Install a tested release:"
            f" pip install '{package}>={lo},<{hi}'."
        )


def require_tested_deepspeed(patch: str, *, version: str | None = None) -> None:
    """:func:`require_tested` for DeepSpeed (:data:`DEEPSPEED_RANGE`)."""
    require_tested("deepspeed", DEEPSPEED_RANGE, patch=patch, version=version)


def require_tested_lightning(patch: str, *, version: str | None = None) -> None:
    """:func:`require_tested` for Lightning (:data:`LIGHTNING_RANGE`)."""
    require_tested("lightning", LIGHTNING_RANGE, patch=patch, version=version)


# torchft releases the fault-tolerant replica groups were tested on (_integrations/torchft.py); pyproject.toml's
# `fault-tolerance` extra states the same range. torchft marks its API as still changing between releases.
TORCHFT_RANGE = ("0.2.0", "0.3.0")


def torchft_available() -> bool:
    return module_available("torchft")


def require_torchft(*, version: str | None = None) -> None:
    """ImportError with the install command when torchft is missing; RuntimeError outside :data:`TORCHFT_RANGE`."""
    if version is None and not torchft_available():
        raise ImportError(
            "fault_tolerance= needs torchft (its Manager, lighthouse and process groups): pip install"
            f" 'lightning-dist[fault-tolerance]' (or 'torchft>={TORCHFT_RANGE[0]},<{TORCHFT_RANGE[1]}')."
        )
    require_tested("torchft", TORCHFT_RANGE, patch="fault tolerance (replica groups)", version=version)


@lru_cache(maxsize=1)
def async_io_available() -> bool:
    """True when DeepSpeed's async_io op (NVMe offload) can be built or loaded here (libaio present); no compilation."""
    if not deepspeed_available():
        return False
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    # the builder test-links a call to io_submit against -laio (about a second, once per process)
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def numpy_available() -> bool:
    return module_available("numpy")


def matplotlib_available() -> bool:
    return module_available("matplotlib")


# DCP reads a HuggingFace safetensors folder slice by slice (`HuggingFaceStorageReader`) from torch 2.8 on.
HAS_DCP_HF_READER = compare_version("torch", lambda a, b: a >= b, "2.8.0") and module_available("safetensors")


# torch's fake process-group backend ("fake": every collective returns at once, nothing is sent) is built
# into init_process_group from torch 2.11 on (Backend.FAKE); its store lives in a private testing module.
HAS_FAKE_PROCESS_GROUP = hasattr(torch.distributed, "Backend") and hasattr(torch.distributed.Backend, "FAKE")


def init_fake_process_group(*, rank: int, world_size: int) -> None:
    """Start torch's fake process group as ``rank`` of ``world_size`` (the dry run; no communication)."""
    import torch.distributed as dist

    if not HAS_FAKE_PROCESS_GROUP:
        raise ImportError(
            f"The dry run needs torch's fake process-group backend (torch>=2.11); found {torch.__version__}."
        )
    # importing the module registers the backend and its store; init_process_group("fake") does the same
    # import itself when no store is given, so this is the one place the private path is named
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def slice_flattened(device_mesh: Any, names: tuple[str, ...]) -> Any:
    """``device_mesh[names]`` where some names are flattened dims (HSDP over ``dp_replicate`` x ``dp_shard_cp``).

    torch 2.11-2.14 slice a flattened dim from the root mesh with a warning that this will be deprecated; torchtitan
    builds the same 2-D mesh this way. Once torch refuses it, unflatten ``dp_cp`` instead (one place to change).
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return device_mesh[names]


def all_to_all_autograd(input: Any, group: Any) -> Any:
    """``all_to_all_single`` (equal splits) that backpropagates: the reverse all-to-all in backward. torch's
    functional collective ``all_to_all_single_autograd`` (torch 2.11 ... 2.14; ``torch.distributed.nn.functional``'s
    older one warns that it is deprecated)."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(input, None, None, group)
    return funcol.wait_tensor(out)


@lru_cache(maxsize=None)
def grouped_mm_refusal(dtype: torch.dtype, device_type: str) -> str | None:
    """Why torch's ``F.grouped_mm`` cannot run `dtype` on `device_type` (None: it runs a two-group product forward and
    backward there). Probed, not version-compared: its dtypes and devices differ by release and GPU (float64 is
    refused everywhere in 2.11-2.14; CPU serves float32 there)."""
    import torch.nn.functional as F

    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    try:
        x = torch.ones(4, 8, dtype=dtype, device=device_type, requires_grad=True)
        w = torch.ones(2, 8, 8, dtype=dtype, device=device_type, requires_grad=True)
        out = F.grouped_mm(x, w, offs=torch.tensor([2, 4], dtype=torch.int32, device=device_type))
        out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


@lru_cache(maxsize=None)
def hf_mask_builder_reports_mask() -> bool:
    """transformers' SDPA mask builder takes ``q_length``, ``local_size`` and ``use_vmap`` (5.x): context parallelism's
    mask builder reads them to refuse a window shorter than the sequence and the model's own mask terms
    (parallelize/cp.py)."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    return {"q_length", "local_size", "use_vmap"} <= set(inspect.signature(sdpa_mask).parameters)


@lru_cache(maxsize=None)
def dcp_async_staging() -> bool:
    """True when DCP can make an async save's staging copy in the background (checkpoint_async.py).

    ``DefaultStager(StagingOptions(use_async_staging=True))`` copies the state on a thread of its own, and
    ``async_save`` then returns an ``AsyncSaveResponse`` whose ``staging_completion`` says when the copy is done;
    training waits for it before the next optimizer step changes the state. Probed, not version-compared: run on
    torch 2.13; the pre-2.13 ``DefaultStager`` (the single-use one above) was read, not run: the same threaded
    ``_stage`` and ``AsyncSaveResponse``. Without them a save stages on the calling thread, as before.
    """
    import dataclasses

    from torch.distributed.checkpoint import staging, state_dict_saver

    options = getattr(staging, "StagingOptions", None)
    return (
        options is not None
        and "use_async_staging" in {f.name for f in dataclasses.fields(options)}
        and hasattr(state_dict_saver, "AsyncSaveResponse")
    )
