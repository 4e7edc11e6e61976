"""lightning-dist: distributed-training strategies and callbacks for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hsdp")`` and
LightningCLI configs can name them, and makes the Trainer's default progress bar the configured Rich bar of
:mod:`lightning_dist.progress`.
"""

from lightning_dist._compat import check_versions

check_versions()  # before anything touches FSDP2 / DTensor: a clear message instead of an AttributeError

from lightning_dist._integrations.lightning import use_default_progress_bar  # noqa: E402
from lightning_dist.mesh import DIM_NAMES, DistMesh, MeshSpec  # noqa: E402
from lightning_dist.progress import RunProgressBar  # noqa: E402
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
use_default_progress_bar(RunProgressBar)  # Lightning's Rich bar without "Epoch 0/-2" and "v_num"

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
