"""Train a shape classifier (BatchNorm CNN by default, or the small ViT) with any strategy.

    python examples/vision/train.py fit --config examples/configs/ddp_cnn.yaml

Pick the network in YAML under ``model.model`` (``class_path: lightning_dist.models.ViT`` with its
``init_args``; keep its ``image_size`` equal to ``data.image_size``) and the strategy under
``trainer.strategy`` (a registered name such as ``ddp`` or one of the pack's).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_dist  # noqa: F401  (importing the pack registers its strategy names)
from lightning_dist.lightning_cli import example_cli
from lightning_dist.models import ShapesClassifier, ShapesDataModule


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (its ``trainer`` and ``model``)."""
    return example_cli(ShapesClassifier, ShapesDataModule, args)


if __name__ == "__main__":
    main()
