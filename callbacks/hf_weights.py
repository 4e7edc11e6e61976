"""HFPretrained: start a fit from a HuggingFace safetensors folder, and optionally export the result as one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dist.hf import load_hf_weights, restore_buffers, save_buffers, save_hf_pretrained


class HFPretrained(Callback):
    """Load the HuggingFace model inside the LightningModule from `path` once the strategy has sharded it.

    Build the model under :func:`lightning_dist.hf.init_empty_weights` (parameters on the meta device,
    buffers real): the strategy shards and materializes the parameters, this callback puts back the buffers
    materialization wiped and fills every parameter from the folder, each rank reading only its slices
    (``on_fit_start``, after the strategy's set-up and before a ``ckpt_path`` resume, which then wins).
    `export_to`: a new folder to write the trained model to at the end of the fit (``from_pretrained`` loads it).

    Example::

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        Trainer(strategy="tp", callbacks=[HFPretrained(folder, export_to="out/")]).fit(Wrapper(model))
    """

    def __init__(
        self, path: Union[str, os.PathLike], *, export_to: Optional[Union[str, os.PathLike]] = None, strict: bool = True
    ) -> None:
        self.path = Path(path)
        """The safetensors folder to start from."""
        self.export_to = None if export_to is None else Path(export_to)
        """A new folder written at the end of the fit, or None."""
        self.strict = strict
        """Refuse a folder whose tensors do not match the model's parameters one to one."""
        self.loaded: list[str] = []
        """Names of the tensors loaded (relative to the HuggingFace model)."""
        self._buffers: dict = {}

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.path.is_dir():
            raise FileNotFoundError(f"HFPretrained: {str(self.path)!r} is not a folder (save_pretrained output).")
        if self.export_to is not None and self.export_to.exists():
            raise FileExistsError(f"HFPretrained: export_to={str(self.export_to)!r} exists; name a new folder.")
        self._buffers = save_buffers(pl_module)  # before the strategy materializes (to_empty) the model

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        restore_buffers(pl_module, self._buffers)
        self.loaded = load_hf_weights(pl_module, self.path, strict=self.strict)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.export_to is not None:
            save_hf_pretrained(pl_module, self.export_to)
