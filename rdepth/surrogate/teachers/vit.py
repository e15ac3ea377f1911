"""Small Vision Transformers on Fashion-MNIST, with optional stochastic depth: rdepth's vision teachers.

The ViT is a :class:`Teacher` (patch embedding + [CLS] + positions, L pre-norm layers, final
LayerNorm) plus a linear head on the [CLS] state, so the surrogate machinery reads it like
any other teacher. It is its own model family (the Raptor paper's teacher), not a
:class:`rdepth.model.RecurrentLM`. Fashion-MNIST comes from Debian's ``dataset-fashion-mnist``
package (idx ``.gz`` files under :data:`FASHION_MNIST_DIR`).

Named teachers (:data:`VISION_TEACHERS`) are trained by ``rdepth surrogate --teacher vit-fmnist``
and saved as a teacher folder (:func:`save_vit`: ``vit.safetensors`` + ``vit_config.json``)
that later runs reuse (:func:`load_vit`).
"""

from __future__ import annotations

import gzip
import json
import logging
import struct
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.surrogate.teachers.layers import LayerSpec, Teacher, TransformerLayer

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                       "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
N_CLASSES = 10


def _read_idx(path: Path) -> torch.Tensor:
    """An idx file (gzip) as a uint8 tensor of its declared shape."""
    if not path.is_file():
        raise RdepthError(f"Fashion-MNIST file {path} is missing: install the Debian package "
                          "(apt-get install -y dataset-fashion-mnist) or pass --data-dir")
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as exc:
        raise RdepthError(f"{path} is not a readable gzip file ({exc})") from None
    if len(data) < 4:
        raise RdepthError(f"{path} is too short to be an idx file")
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
    directory = Path(directory)
    raw_images, raw_labels = _read_idx(directory / image_file), _read_idx(directory / label_file)
    if raw_images.ndim != 3 or raw_labels.ndim != 1 or len(raw_images) != len(raw_labels):
        raise RdepthError(f"{directory}: {split} images {tuple(raw_images.shape)} and labels "
                          f"{tuple(raw_labels.shape)} do not match (corrupt Fashion-MNIST files?)")
    if int(raw_labels.max()) >= N_CLASSES:
        raise RdepthError(f"{directory / label_file}: labels must lie in 0..{N_CLASSES - 1}")
    images = raw_images.float().div(255.0)
    labels = raw_labels.long()
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
        if self.image_size % self.patch or self.d_model % self.n_heads:
            raise RdepthError(f"vit: patch {self.patch} must divide image_size {self.image_size} and n_heads "
                              f"{self.n_heads} must divide d_model {self.d_model}")
        if not 0.0 <= self.drop_path < 1.0:
            raise RdepthError(f"vit: drop_path must lie in [0, 1), got {self.drop_path}")
        for name in ("n_layers", "epochs", "batch_size", "n_train"):
            if getattr(self, name) < 1:
                raise RdepthError(f"vit: {name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_tokens(self) -> int:
        """[CLS] + patches."""
        return (self.image_size // self.patch) ** 2 + 1


# name -> the teacher's architecture and training (epochs are set per run, --vit-epochs)
VISION_TEACHERS: dict[str, ViTConfig] = {
    "vit-fmnist": ViTConfig(d_model=64, n_layers=8, n_heads=4, d_ff=128, patch=7, drop_path=0.0, n_train=60000),
    "vit-fmnist-sd": ViTConfig(d_model=64, n_layers=8, n_heads=4, d_ff=128, patch=7, drop_path=0.1, n_train=60000),
}
VIT_CONFIG_FILE, VIT_WEIGHTS_FILE = "vit_config.json", "vit.safetensors"


def vision_teacher_config(name: str, epochs: int, seed: int) -> ViTConfig:
    """The registry's architecture for ``name`` with this run's epochs and seed."""
    if name not in VISION_TEACHERS:
        raise RdepthError(f"unknown vision teacher {name!r}; known: {sorted(VISION_TEACHERS)}")
    return replace(VISION_TEACHERS[name], epochs=epochs, seed=seed)


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


def is_vit_folder(path: str | Path) -> bool:
    return (Path(path) / VIT_CONFIG_FILE).is_file()


def save_vit(model: ViTClassifier, config: ViTConfig, directory: str | Path, info: dict) -> None:
    """Write the teacher folder: weights (safetensors) then its config and training record."""
    from safetensors.torch import save_file

    from rdepth.io import atomic_path, write_json

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().contiguous() for name, value in model.state_dict().items()}
    with atomic_path(directory / VIT_WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp))
    write_json(directory / VIT_CONFIG_FILE, {"vit": config.to_dict(), **info})


def load_vit(directory: str | Path) -> tuple[ViTClassifier, dict]:
    """A frozen ViT from a teacher folder, and the saved record (``vit`` config, accuracy, ...)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / VIT_CONFIG_FILE, directory / VIT_WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise RdepthError(f"{directory} is not a ViT teacher folder ({VIT_CONFIG_FILE} + {VIT_WEIGHTS_FILE})")
    try:
        record = json.loads(config_path.read_text())
        config = ViTConfig(**record["vit"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RdepthError(f"{config_path} is not a valid ViT config ({type(exc).__name__})") from None
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:
        raise RdepthError(f"{weights_path} is not a readable safetensors file ({type(exc).__name__})") from None
    model = ViTClassifier(config)
    try:
        model.load_state_dict(tensors)
    except RuntimeError:
        raise RdepthError(f"{weights_path} does not match the ViT of {config_path}") from None
    model.eval().requires_grad_(False)
    return model, record


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
