"""Train the pack's mixture-of-experts GPT on the generated character corpus with any strategy.

    python examples/moe/train.py fit --config examples/configs/moe_ep.yaml

The model is :class:`~lightning_dist.models.CharMoEGPT` (``model.n_experts``, ``model.top_k``, ``model.router``,
``model.aux_loss_coef``...); as in ``examples/gpt/train.py``, ``data.block_size`` sets the sequence length and the
vocabulary size comes from the data module.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_dist  # noqa: F401  (importing the pack registers its strategy names)
from lightning_dist.lightning_cli import char_cli
from lightning_dist.models import CharMoEGPT


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (its ``trainer`` and ``model``)."""
    return char_cli(CharMoEGPT, args)


if __name__ == "__main__":
    main()
