"""Float8 training matmuls (``TrainConfig.fp8``): torchao's float8 training on the layers and the adapters.

What runs in float8 (torchao's default recipe: dynamic tensorwise scales, e4m3 inputs and weights, e5m2
output gradients, float8 products accumulated in higher precision):

* every ``nn.Linear`` of every layer (attention ``qkv`` and ``proj``, MLP ``fc`` and ``proj``), in the
  recurrence groups and in the single-pass stages alike, swapped for torchao's ``Float8Linear`` by
  ``torchao.float8.convert_to_float8_training`` with a module filter (:func:`fp8_plan`);
* the adapters' two half matmuls (``W_s s`` every loop step, ``W_e e`` once per group), which the model
  computes on slices of ``adapters[g].weight`` and so never through the adapter's ``forward``: the
  adapter is swapped too (for its float8 settings), and the model's ``adapter_matmul`` hook
  (:func:`rdepth.model.recurrent.adapter_matmul`) is replaced by :func:`_float8_adapter_matmul`, which
  runs torchao's float8 matmul on the slice.

Left in bf16: the tied head and embedding, the norms, attention's own products (SDPA). A matmul whose
dims are not multiples of 16 (what float8 GEMMs take on CUDA) is left out and the log says so.

A ``Float8Linear`` keeps the module's own ``nn.Parameter`` (float32), so the optimizer, its state and
every checkpoint are those of a bf16 run: the same keys, plain tensors, loadable without torchao.
Needs CUDA compute capability >= 8.9 (Ada, Hopper and later: float8 tensor cores) and torchao
(``pip install 'rdepth[fp8]'``; :data:`TORCHAO_VERSION`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from rdepth.errors import RdepthError

log = logging.getLogger(__name__)

TORCHAO_VERSION = "0.18.0"  # the version pyproject's fp8 extra pins (and the wheel docs/gpu.md carries)
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
FLOAT8_MULTIPLE = 16  # float8 GEMMs on CUDA need both dims of each matmul to be multiples of 16
INSTALL_HINT = ("pip install 'rdepth[fp8]' (torchao==" + TORCHAO_VERSION + "; offline: pip install --no-deps "
                "--no-index torchao-" + TORCHAO_VERSION + "-*.whl)")


@dataclass
class FP8Plan:
    """Which matmuls of a model run in float8: ``layers`` (names of the layers' ``nn.Linear`` modules),
    ``adapters`` (names of the adapters whose two halves do), ``left_out`` (name -> why not)."""

    layers: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "adapters": list(self.adapters), "left_out": dict(self.left_out)}


def check_fp8_device(device: torch.device) -> None:
    """A one-line error unless ``device`` is a CUDA card with float8 tensor cores (compute capability >= 8.9)."""
    if device.type != "cuda":
        raise RdepthError(f"--fp8 needs a CUDA card of compute capability >= 8.9 (e.g. H100, H200, L40S, RTX 4090); "
                          f"this run's device is {device.type}: drop --fp8")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RdepthError(f"--fp8 needs a CUDA card of compute capability >= 8.9 (float8 tensor cores); "
                          f"{torch.cuda.get_device_name(device)} is {major}.{minor}: drop --fp8")


def require_torchao():
    """``torchao.float8``, or a one-line error saying how to install it."""
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args  # noqa: F401
    except ImportError as exc:
        raise RdepthError(f"--fp8 needs torchao ({exc}): {INSTALL_HINT}") from None
    return float8


def _divisible(linear: nn.Linear) -> bool:
    out_features, in_features = linear.weight.shape
    return out_features % FLOAT8_MULTIPLE == 0 and in_features % FLOAT8_MULTIPLE == 0


def fp8_plan(model: nn.Module) -> FP8Plan:
    """The float8 plan of a :class:`~rdepth.model.recurrent.RecurrentLM` (needs no torchao): every layer's
    ``nn.Linear`` and every adapter, less those with a dim that is not a multiple of 16 (an adapter's
    halves are ``[d, d]``: it goes in when ``d`` does)."""
    plan = FP8Plan()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name.startswith("layers."):
            target = plan.layers
            fits = _divisible(module)
            dims = "x".join(map(str, module.weight.shape))
        elif name.startswith("adapters."):
            target = plan.adapters
            width = module.weight.shape[0]
            fits = width % FLOAT8_MULTIPLE == 0 and module.weight.shape[1] == 2 * width
            dims = f"{width}x{width} halves"
        else:  # no other Linear in the model today; a new one stays out until it is named here
            plan.left_out[name] = "not a layer or adapter matmul"
            continue
        if fits:
            target.append(name)
        else:
            plan.left_out[name] = f"dims {dims} are not multiples of {FLOAT8_MULTIPLE}"
    return plan


def convert_to_fp8(model: nn.Module) -> FP8Plan:
    """Put the matmuls of :func:`fp8_plan` on torchao's float8 training, in place (see the module's text):
    the planned ``nn.Linear`` modules become ``Float8Linear`` (the same parameters), and the model's
    ``adapter_matmul`` becomes :func:`_float8_adapter_matmul` when the adapters are planned. Returns the plan,
    also logged with what was left out."""
    float8 = require_torchao()
    plan = fp8_plan(model)
    chosen = set(plan.layers) | set(plan.adapters)
    float8.convert_to_float8_training(model, module_filter_fn=lambda module, name: name in chosen)
    if plan.adapters:
        model.adapter_matmul = _float8_adapter_matmul
    log.info("fp8: float8 matmuls in %d layer Linear modules and %d adapters (torchao %s)",
             len(plan.layers), len(plan.adapters), _torchao_version())
    if plan.left_out:
        log.info("fp8: left in high precision: %s",
                 "; ".join(f"{name} ({why})" for name, why in plan.left_out.items()))
    return plan


def _float8_adapter_matmul(adapter: nn.Module, x: torch.Tensor, columns: slice) -> torch.Tensor:
    """:func:`rdepth.model.recurrent.adapter_matmul` in float8: ``x W[:, columns]^T`` through torchao's
    float8 matmul with the settings of ``adapter`` (a ``Float8Linear``), the input cast as
    ``Float8Linear.forward`` casts it, so each half computes exactly what a ``Float8Linear`` holding
    that half would."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled():  # as Float8Linear.forward: the output in the autocast dtype
        x = x.to(torch.get_autocast_dtype("cuda"))
    return matmul_with_hp_or_float8_args.apply(x, adapter.weight[:, columns].t(), adapter.linear_mm_config,
                                               adapter.config)


def _torchao_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchao")
    except PackageNotFoundError:
        return "unknown"
