"""Settings of ``rdepth gate`` (torch-free at import): training the learned exit gate on a frozen run."""

from __future__ import annotations

from dataclasses import dataclass

from rdepth.exits.config import checked_k_max, resolve_k_max
from rdepth.fields import check_fields, option
from rdepth.run.config import DEVICE_HELP, check_device_name
from rdepth.threads import THREADS_HELP


@dataclass
class GateConfig:
    """One ``rdepth gate`` run: record the frozen model's iterates on held-out windows of ``data``'s val
    split at the full budget, label each (token, step) by whether its prediction still changes, fit one
    linear head per group and save it beside the checkpoint (``exit_gate.safetensors``)."""

    checkpoint: str = option("", "checkpoint folder, or a run folder (its latest checkpoint)", required=True)
    data: str = option("", "prepared data folder (text or task): the gate trains on windows of its val split "
                       "(on task data: problems of the training difficulties, never the held-out sets)",
                       required=True)
    windows: int = option(256, "val-split windows recorded (each of the model's block size)", bounds="[2, inf)")
    validation_share: float = option(0.25, "share of those windows kept out of the fit, to report the gate's "
                                     "loss and accuracy on", bounds="(0, 0.9]")
    k_max: tuple[int, ...] | None = option(
        None, "loop-step cap N (every group) or N,N,... (per group): the budget the iterates are recorded at and "
        "the step the labels look ahead to", default_text="twice the model's eval loops")
    positions: str = option(
        "all", "which positions give training rows: all (the gate runs at every position) or answers (task data "
        "only: the answer tokens, which the model was trained to predict)", choices=("all", "answers"))
    steps: int = option(400, "optimizer steps of the fit (full batch, Adam)", bounds="[1, 100000]")
    lr: float = option(0.05, "learning rate of the fit", bounds="(0, 10]")
    batch_size: int = option(16, "windows per forward pass while recording", bounds="[1, inf)")
    seed: int = option(0, "seed of the initial loop-state noise", bounds=f"[0, {2**63})")
    overwrite: bool = option(False, "replace an existing exit_gate.safetensors (an exit profile calibrated with "
                             "the old gate then refuses the new one)")
    device: str = option("auto", DEVICE_HELP)
    progress: bool = option(True, "show progress bars")
    threads: int = option(0, THREADS_HELP, bounds="[0, inf)")

    def __post_init__(self) -> None:
        check_fields(self, "gate")
        self.k_max = checked_k_max("gate", self.k_max)
        check_device_name("gate", self.device)

    def resolve_k_max(self, n_groups: int, eval_loops: tuple[int, ...]) -> tuple[int, ...]:
        return resolve_k_max("gate", self.k_max, n_groups, eval_loops)
