"""lightning-dist: distributed-training strategies and callbacks for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hsdp")`` and
LightningCLI configs can name them, and makes the Trainer's default progress bar the configured Rich bar of
:mod:`lightning_dist.progress`.
"""

from lightning_dist._compat import LIGHTNING_IMPORTABLE, check_versions

check_versions()  # before anything touches FSDP2 / DTensor: a clear message instead of an AttributeError

from lightning_dist.mesh import DIM_NAMES, DistMesh, MeshSpec  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DIM_NAMES",
    "DistMesh",
    "MeshSpec",
    "MeshStrategy",
    "HybridShardStrategy",
    "FullyShardStrategy",
    "TensorParallelStrategy",
    "PipelineStrategy",
    "OffloadStrategy",
    "REGISTERED",
    "RunProgressBar",
    "register_strategies",
]
_NEEDS_LIGHTNING = frozenset(__all__) - {"DIM_NAMES", "DistMesh", "MeshSpec"}

if LIGHTNING_IMPORTABLE:
    from lightning_dist._integrations.lightning import use_default_progress_bar
    from lightning_dist.progress import RunProgressBar
    from lightning_dist.strategies import (
        REGISTERED,
        FullyShardStrategy,
        HybridShardStrategy,
        MeshStrategy,
        OffloadStrategy,
        PipelineStrategy,
        TensorParallelStrategy,
        register_strategies,
    )

    register_strategies()
    use_default_progress_bar(RunProgressBar)  # Lightning's Rich bar without "Epoch 0/-2" and "v_num"
else:  # the Lightning-free parts (mesh, parallelize, planner) stay usable

    def __getattr__(name: str):
        if name in _NEEDS_LIGHTNING:
            raise ImportError(f"lightning_dist.{name} needs Lightning, which is not installed: pip install lightning")
        raise AttributeError(f"module 'lightning_dist' has no attribute {name!r}")
