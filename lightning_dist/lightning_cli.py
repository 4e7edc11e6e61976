"""A LightningCLI argument parser that names a misspelt config key, and the closest accepted one, first.

Notes: docs/internals.md, "lightning_dist/lightning_cli.py"."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_dist.models import CharDataModule

__all__ = [
    "CharCLI",
    "SuggestingArgumentParser",
    "char_cli",
    "class_arguments",
    "example_cli",
    "misspelt_key_hint",
]

# a key of the command (YAML or --flag) that no option has; jsonargparse's wording (4.27 to 4.53)
_UNKNOWN_OPTION = re.compile(r"(?:Subcommand '\w+' does not accept option|Option) '(?P<key>[\w.]+)'")
# a key under init_args of a class_path that the class does not take
_UNKNOWN_INIT_ARG = re.compile(
    r"Problem with given class_path '(?P<cls>[\w.]+)':\s*Option '(?P<key>\w+)' is not accepted"
)


def class_arguments(class_path: str) -> list[str]:
    """Keyword arguments ``class_path`` accepts, following ``**kwargs`` into its base classes (as jsonargparse
    does); [] when it cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in inspect.getmro(cls) if inspect.isclass(cls) else ():
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break  # no **kwargs: what the class takes ends here
    return list(dict.fromkeys(names))


def _closest(key: str, candidates: Iterable[str]) -> list[str]:
    candidates = list(candidates)
    close = difflib.get_close_matches(key, candidates, n=2, cutoff=0.6)
    if not close and "." in key:  # a nested key: match its last part among the same parent's options
        parent, _, last = key.rpartition(".")
        siblings = [c.rpartition(".")[2] for c in candidates if c.startswith(parent + ".")]
        close = [f"{parent}.{c}" for c in difflib.get_close_matches(last, siblings, n=2, cutoff=0.6)]
    return close


def misspelt_key_hint(message: str, keys: Iterable[str], command: str = "this command") -> str | None:
    """One line naming the unknown key of a jsonargparse error `message` and the closest accepted ones (among
    `keys`, the arguments of `command`, or a class_path's arguments); None when the message is about something
    else."""
    match = _UNKNOWN_INIT_ARG.search(message)
    if match:
        owner, key, candidates = match["cls"], match["key"], class_arguments(match["cls"])
    else:
        match = _UNKNOWN_OPTION.search(message)
        if match is None:
            return None
        owner, key, candidates = command, match["key"], list(keys)
    close = _closest(key, candidates)
    guess = f": did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else "."
    return f"`{key}` is not an argument of {owner}{guess}"


class SuggestingArgumentParser(LightningArgumentParser):
    """LightningCLI's parser; a misspelt key is reported first, with the closest accepted key, and without the
    usage text (``--help`` prints it)."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser: Any = getattr(ex, "subcommand_parser", None) or self
        command = parser.prog.replace(" [options]", "")  # as jsonargparse prints it in its tip
        hint = misspelt_key_hint(message, (a.dest for a in parser._actions), f"`{command}`")
        if hint is None or not self.exit_on_error:  # parsers nested in a Union raise instead of exiting
            super().error(message, ex)
        sys.stderr.write(f"error: {hint}\n{message}\ntip: `{command} --help` lists every argument.\n")
        self.exit(2)


class CharCLI(LightningCLI):
    """LightningCLI for the character models of ``lightning_dist.models``: sequence length and vocabulary size
    come from the data module."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # one source of truth for sizes the data fixes
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def example_cli(
    model_class: type, datamodule_class: type, args: list[str] | None = None, *, cli_class: type = LightningCLI
) -> LightningCLI:
    """The examples' LightningCLI: seed 0, the saved config overwritten, a misspelt key named with the closest
    accepted one. Runs on ``args`` (default: the command line) and returns the CLI (its ``trainer`` and ``model``)."""
    return cli_class(
        model_class,
        datamodule_class,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_class=SuggestingArgumentParser,
        args=args,
    )


def char_cli(model_class: type, args: list[str] | None = None) -> LightningCLI:
    """:func:`example_cli` of :class:`CharCLI` for ``model_class`` on ``CharDataModule``."""
    return example_cli(model_class, CharDataModule, args, cli_class=CharCLI)
