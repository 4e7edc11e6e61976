"""Train the character-level GPT on the generated corpus with any strategy.

    python examples/gpt/train.py fit --config examples/configs/<file>.yaml

``data.block_size`` sets the sequence length and is linked to the model's ``block_size``; the
vocabulary size comes from the data module.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_dist  # noqa: F401  (importing the pack registers its strategy names)
from lightning_dist.lightning_cli import char_cli
from lightning_dist.models import CharGPT


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (its ``trainer`` and ``model``)."""
    return char_cli(CharGPT, args)


if __name__ == "__main__":
    main()
