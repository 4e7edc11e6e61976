"""Train any HuggingFace causal language model (tiny config, random init or a pretrained folder) with the pack.

    python examples/hf/train.py fit --config examples/hf/tp.yaml

``model.model_type`` and ``model.config`` name any ``AutoModelForCausalLM`` architecture and its sizes
(nothing is downloaded); ``model.pretrained`` starts from a ``save_pretrained`` folder instead, loaded
straight into the shards (``lightning_dist.callbacks.HFPretrained``), and ``model.export_to`` writes the
trained model back as one. The vocabulary size comes from the data module (the character corpus).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_dist  # noqa: F401  (importing the pack registers its strategy names)
from lightning_dist.callbacks import HFPretrained
from lightning_dist.hf import init_empty_weights
from lightning_dist.lightning_cli import example_cli
from lightning_dist.models import CharDataModule


class CausalLM(LightningModule):
    """Next-token cross-entropy on any ``AutoModelForCausalLM`` (kept as ``self.model``).

    Args:
        model_type: a transformers architecture name (``llama``, ``qwen2``, ``gpt2``, ``gpt_neox``...).
        config: its config's fields (sizes); ``vocab_size`` is set from the data.
        vocab_size: linked from the data module.
        pretrained: a ``save_pretrained`` folder to start from (then `model_type`/`config` are read from it).
        export_to: a new folder to write the trained model to.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        model_type: str = "llama",
        config: Optional[dict[str, Any]] = None,
        vocab_size: int = 64,
        pretrained: Optional[str] = None,
        export_to: Optional[str] = None,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        import transformers as tf

        self.save_hyperparameters()
        if pretrained is not None:
            cfg = tf.AutoConfig.from_pretrained(pretrained)
            with init_empty_weights():  # parameters on meta: the strategy materializes shards, HFPretrained fills them
                self.model = tf.AutoModelForCausalLM.from_config(cfg)
        else:
            cfg = tf.AutoConfig.for_model(model_type, **{**(config or {}), "vocab_size": vocab_size})
            self.model = tf.AutoModelForCausalLM.from_config(cfg)

    def configure_callbacks(self):
        if self.hparams.pretrained is None:
            return []
        return [HFPretrained(self.hparams.pretrained, export_to=self.hparams.export_to)]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, target = batch
        loss = F.cross_entropy(self.model(idx).logits.flatten(0, 1), target.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, target = batch
        self.log("val_loss", F.cross_entropy(self.model(idx).logits.flatten(0, 1), target.flatten()), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class CausalLMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it."""
    return example_cli(CausalLM, CharDataModule, args, cli_class=CausalLMCLI)


if __name__ == "__main__":
    main()
