"""The vision pipeline (``rdepth surrogate --teacher vit-fmnist``): probe retention on constructed
features with known answers, the dynamics measurements on constructed states, the teacher folder,
and a tiny end-to-end run on a small idx data set written in Fashion-MNIST's format."""

from __future__ import annotations

import gzip
import json
import struct

import pytest
import torch

from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.surrogate.measure.basins import class_basins, findings, perturbation_recovery, verdict
from rdepth.surrogate.measure.retention import normalised, pixel_floor, probe_retention

pytestmark = pytest.mark.usefixtures("one_thread")


def one_hot(labels: torch.Tensor, n: int = 4) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels, n).double()


def test_identical_surrogate_retains_exactly_everything():
    # one-hot class features: the teacher's probe is exact (accuracy 1, known, not read off the teacher);
    # a surrogate with the same features keeps all of it; one with constant features carries no information:
    # every score ties, the probe answers class 0, right for exactly the quarter of examples labelled 0
    train_labels, test_labels = torch.arange(200) % 4, torch.arange(100) % 4
    teacher = (one_hot(train_labels), one_hot(test_labels))
    result = probe_retention({"teacher": teacher, "raptor": (teacher[0].clone(), teacher[1].clone()),
                              "blank": (torch.zeros(200, 4), torch.zeros(100, 4))},
                             train_labels, test_labels, 4, floor=0.25)
    assert result["teacher"]["own_probe_accuracy"] == 1.0 and result["teacher"]["teacher_probe_accuracy"] == 1.0
    for key in ("teacher_probe_retention", "own_probe_retention", "teacher_probe_normalised", "own_probe_normalised"):
        assert result["raptor"][key] == 1.0 and result["teacher"][key] == 1.0
    blank = result["blank"]
    assert blank["own_probe_accuracy"] == 0.25 and blank["teacher_probe_accuracy"] == 0.25
    assert blank["own_probe_retention"] == 0.25 and blank["own_probe_normalised"] == 0.0


def test_planted_degradation_gives_the_computed_retention():
    # teacher features = one-hot of the class: its probe is exact (accuracy 1). The surrogate's test
    # features point at the wrong class for exactly 30 of 100 examples; its training features are clean,
    # so both probes read 70% and the floor (40%) normalises it to (0.7 - 0.4) / (1 - 0.4) = 0.5.
    labels = torch.arange(200) % 4
    test_labels = torch.arange(100) % 4
    degraded = test_labels.clone()
    degraded[:30] = (degraded[:30] + 1) % 4
    features = {"teacher": (one_hot(labels), one_hot(test_labels)), "raptor": (one_hot(labels), one_hot(degraded)),
                "rotated": (one_hot(labels) @ torch.eye(4).flip(0).double(), one_hot(test_labels) @ torch.eye(4).flip(0).double())}
    result = probe_retention(features, labels, test_labels, 4, floor=0.4)
    assert result["teacher"]["own_probe_accuracy"] == 1.0
    raptor = result["raptor"]
    assert raptor["teacher_probe_accuracy"] == pytest.approx(0.7) and raptor["own_probe_accuracy"] == pytest.approx(0.7)
    assert raptor["teacher_probe_retention"] == pytest.approx(0.7)
    assert raptor["own_probe_normalised"] == pytest.approx(0.5)
    # a permuted feature basis keeps the information (own probe: 100%) but not the teacher's coordinates
    rotated = result["rotated"]
    assert rotated["own_probe_retention"] == 1.0 and rotated["teacher_probe_accuracy"] < 0.5
    assert normalised(0.4, 1.0, 0.4) == 0.0 and normalised(0.9, 0.8, 0.8) != normalised(0.9, 0.8, 0.8)


def test_pixel_floor_on_separable_and_random_pixels():
    labels = torch.arange(40) % 4
    images = one_hot(labels).reshape(40, 1, 2, 2)
    assert pixel_floor(images, labels, images, labels, 4) == 1.0


def test_class_basins_on_constructed_directions():
    # depth 0: every example of class c points exactly along e_c (orthogonal classes);
    # depth 1: every example points along e_0 + a tiny class offset (one shared direction)
    labels = torch.arange(12) % 3
    exact = torch.eye(3)[labels]
    shared = torch.tensor([1.0, 0.0, 0.0]) + 1e-3 * torch.eye(3)[labels]
    result = class_basins(torch.stack([exact, shared]), labels, 3)
    assert result["within"][0] == pytest.approx(0.0, abs=1e-5) and result["between"][0] == pytest.approx(90.0)
    assert result["ratio"][0] == pytest.approx(0.0, abs=1e-6) and result["nearest_class"][0] == 1.0
    assert result["between"][1] < 0.2


