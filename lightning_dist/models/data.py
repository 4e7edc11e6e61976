"""Example data generated in-process (no download): shape images and a character corpus.

Both data modules are deterministic functions of their ``seed``: every rank of a distributed job builds
the same tensors, so Lightning's ``DistributedSampler`` (or the pack's sampler over the ``dp`` mesh)
splits one dataset consistently.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

SHAPE_CLASSES = ("disk", "square", "triangle")


def _check_positive(**values: int) -> None:
    bad = [f"{name}={value!r}" for name, value in values.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"Expected positive integers, got {', '.join(bad)}. Pass values >= 1.")


def make_shapes(n: int, *, image_size: int = 32, seed: int = 0, noise: float = 0.15) -> tuple[Tensor, Tensor]:
    """Generate ``n`` grayscale images of a filled disk / square / triangle with Gaussian noise.

    Returns ``(images, labels)``: images ``float32 [n, 1, image_size, image_size]`` (roughly zero-mean),
    labels ``int64 [n]`` with 0 = disk, 1 = square, 2 = triangle (balanced round-robin). Position, size,
    rotation and brightness are random; the result depends only on the arguments.
    """
    _check_positive(n=n, image_size=image_size)
    if image_size < 8:
        raise ValueError(f"image_size={image_size} is too small to draw shapes; use image_size >= 8.")
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % len(SHAPE_CLASSES)
    labels = labels[torch.randperm(n, generator=g)]

    def uniform(lo: float, hi: float) -> Tensor:
        return lo + (hi - lo) * torch.rand(n, 1, 1, generator=g)

    # pixel-centre coordinates in [-1, 1]
    axis = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size * 2 - 1
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    size = uniform(0.35, 0.6)  # circumradius, so all three shapes have comparable extent
    cx, cy = uniform(-0.3, 0.3), uniform(-0.3, 0.3)
    angle = uniform(0.0, 2 * math.pi)
    brightness = uniform(0.6, 1.0)
    dx, dy = xx - cx, yy - cy
    # rotate the sample grid by -angle, so the shape is rotated by +angle
    rx = dx * torch.cos(angle) + dy * torch.sin(angle)
    ry = -dx * torch.sin(angle) + dy * torch.cos(angle)

    disk = dx.pow(2) + dy.pow(2) <= size.pow(2)
    half = size / math.sqrt(2)
    square = (rx.abs() <= half) & (ry.abs() <= half)
    # equilateral triangle = intersection of 3 half-planes at distance size/2 from the centre
    triangle = torch.ones_like(square)
    for k in range(3):
        theta = 2 * math.pi * k / 3 + math.pi / 2
        triangle &= rx * math.cos(theta) + ry * math.sin(theta) <= size / 2

    lab = labels.view(n, 1, 1)
    mask = torch.where(lab == 0, disk, torch.where(lab == 1, square, triangle))
    images = mask.float() * brightness + noise * torch.randn(n, image_size, image_size, generator=g)
    images = images - 0.25  # roughly centre the pixel values
    return images.unsqueeze(1), labels


class _SplitDataModule(LightningDataModule):
    """Loaders over ``self.train_set`` / ``self.val_set`` (built in ``setup``), shared by the data modules below."""

    train_set: Dataset | None
    val_set: Dataset | None
    batch_size: int
    num_workers: int

    @override
    def train_dataloader(self) -> DataLoader:
        # drop_last keeps every step's batch full, which pipeline micro-batching relies on
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    @override
    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class ShapesDataModule(_SplitDataModule):
    """Synthetic shape classification (disk / square / triangle), generated in-process.

    Args:
        n_train: Number of training images.
        n_val: Number of validation images.
        image_size: Height and width in pixels (single channel).
        batch_size: Per-process batch size.
        seed: Seed of the generator; validation uses ``seed + 1`` so the two sets differ.
        num_workers: DataLoader worker processes.
        noise: Standard deviation of the additive Gaussian pixel noise.
    """

    num_classes = len(SHAPE_CLASSES)

    def __init__(
        self,
        *,
        n_train: int = 2048,
        n_val: int = 256,
        image_size: int = 32,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        noise: float = 0.15,
    ) -> None:
        super().__init__()
        _check_positive(n_train=n_train, n_val=n_val, image_size=image_size, batch_size=batch_size)
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0.")
        self.save_hyperparameters()
        self.n_train, self.n_val, self.image_size = n_train, n_val, image_size
        self.batch_size, self.seed, self.num_workers, self.noise = batch_size, seed, num_workers, noise
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set = TensorDataset(
                *make_shapes(self.n_train, image_size=self.image_size, seed=self.seed, noise=self.noise)
            )
            self.val_set = TensorDataset(
                *make_shapes(self.n_val, image_size=self.image_size, seed=self.seed + 1, noise=self.noise)
            )


# Character corpus -------------------------------------------------------------------------------------

CHAR_VOCAB = "\n !,.?abcdefghijklmnopqrstuvwxyz"
"""The fixed alphabet of :func:`make_corpus`; token id = index in this string."""
CHAR_VOCAB_SIZE = len(CHAR_VOCAB)

_WORDS = {
    "det": ["the", "a", "every", "one", "that", "no"],
    "adj": ["small", "quiet", "bright", "old", "green", "heavy", "quick", "lazy", "clever", "broken", "warm", "silver"],
    "noun": [
        "cat",
        "river",
        "engine",
        "garden",
        "teacher",
        "window",
        "lantern",
        "fox",
        "machine",
        "village",
        "tree",
        "student",
        "ship",
        "mountain",
        "letter",
        "clock",
    ],
    "verb": [
        "sees",
        "builds",
        "follows",
        "carries",
        "paints",
        "watches",
        "finds",
        "opens",
        "remembers",
        "moves",
        "counts",
        "hears",
    ],
    "adv": ["slowly", "today", "again", "quietly", "at night", "in the rain", "with care", "before dawn"],
    "conj": ["and", "but", "while", "because"],
}


def make_corpus(n_chars: int, *, seed: int = 0) -> str:
    """Generate ``n_chars`` characters of English-like text from a small random grammar.

    Deterministic in ``seed`` and license-free (it is generated). Uses only :data:`CHAR_VOCAB`; words,
    spelling and sentence structure repeat, so a character model's loss falls well below ``ln(32)``.
    """
    _check_positive(n_chars=n_chars)
    g = torch.Generator().manual_seed(seed)

    def pick(kind: str) -> str:
        words = _WORDS[kind]
        return words[int(torch.randint(len(words), (1,), generator=g))]

    def chance(p: float) -> bool:
        return bool(torch.rand(1, generator=g) < p)

    def phrase() -> str:
        words = [pick("det")] + ([pick("adj")] if chance(0.5) else []) + [pick("noun")]
        return " ".join(words)

    def clause() -> str:
        return " ".join([phrase(), pick("verb"), phrase()] + ([pick("adv")] if chance(0.4) else []))

    parts: list[str] = []
    total = 0
    while total < n_chars:
        sentence = clause() + (f", {pick('conj')} {clause()}" if chance(0.3) else "")
        sentence += "?" if chance(0.1) else ("!" if chance(0.05) else ".")
        sentence += "\n" if chance(0.2) else " "
        parts.append(sentence)
        total += len(sentence)
    return "".join(parts)[:n_chars]


def encode(text: str) -> Tensor:
    """Token ids (``int64``) of ``text`` over :data:`CHAR_VOCAB`; raises ValueError on other characters."""
    lookup = {c: i for i, c in enumerate(CHAR_VOCAB)}
    unknown = sorted(set(text) - lookup.keys())
    if unknown:
        raise ValueError(
            f"Characters {unknown!r} are not in CHAR_VOCAB={CHAR_VOCAB!r}; lower-case the text or filter them."
        )
    return torch.tensor([lookup[c] for c in text], dtype=torch.long)


def decode(ids: Tensor) -> str:
    """Inverse of :func:`encode`."""
    return "".join(CHAR_VOCAB[i] for i in ids.tolist())


class CharDataModule(_SplitDataModule):
    """Next-character prediction on a generated corpus (:func:`make_corpus`).

    The corpus is split into a training part and a validation tail; each sample is a window of
    ``block_size + 1`` characters (every ``stride`` characters) giving ``(idx, targets)``, both
    ``int64 [block_size]``, targets shifted by one.

    Args:
        n_chars: Corpus length in characters.
        block_size: Sequence length; must not exceed the model's ``block_size``.
        batch_size: Per-process batch size.
        val_fraction: Fraction of the corpus held out (its tail) for validation.
        stride: Distance between window starts; default ``block_size``.
        seed: Corpus seed.
        num_workers: DataLoader worker processes.
    """

    vocab_size = CHAR_VOCAB_SIZE

    def __init__(
        self,
        *,
        n_chars: int = 100_000,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        stride: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _check_positive(n_chars=n_chars, block_size=block_size, batch_size=batch_size, stride=stride or block_size)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1).")
        n_val = int(n_chars * val_fraction)
        if min(n_val, n_chars - n_val) < block_size + 1:
            raise ValueError(
                f"n_chars={n_chars} with val_fraction={val_fraction} leaves a split shorter than block_size + 1 = "
                f"{block_size + 1}; increase n_chars."
            )
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0.")
        self.save_hyperparameters()
        self.n_chars, self.block_size, self.batch_size = n_chars, block_size, batch_size
        self.val_fraction, self.stride, self.seed, self.num_workers = (
            val_fraction,
            stride or block_size,
            seed,
            num_workers,
        )
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _windows(self, ids: Tensor) -> TensorDataset:
        chunks = ids.unfold(0, self.block_size + 1, self.stride)  # [N, block_size + 1]
        return TensorDataset(chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous())

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            ids = encode(make_corpus(self.n_chars, seed=self.seed))
            n_val = int(self.n_chars * self.val_fraction)
            self.train_set = self._windows(ids[: self.n_chars - n_val])
            self.val_set = self._windows(ids[self.n_chars - n_val :])
