"""Train the pack's mixture-of-experts GPT on the generated character corpus with any strategy.

    python examples/moe/train.py fit --config examples/configs/moe_ep.yaml

The model is :class:`~lightning_dist.models.CharMoEGPT` (``model.n_experts``, ``model.top_k``, ``model.router``,
``model.aux_loss_coef``...); as in ``examples/gpt/train.py``, ``data.block_size`` sets the sequence length and the
vocabulary size comes from the data module.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_dist  # noqa: F401  (importing the pack registers its strategy names)
from lightning_dist.lightning_cli import SuggestingArgumentParser
from lightning_dist.models import CharDataModule, CharMoEGPT


class CharMoEGPTCLI(LightningCLI):
    """LightningCLI for :class:`CharMoEGPT`: sequence length and vocabulary size come from the data module."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (its ``trainer`` and ``model``)."""
    return CharMoEGPTCLI(
        CharMoEGPT,
        CharDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_class=SuggestingArgumentParser,
        args=args,
    )


if __name__ == "__main__":
    main()