def test_perturbation_recovery_of_a_contracting_and_an_isometric_map():
    g = torch.Generator().manual_seed(0)
    state = torch.randn(5, 3, 6, generator=g)
    fixed = torch.randn(5, 3, 6, generator=g)
    contract = lambda s, d: fixed + 0.5 * (s - fixed)  # noqa: E731 - every step halves the deviation from `fixed`
    clean = [state]
    for d in range(4):
        clean.append(contract(clean[-1], d))
    result = perturbation_recovery(contract, clean, 1, 0.01, torch.Generator().manual_seed(1))
    assert len(result["angle"]) == 4 and result["recovery"] < 0.2
    identity = lambda s, d: s  # noqa: E731 - keeps any deviation as it is
    same = [state] * 5
    kept = perturbation_recovery(identity, same, 2, 0.01, torch.Generator().manual_seed(1))
    assert kept["recovery"] == pytest.approx(1.0)
    assert verdict([True, True]) == "reproduced" and verdict([True, False]) == "partly" and verdict([False]) == "not"


def test_findings_read_the_saved_numbers():
    dynamics = {"teacher": {
        "basins": {"within": [40, 30, 20, 10, 5], "between": [50, 50, 50, 50, 50], "ratio": [0.8, 0.6, 0.4, 0.2, 0.1],
                   "nearest_class": [0.3, 0.5, 0.6, 0.8, 0.9]},
        "perturbation": [{"depth": 0, "recovery": 0.5}, {"depth": 2, "recovery": 1.5}],
        "angular": {"step_first": [1, 2, 3, 9], "step_others": [1, 1, 1, 2]},
        "coherence": {"others": [0.1, 0.2, 0.3, 0.4, 0.8]},
        "update_effective_rank": [10.0, 12.0, 8.0, 3.0], "step_size": [0.5, 0.4, 0.3, 0.2]}}
    verdicts = {row["finding"]: row["verdict"] for row in findings(dynamics)}
    assert verdicts == {"class-dependent angular basins": "reproduced",
                        "self-correction under small perturbations": "partly",
                        "[CLS] turns sharply late": "reproduced",
                        "patch tokens cohere late toward their mean": "reproduced",
                        "low-rank updates late in depth": "reproduced"}


def write_idx(folder, name, tensor):
    header = struct.pack(">HBB", 0, 8, tensor.ndim) + struct.pack(">" + "I" * tensor.ndim, *tensor.shape)
    (folder / name).write_bytes(gzip.compress(header + tensor.to(torch.uint8).numpy().tobytes()))


@pytest.fixture
def small_fmnist(tmp_path):
    """A small data set in Fashion-MNIST's idx format: 10 classes, each a bright square at its own place."""
    folder = tmp_path / "fmnist"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 160), ("t10k", 80)):
        labels = torch.arange(n) % 10
        images = (torch.rand(n, 28, 28, generator=g) * 60).to(torch.uint8)
        for i, label in enumerate(labels.tolist()):
            row, col = divmod(label, 5)
            images[i, 4 + 10 * row: 12 + 10 * row, 1 + 5 * col: 6 + 5 * col] = 250
        write_idx(folder, f"{split}-images-idx3-ubyte.gz", images)
        write_idx(folder, f"{split}-labels-idx1-ubyte.gz", labels)
    return folder


def flags(data, out, *extra):
    return ["surrogate", "--teacher", "vit-fmnist", "--data-dir", str(data), "--out", str(out), "--vit-epochs", "1",
            "--images-fit", "64", "--images-probe", "120", "--images-test", "60", "--images-dynamics", "40",
            "--image-batch", "32", "--steps-block", "2", "--steps-joint", "3", "--log-every", "1", "--threads", "1",
            *map(str, extra)]


