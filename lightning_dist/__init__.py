"""lightning-dist: distributed-training strategies and callbacks for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hsdp")`` and
LightningCLI configs can name them.
"""

from lightning_dist._compat import check_versions

check_versions()  # before anything touches FSDP2 / DTensor: a clear message instead of an AttributeError

from lightning_dist.mesh import DIM_NAMES, DistMesh, MeshSpec  # noqa: E402
from lightning_dist.strategies import (  # noqa: E402
    REGISTERED,
    FullyShardStrategy,
    HybridShardStrategy,
    MeshStrategy,
    OffloadStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    register_strategies,
)

__version__ = "0.1.0"

register_strategies()

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
    "register_strategies",
]
