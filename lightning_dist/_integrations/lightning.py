"""Lightning: each change to (or reach into) its private parts, as one small named function.

* :func:`set_module_device_mesh`: the mesh behind ``LightningModule.device_mesh`` (its private ``_device_mesh``);
* :func:`route_gradient_clipping`: a strategy's own clipping (by norm, by value) in place of the precision plugin's;
* :func:`wrap_strategy_methods` / :func:`unwrap_strategy_methods`: a callback's wrappers around one strategy
  instance's ``process_dataloader`` and step methods, and their removal;
* :data:`SubprocessScriptLauncher` and :func:`replace_default_launcher`: the pack's launcher in place of
  Lightning's (its base class is private);
* :func:`hand_over_strategy`: another strategy in place of the trainer's, with what Lightning set on the first
  (``strategy="auto_parallel"`` hands the run to the strategy it picks at setup);
* :func:`distributed_sampler_for_stateful_loaders`: torchdata's ``StatefulDataLoader(shuffle=True)`` gets
  Lightning's plain ``DistributedSampler``, as a ``DataLoader`` does;
* :func:`use_default_progress_bar`: the pack's configured Rich bar as the Trainer's default progress bar;
* :func:`explain_unknown_strategy`: Lightning's "invalid strategy name" error replaced by one that names the
  closest registered names;
* the private Lightning helpers the pack calls because there is no public one (process-group start,
  ``sync_dist`` reduction, optimizer-state moves, thread setup), imported here under their own names so
  that every reach into Lightning's private modules is listed in this file.

Each refuses a Lightning release outside :data:`lightning_dist._compat.LIGHTNING_RANGE`
(:func:`~lightning_dist._compat.require_tested_lightning`); tests: ``tests/unit/test_integrations.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Lightning's private helpers, called as Lightning's own strategies call them (no public equivalent); public
# names here, so the package imports them from this one module
from lightning.fabric.strategies.launchers.subprocess_script import (
    _set_num_threads_if_needed as set_num_threads_if_needed,
)
from lightning.fabric.utilities.data import _set_sampler_epoch as set_sampler_epoch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized as distributed_is_initialized,
)
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_process_group_backend_for_device,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device

# Lightning's script launcher (re-runs the command per rank); the pack's JobLauncher extends it
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

from lightning_dist._compat import require_tested_lightning

__all__ = [
    "SubprocessScriptLauncher",
    "default_process_group_backend_for_device",
    "distributed_is_initialized",
    "init_dist_connection",
    "optimizers_to_device",
    "set_num_threads_if_needed",
    "set_sampler_epoch",
    "sync_ddp_if_available",
    "distributed_sampler_for_stateful_loaders",
    "hand_over_strategy",
    "replace_default_launcher",
    "route_gradient_clipping",
    "set_module_device_mesh",
    "unwrap_strategy_methods",
    "use_default_progress_bar",
    "explain_unknown_strategy",
    "wrap_strategy_methods",
]


def set_module_device_mesh(module: Any, device_mesh: Any) -> None:
    """Make ``module.device_mesh`` (Lightning's read-only property) return ``device_mesh``.

    Reason: the property reads the private ``_device_mesh``, which only Lightning's own ModelParallelStrategy
    sets; there is no public setter.
    """
    require_tested_lightning("LightningModule._device_mesh write (set_module_device_mesh)")
    module._device_mesh = device_mesh


def route_gradient_clipping(
    precision_plugin: Any, *, by_norm: Callable[[Any, float], None], by_value: Callable[[Any, float], None]
) -> None:
    """Make ``precision_plugin.clip_gradients(optimizer, clip_val, algorithm)`` call ``by_norm`` or ``by_value``
    (Lightning's base ``Precision.clip_gradients`` dispatch), on this instance only.

    Reason: Lightning clips with torch's ``clip_grad_norm_``/``clip_grad_value_`` over each process's
    gradients (``Precision`` has no process group) and gives a strategy no hook for it: a norm must span
    every stage and shard, and those foreach calls refuse a mix of plain tensors and DTensors (tensor
    parallelism). ``DeepSpeedPrecision.clip_gradients`` does nothing at all (DeepSpeed clips in its step
    by the configured value), so ``self.clip_gradients`` in manual optimization would silently not clip:
    there the base class's dispatch is put back.
    ``clip_gradients`` serves ``Trainer(gradient_clip_val=...)`` and ``LightningModule.clip_gradients``.
    """
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, Precision

    require_tested_lightning("Precision.clip_gradients/by_norm/by_value replacement (route_gradient_clipping)")
    if isinstance(precision_plugin, DeepSpeedPrecision):  # others dispatch themselves (AMP checks its scaler first)
        precision_plugin.clip_gradients = Precision.clip_gradients.__get__(precision_plugin)
    precision_plugin.clip_grad_by_norm = by_norm
    precision_plugin.clip_grad_by_value = by_value


def wrap_strategy_methods(strategy: Any, wrappers: Mapping[str, Callable[[Callable], Callable]]) -> None:
    """Replace each ``strategy.<name>`` by ``wrapper(original)``, on this instance only.

    Reason: ``Strategy.process_dataloader`` is Lightning's designated point to change a loader after the
    sampler injection, but only a strategy subclass can override it; a callback wraps the instance's method.
    """
    require_tested_lightning("Strategy method wrappers (wrap_strategy_methods)")
    for name, wrap in wrappers.items():
        setattr(strategy, name, wrap(getattr(strategy, name)))


def unwrap_strategy_methods(strategy: Any, names: Iterable[str]) -> None:
    """Undo :func:`wrap_strategy_methods`: drop the instance attributes, so the class methods are back."""
    for name in names:
        if name in vars(strategy):
            delattr(strategy, name)


def replace_default_launcher(strategy: Any, make_launcher: Callable[[], Any]) -> None:
    """Put ``make_launcher()`` in place of the strategy's launcher when it is Lightning's default script launcher.

    Reason: Lightning's strategies pick their launcher in the private ``_configure_launcher`` into the private
    ``_launcher``; the pack's launcher ends every rank when one fails (no rank outlives the job).
    """
    require_tested_lightning("Strategy._launcher replacement (replace_default_launcher)")
    if type(strategy._launcher) is SubprocessScriptLauncher:
        strategy._launcher = make_launcher()


def hand_over_strategy(trainer: Any, current: Any, successor: Any) -> None:
    """Make `successor` the trainer's strategy in place of `current`, with everything Lightning's accelerator
    connector and Trainer set on `current` before its ``setup_environment``: accelerator, precision plugin,
    cluster environment, devices, node count, checkpoint IO and layer-sync plugins, the launcher that started
    this process, and the LightningModule.

    Reason: ``Trainer.strategy`` is the private ``_accelerator_connector.strategy`` (no setter); the connector
    fills the plugins in through the strategy's public setters and the private ``_layer_sync``,
    ``_checkpoint_io`` and ``_launcher``. Every later use reads ``trainer.strategy`` afresh (``Trainer._run``
    calls ``trainer.strategy.setup(...)``, the loops its step methods, teardown its ``teardown``), so from
    ``setup_environment`` on the run is `successor`'s alone.
    """
    require_tested_lightning("Trainer strategy hand-over (hand_over_strategy)")
    if trainer._accelerator_connector.strategy is not current:
        raise RuntimeError(f"{type(current).__name__} is not this trainer's strategy; it cannot hand the run over.")
    successor.accelerator = current.accelerator
    successor.precision_plugin = current.precision_plugin
    successor.cluster_environment = current.cluster_environment
    successor.parallel_devices = current.parallel_devices
    successor.num_nodes = current.num_nodes
    successor._checkpoint_io = current._checkpoint_io  # a CheckpointIO plugin of the Trainer (None: the default)
    successor._layer_sync = current._layer_sync  # Trainer(sync_batchnorm=True)
    successor._launcher = current._launcher  # it already started the processes
    successor.connect(current.lightning_module)
    trainer._accelerator_connector.strategy = successor


def distributed_sampler_for_stateful_loaders() -> None:
    """Make Lightning inject its plain ``DistributedSampler`` into torchdata's ``StatefulDataLoader(shuffle=True)``
    (once per process; nothing without torchdata).

    Reason: Lightning's private ``data_connector._get_distributed_sampler`` builds a ``DistributedSampler`` only
    when ``loader.sampler`` is torch's ``RandomSampler``/``SequentialSampler``. For ``shuffle=True`` torchdata's
    loader holds its own (stateful) ``RandomSampler``, which Lightning wraps in ``DistributedSamplerWrapper``: the
    order then follows that sampler's generator, seeded from the torch RNG when the loader is built and saved
    nowhere (the wrapper has no state), so a resumed run shuffles differently. Treated as torch's sampler, the
    order depends only on Lightning's seed and the epoch, and the loader's own state_dict resumes it exactly.
    """
    from lightning_dist._compat import module_available

    if not module_available("torchdata"):
        return
    require_tested_lightning("data_connector._get_distributed_sampler (distributed_sampler_for_stateful_loaders)")
    from lightning.pytorch.trainer.connectors import data_connector
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    original = data_connector._get_distributed_sampler
    if getattr(original, "_lightning_dist_patch", False):
        return

    def get_distributed_sampler(
        dataloader: Any, shuffle: bool, overfit_batches: Any, mode: Any = None, **kwargs: Any
    ) -> Any:
        if mode != RunningStage.PREDICTING and isinstance(getattr(dataloader, "sampler", None), StatefulRandomSampler):
            # Lightning's own branch for torch's RandomSampler (same seed and shuffle rule)
            kwargs["shuffle"] = shuffle and not overfit_batches
            kwargs.setdefault("seed", int(os.getenv("PL_GLOBAL_SEED", 0)))
            return DistributedSampler(dataloader.dataset, **kwargs)
        return original(dataloader, shuffle, overfit_batches, mode, **kwargs)

    get_distributed_sampler._lightning_dist_patch = True  # type: ignore[attr-defined]
    get_distributed_sampler.__wrapped__ = original  # type: ignore[attr-defined]
    data_connector._get_distributed_sampler = get_distributed_sampler


def use_default_progress_bar(bar_class: type) -> None:
    """Make ``bar_class`` (a ``RichProgressBar`` subclass) the bar a Trainer adds when none is given.

    Reason: the Trainer builds its default bar as ``RichProgressBar()`` from a name of its private
    ``callback_connector`` module whenever ``rich`` is installed (the pack depends on it), and that bar labels a
    ``max_steps`` run ``Epoch 0/-2``; there is no setting for the default bar. A bar the user passes is kept.
    """
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.trainer.connectors import callback_connector

    require_tested_lightning("callback_connector.RichProgressBar (use_default_progress_bar)")
    if not issubclass(bar_class, RichProgressBar):
        raise TypeError(f"{bar_class.__name__} must subclass RichProgressBar (the Trainer builds it with no argument).")
    callback_connector.RichProgressBar = bar_class


def explain_unknown_strategy(explain: Callable[[str], str]) -> None:
    """Make ``Trainer(strategy=<unknown name>)`` raise ``ValueError(explain(name))`` (once per process).

    Reason: the accelerator connector (private) checks the name against ``StrategyRegistry`` in
    ``_check_config_and_set_final_flags`` and raises a fixed message listing four of Lightning's names; a
    registry cannot add to it. The wrapper re-raises Lightning's error with ``explain(name)`` first.
    """
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    require_tested_lightning("_AcceleratorConnector._check_config_and_set_final_flags (explain_unknown_strategy)")
    original = _AcceleratorConnector._check_config_and_set_final_flags
    if getattr(original, "_lightning_dist_patch", False):
        return

    def check_config_and_set_final_flags(self: Any, strategy: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, strategy, *args, **kwargs)
        except ValueError as err:
            name = strategy.lower() if isinstance(strategy, str) else None
            if name is None or name == "auto" or name in StrategyRegistry:
                raise
            raise ValueError(explain(name)) from err

    check_config_and_set_final_flags._lightning_dist_patch = True  # type: ignore[attr-defined]
    check_config_and_set_final_flags.__wrapped__ = original  # type: ignore[attr-defined]
    _AcceleratorConnector._check_config_and_set_final_flags = check_config_and_set_final_flags
