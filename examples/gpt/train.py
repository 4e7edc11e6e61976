"""Train the character-level GPT on the generated corpus with any strategy.

    python examples/gpt/train.py fit --config examples/configs/<file>.yaml

``data.block_size`` sets the sequence length and is linked to the model's ``block_size``; the
vocabulary size comes from the data module.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_dist  # noqa: F401  (importing the pack registers its strategy names)
from lightning_dist.lightning_cli import SuggestingArgumentParser
from lightning_dist.models import CharDataModule, CharGPT


class CharGPTCLI(LightningCLI):
    """LightningCLI for :class:`CharGPT`: sequence length and vocabulary size come from the data module."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # one source of truth for sizes the data fixes
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (its ``trainer`` and ``model``)."""
    return CharGPTCLI(
        CharGPT,
        CharDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_class=SuggestingArgumentParser,  # a misspelt config key: the closest one, said first
        args=args,
    )


if __name__ == "__main__":
    main()
