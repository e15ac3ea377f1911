"""Small Vision Transformers on Fashion-MNIST, with optional stochastic depth.

The ViT is a :class:`Teacher` (patch embedding + [CLS] + positions, L pre-norm layers, final
LayerNorm) plus a linear head on the [CLS] state, so the surrogate machinery reads it like
any other teacher. Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` package
(idx ``.gz`` files under :data:`FASHION_MNIST_DIR`).
"""

from __future__ import annotations

import gzip
import logging
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.surrogate.layers import LayerSpec, Teacher, TransformerLayer

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                       "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
N_CLASSES = 10


def _read_idx(path: Path) -> torch.Tensor:
    """An idx file (gzip) as a uint8 tensor of its declared shape."""
    if not path.is_file():
        raise RdepthError(f"{path} is missing: apt-get install -y dataset-fashion-mnist")
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as exc:
        raise RdepthError(f"{path} is not a readable gzip file ({exc})") from None
    zero, dtype_code, n_dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise RdepthError(f"{path} is not a uint8 idx file")
    shape = struct.unpack(">" + "I" * n_dims, data[4:4 + 4 * n_dims])
    body = data[4 + 4 * n_dims:]
    expected = 1
    for size in shape:
        expected *= size
    if len(body) != expected:
        raise RdepthError(f"{path} holds {len(body)} bytes of data, its header says {expected}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(shape)


def load_fashion_mnist(split: str, directory: Path = FASHION_MNIST_DIR) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, 1, 28, 28) float in [0, 1] normalised to mean 0 / std 1, labels (N,) int64)."""
    if split not in FASHION_MNIST_FILES:
        raise RdepthError(f"split must be one of {sorted(FASHION_MNIST_FILES)}, got {split!r}")
    image_file, label_file = FASHION_MNIST_FILES[split]
    images = _read_idx(directory / image_file).float().div(255.0)
    labels = _read_idx(directory / label_file).long()
    images = (images - 0.2860) / 0.3530  # Fashion-MNIST training-set mean and std
    return images[:, None], labels


@dataclass(frozen=True)
class ViTConfig:
    d_model: int = 64
    n_layers: int = 6
    n_heads: int = 4
    d_ff: int = 128
    patch: int = 7
    image_size: int = 28
    drop_path: float = 0.0  # stochastic depth rate of the last layer (linear from 0 at the first)
    epochs: int = 3
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.05
    n_train: int = 20000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.image_size % self.patch:
            raise RdepthError(f"vit: patch {self.patch} does not divide image_size {self.image_size}")
        if not 0.0 <= self.drop_path < 1.0:
            raise RdepthError(f"vit: drop_path must lie in [0, 1), got {self.drop_path}")
        for name in ("n_layers", "epochs", "batch_size", "n_train"):
            if getattr(self, name) < 1:
                raise RdepthError(f"vit: {name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


class PatchEmbedding(nn.Module):
    """images (B, 1, H, W) -> (B, 1 + patches, D): [CLS] then linear patch embeddings, plus positions."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.patch = config.patch
        n_patches = (config.image_size // config.patch) ** 2
        self.project = nn.Linear(config.patch * config.patch, config.d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, config.d_model))
        self.position = nn.Parameter(torch.randn(1, n_patches + 1, config.d_model) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p)  # (B, 1, H/p, W/p, p, p)
        patches = patches.reshape(images.shape[0], -1, p * p)  # (B, N, p*p)
        tokens = self.project(patches)
        return torch.cat([self.cls.expand(images.shape[0], -1, -1), tokens], 1) + self.position


class ViTClassifier(nn.Module):
    """A :class:`Teacher` backbone and a linear head on the final [CLS] state."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        spec = LayerSpec(d_model=config.d_model, n_heads=config.n_heads, d_ff=config.d_ff, norm_position="pre",
                         causal=False, activation="gelu", norm_eps=1e-6)
        rates = [config.drop_path * i / max(1, config.n_layers - 1) for i in range(config.n_layers)]
        layers = [TransformerLayer(spec, drop_path_rate=rate) for rate in rates]
        self.backbone = Teacher(PatchEmbedding(config), layers, nn.LayerNorm(config.d_model, eps=1e-6), spec, "vit")
        self.head = nn.Linear(config.d_model, N_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images)[:, 0])


def train_vit(config: ViTConfig, images: torch.Tensor, labels: torch.Tensor) -> tuple[ViTClassifier, dict]:
    """Train with AdamW + cosine schedule on the first ``n_train`` images; returns (model, log)."""
    torch.manual_seed(config.seed)
    model = ViTClassifier(config)
    images, labels = images[: config.n_train], labels[: config.n_train]
    steps_per_epoch = (len(images) + config.batch_size - 1) // config.batch_size
    total = steps_per_epoch * config.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=total, pct_start=0.1)
    generator = torch.Generator().manual_seed(config.seed)
    started = time.perf_counter()
    model.train()
    losses = []
    bar = tqdm(total=total, desc=f"vit sd={config.drop_path} seed={config.seed}", leave=False)
    for _ in range(config.epochs):
        order = torch.randperm(len(images), generator=generator)
        for begin in range(0, len(images), config.batch_size):
            index = order[begin:begin + config.batch_size]
            loss = nn.functional.cross_entropy(model(images[index]), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    model.backbone.requires_grad_(False)
    return model, {"steps": total, "seconds": round(time.perf_counter() - started, 1),
                   "final_train_loss": sum(losses[-20:]) / len(losses[-20:])}


@torch.no_grad()
def accuracy(model: ViTClassifier, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 500) -> float:
    model.eval()
    correct = 0
    for begin in range(0, len(images), batch_size):
        correct += int((model(images[begin:begin + batch_size]).argmax(1) == labels[begin:begin + batch_size]).sum())
    return correct / len(images)


def image_batches(images: torch.Tensor, labels: torch.Tensor, batch_size: int, n_tokens: int) -> list:
    """(images, all-true mask (B, T), labels) batches for :func:`rdepth.surrogate.bank.build_bank`."""
    batches = []
    for begin in range(0, len(images), batch_size):
        chunk = images[begin:begin + batch_size]
        batches.append((chunk, torch.ones(len(chunk), n_tokens, dtype=torch.bool), labels[begin:begin + batch_size]))
    return batches