@pytest.mark.slow
def test_tiny_vision_run_end_to_end_and_teacher_reuse(small_fmnist, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(flags(small_fmnist, out, "--compare-k", "1,2")) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["compare_k"] == [1, 2] and set(results["by_k"]) == {"1", "2"}
    for entry in results["by_k"].values():
        assert set(entry["models"]) == {"raptor", "equal_split", "truncated"}
        assert sum(entry["phases"]) == 8
    assert results["teacher"]["own_probe_retention"] == 1.0
    assert 0.0 <= results["floor"]["pixel_probe_accuracy"] <= 1.0
    dynamics = json.loads((out / "dynamics.json").read_text())
    assert len(dynamics["teacher"]["perturbation"]) == 8 and len(dynamics["raptor"]["basins"]["ratio"]) == 9
    null = dynamics["null"]  # the teacher against its nulls, 3 seeds of 20 of the 40 dynamics images
    assert (null["seeds"], null["images_per_seed"], len(null["random_init"]), len(null["shuffled_depth"])) == (3, 20, 3, 3)
    assert all(row["verdict"] in ("reproduced", "partly", "not reproduced") for row in null["verdicts"])
    page = (out / "index.html").read_text()
    assert page.index("Downstream retention") < page.index("dynamics findings")
    assert "verdict against the nulls" in page
    config = json.loads((out / "config.json").read_text())
    assert config["teacher"]["trained_here"] is True
    # the same settings in the same folder reuse the saved teacher; a teacher folder given by path is loaded
    from rdepth.surrogate.config import SurrogateRunConfig, VisionConfig
    from rdepth.surrogate.teachers.vit import load_fashion_mnist
    from rdepth.surrogate.vision import vision_teacher

    data = (load_fashion_mnist("train", small_fmnist), load_fashion_mnist("test", small_fmnist))
    vision = VisionConfig(vit_epochs=1, data_dir=str(small_fmnist))
    saved = (out / "teacher" / "vit.safetensors").read_bytes()
    model, record = vision_teacher(SurrogateRunConfig(teacher="vit-fmnist", vision=vision), out, *data)
    assert record["trained_here"] is False and (out / "teacher" / "vit.safetensors").read_bytes() == saved
    by_path, record = vision_teacher(SurrogateRunConfig(teacher=str(out / "teacher"), vision=vision), tmp_path / "x", *data)
    assert record["trained_here"] is False and not (tmp_path / "x" / "teacher").exists()
    images = data[1][0][:4]
    assert torch.equal(by_path(images), model(images))
    assert "report:" in capsys.readouterr().out


def one_line_error(capsys, code) -> str:
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rdepth surrogate: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_vision_bad_inputs_are_one_line_errors(small_fmnist, tmp_path, capsys):
    err = one_line_error(capsys, main(flags(tmp_path / "nowhere", tmp_path / "a")))
    assert "apt-get install -y dataset-fashion-mnist" in err
    (small_fmnist / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x05ab"))
    err = one_line_error(capsys, main(flags(small_fmnist, tmp_path / "b")))
    assert "header says" in err
    (small_fmnist / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    err = one_line_error(capsys, main(flags(small_fmnist, tmp_path / "c")))
    assert "gzip" in err
    err = one_line_error(capsys, main(flags(small_fmnist, tmp_path / "d", "--compare-k", "0")))
    assert "compare_k" in err
    err = one_line_error(capsys, main(flags(small_fmnist, tmp_path / "d", "--null-seeds", "-1")))
    assert "null_seeds must be an integer >= 0" in err
    folder = tmp_path / "not_a_teacher"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit"}))
    err = one_line_error(capsys, main(["surrogate", "--teacher", str(folder), "--out", str(tmp_path / "e")]))
    assert "not supported" in err
    for path in (tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"):
        assert not (path / "index.html").exists()


def test_k_beyond_the_layers_is_an_error(small_fmnist, tmp_path, capsys):
    from rdepth.surrogate.teachers.vit import VISION_TEACHERS, ViTClassifier, save_vit

    torch.manual_seed(0)
    config = VISION_TEACHERS["vit-fmnist"]
    save_vit(ViTClassifier(config), config, tmp_path / "teacher", {"test_accuracy": 0.1})
    args = flags(small_fmnist, tmp_path / "run", "--k", "9")
    args[args.index("vit-fmnist")] = str(tmp_path / "teacher")
    err = one_line_error(capsys, main(args))
    assert "k = 9 exceeds the teacher's 8 layers" in err
    (tmp_path / "teacher" / "vit.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    err = one_line_error(capsys, main(args))
    assert "not a readable safetensors file" in err
    with pytest.raises(RdepthError, match="unknown vision teacher"):
        from rdepth.surrogate.teachers.vit import vision_teacher_config
        vision_teacher_config("vit-imagenet", 1, 0)
