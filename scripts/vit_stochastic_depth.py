"""Does stochastic depth make a ViT more block-recurrent? (the Raptor paper's small-scale claim)

Trains ViTs of the ``vit-fmnist`` architecture (8 layers, d = 64) on Fashion-MNIST at several
stochastic-depth rates and seeds, then for each: the layer-similarity matrices of the fit images,
how block-structured they are under the best k-phase segmentation (chosen on those same fit
images), and how well a k-block Raptor surrogate fits (state fidelity, and linear-probe
retention on the test images normalised by the pixel probe, :mod:`rdepth.surrogate.measure.retention`)
beside the truncated and equal-split baselines. Runs go seed by seed (every rate of seed 0 first),
and ``results.json`` is rewritten after each, so a study cut short keeps whole seeds. The table
(mean +- sd over seeds) and report page are drawn from the saved numbers (``--render-only``).

    apt-get install -y dataset-fashion-mnist
    python scripts/vit_stochastic_depth.py --out runs/vit_sd --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.io import atomic_path, environment_info, write_json, write_text
from rdepth.report import Report
from rdepth.report.figures import save_report_figure
from rdepth.surrogate.bank import build_bank
from rdepth.surrogate.config import FitConfig
from rdepth.surrogate.fit import fit_surrogate
from rdepth.surrogate.measure.fidelity import evaluate_vision, surrogate_fn, truncated_fn
from rdepth.surrogate.measure.retention import pixel_floor, probe_retention
from rdepth.surrogate.measure.similarity import SIMILARITIES, similarity_matrices
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig
from rdepth.surrogate.pages import plots
from rdepth.surrogate.pages.text import markdown_table
from rdepth.surrogate.phases import block_structure, dp_phases, equal_phases
from rdepth.surrogate.teachers.vit import (
    N_CLASSES,
    VISION_TEACHERS,
    accuracy,
    image_batches,
    load_fashion_mnist,
    train_vit,
)
from rdepth.surrogate.vision import cls_feature, features_of

log = logging.getLogger("vit_stochastic_depth")

TABLE_COLUMNS = ["drop_path", "seed", "test_acc", "contrast_k2", "var_expl_k2", "contrast_k3", "phases",
                 "raptor_final_cos", "raptor_rel_mse", "raptor_probe_ret", "raptor_probe_norm", "raptor_own_norm",
                 "equal_rel_mse", "equal_probe_norm", "truncated_rel_mse", "truncated_own_norm", "joint_loss"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/vit_sd", help="output folder")
    parser.add_argument("--drop-paths", default="0.0,0.1,0.2,0.3", help="stochastic-depth rates (comma list)")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (comma list)")
    parser.add_argument("--k", type=int, default=2, help="surrogate blocks")
    parser.add_argument("--similarity", default="token_cosine", choices=sorted(SIMILARITIES),
                        help="similarity measure used for the phases")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--n-train", type=int, default=30000, help="ViT training images (the first N)")
    parser.add_argument("--n-fit", type=int, default=1024, help="images whose states the surrogate fits")
    parser.add_argument("--n-probe", type=int, default=5000, help="images to train the linear probes on")
    parser.add_argument("--n-test", type=int, default=5000, help="test images for probes and fidelity")
    parser.add_argument("--steps-block", type=int, default=100)
    parser.add_argument("--steps-joint", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--render-only", action="store_true", help="redraw table and page from results.json")
    parser.add_argument("--merge", default="", help="add the runs of another study folder (same settings, other "
                        "seeds) to OUT's results.json, then redraw; nothing is trained")
    return parser.parse_args()


def study_one(config, data: dict, args: argparse.Namespace, out: Path) -> dict:
    """Train one ViT and measure its block structure and surrogate fit."""
    model, train_log = train_vit(config, *data["train"])
    test_acc = accuracy(model, *data["test"])
    teacher = model.backbone
    n_tokens = (config.image_size // config.patch) ** 2 + 1
    fit_bank = build_bank(teacher, image_batches(*data["fit"], 64, n_tokens), "states (fit)")
    probe_bank = build_bank(teacher, image_batches(*data["probe"], 250, n_tokens), "states (probe)")
    test_bank = build_bank(teacher, image_batches(*data["test_small"], 250, n_tokens), "states (test)")
    # phases (and the block structure they score) come from the fit images' states: the test
    # images only evaluate the surrogate, so they must not choose its phases
    states, mask = fit_bank.stacked()
    matrices = {name: m.numpy() for name, m in similarity_matrices(states, mask).items()}
    chosen_matrix = torch.from_numpy(matrices[args.similarity][1:, 1:])
    structure = {}
    for k in sorted({2, 3, args.k}):
        if k <= config.n_layers:
            lengths = dp_phases(chosen_matrix, k)
            structure[k] = {"lengths": list(lengths), **block_structure(chosen_matrix, lengths)}
    phases, equal = dp_phases(chosen_matrix, args.k), equal_phases(config.n_layers, args.k)
    fit_config = FitConfig(steps_block=args.steps_block, steps_joint=args.steps_joint, lr=1e-3, seed=config.seed)
    tag = f"sd{config.drop_path}_seed{config.seed}"
    surrogate = RaptorSurrogate(teacher, SurrogateConfig(phases))
    fits = {"raptor": fit_surrogate(surrogate, fit_bank, fit_config, out / "metrics.jsonl", f"{tag}/raptor")}
    models = {"raptor": surrogate_fn(surrogate), "truncated": truncated_fn(args.k)}
    if equal != phases:
        equal_surrogate = RaptorSurrogate(teacher, SurrogateConfig(equal))
        fits["equal_split"] = fit_surrogate(equal_surrogate, fit_bank, fit_config, out / "metrics.jsonl",
                                            f"{tag}/equal_split")
        models["equal_split"] = surrogate_fn(equal_surrogate)
    else:
        models["equal_split"] = models["raptor"]
    results, _ = evaluate_vision(models, teacher, probe_bank, test_bank, N_CLASSES)
    # probe retention normalised by the pixel probe (the same measure as rdepth surrogate's table)
    probe_images, test_images = data["probe"][0], data["test_small"][0]
    fns = {"teacher": lambda x: cls_feature(teacher, teacher.layer_states(x)[-1]),
           "raptor": lambda x: cls_feature(teacher, surrogate.layer_states(x)[-1]),
           "truncated": lambda x: cls_feature(teacher, teacher.layer_states(x, n_layers=args.k)[-1])}
    if equal != phases:
        fns["equal_split"] = lambda x: cls_feature(teacher, equal_surrogate.layer_states(x)[-1])
    features = {name: (features_of(fn, probe_images), features_of(fn, test_images)) for name, fn in fns.items()}
    if "equal_split" not in features:
        features["equal_split"] = features["raptor"]
    retention = probe_retention(features, data["probe"][1], data["test_small"][1], N_CLASSES, data["floor"])
    for name in ("raptor", "equal_split", "truncated"):
        results[name].update(retention[name])
    with atomic_path(out / f"similarity_{tag}.npz") as tmp, open(tmp, "wb") as handle:
        np.savez(handle, **matrices)
    return {"tag": tag, "vit": config.to_dict(), "train": train_log, "test_acc": test_acc,
            "structure": structure, "phases": list(phases), "equal": list(equal), "fits": fits, "models": results}


def table_rows(records: list[dict], k: int) -> list[dict]:
    rows = []
    for r in records:
        m = r["models"]
        rows.append({
            "drop_path": r["vit"]["drop_path"], "seed": r["vit"]["seed"], "test_acc": r["test_acc"],
            "contrast_k2": r["structure"]["2"]["contrast"], "var_expl_k2": r["structure"]["2"]["variance_explained"],
            "contrast_k3": r["structure"]["3"]["contrast"] if "3" in r["structure"] else float("nan"),
            "phases": r["phases"],
            "raptor_final_cos": m["raptor"]["final_cosine"], "raptor_rel_mse": m["raptor"]["final_rel_mse"],
            "raptor_probe_ret": m["raptor"]["teacher_probe_retention"],
            "raptor_probe_norm": m["raptor"]["teacher_probe_normalised"],
            "raptor_own_norm": m["raptor"]["own_probe_normalised"],
            "equal_rel_mse": m["equal_split"]["final_rel_mse"],
            "equal_probe_norm": m["equal_split"]["teacher_probe_normalised"],
            "truncated_rel_mse": m["truncated"]["final_rel_mse"],
            "truncated_own_norm": m["truncated"]["own_probe_normalised"],
            "joint_loss": r["fits"]["raptor"]["joint_loss"],
        })
    return rows


def mean_rows(rows: list[dict]) -> list[dict]:
    """Per stochastic-depth rate, "mean +- sd" over seeds of every numeric column (sd with ddof 1)."""
    by_rate: dict[float, list[dict]] = {}
    for row in rows:
        by_rate.setdefault(row["drop_path"], []).append(row)
    means = []
    for rate, group in sorted(by_rate.items()):
        mean = {"drop_path": rate, "seed": f"mean +- sd of {len(group)}", "phases": ""}
        for column in TABLE_COLUMNS:
            if isinstance(group[0].get(column), float) and column != "drop_path":
                values = [g[column] for g in group]
                sd = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
                mean[column] = f"{np.mean(values):.4f} +- {sd:.4f}"
        means.append(mean)
    return means


def write_outputs(out: Path, saved: dict) -> None:
    """Table (markdown + HTML) and figures, from the saved numbers only."""
    records = saved["records"]
    rows = table_rows(records, saved["k"])
    rows_all = rows + mean_rows(rows)
    write_text(out / "table.md", markdown_table(rows_all, TABLE_COLUMNS) + "\n")
    report = Report("Stochastic depth and block-recurrence (Fashion-MNIST ViTs)",
                    intro=f"k = {saved['k']} phases from the {saved['similarity']} matrix of the fit images (DP); "
                          "block structure is measured on that matrix, fidelity and probes on the test images. "
                          "probe_ret = the teacher's ridge probe on the model's final [CLS] / the teacher's accuracy; *_norm = "
                          "(accuracy - pixel-probe accuracy) / (teacher - pixel probe), with the teacher's probe "
                          "(probe_norm) or one retrained on the model's features (own_norm).")
    report.section("summary", "Summary (phases and structure: fit images; fidelity and probes: test images)",
                   order=10).table(
        [{c: row.get(c, "") for c in TABLE_COLUMNS} for row in rows_all])
    matrices = report.section("similarity", "Similarity matrices (fit images)", order=20)
    for record in records:
        with np.load(out / f"similarity_{record['tag']}.npz") as data:
            matrix = data[saved["similarity"]]
        drawn = {"dp": record["phases"], "equal": record["equal"]}
        figure = plots.plot_similarity(matrix, drawn, f"{record['tag']}: {saved['similarity']}")
        matrices.figure(save_report_figure(figure, out, f"similarity_{record['tag']}"), record["tag"])
    bars = report.section("comparison", "Block structure and surrogate error per run", order=30)
    labelled = [{**row, "run": f"sd={row['drop_path']} s={row['seed']}"} for row in rows]
    for value in ("contrast_k2", "raptor_rel_mse"):
        figure = plots.plot_bars(labelled, value, "run", value)
        bars.figure(save_report_figure(figure, out, f"bars_{value}"), value)
    report.write(out)


SEED_ONLY_ARGS = {"seeds", "out", "threads", "render_only", "merge"}  # may differ between merged folders


def merge_study(out: Path, other: Path) -> dict:
    """OUT's saved study with the runs of ``other`` added (runs already in OUT are kept, not replaced).

    Both folders must come from the same settings (every argument but the seeds, folder and threads);
    ``other``'s similarity matrices are copied beside OUT's.
    """
    mine, theirs = (json.loads((folder / "results.json").read_text()) for folder in (out, other))
    differing = sorted(name for name in set(mine["args"]) | set(theirs["args"])
                       if name not in SEED_ONLY_ARGS and mine["args"].get(name) != theirs["args"].get(name))
    if differing:
        raise SystemExit(f"error: {other} was run with other settings ({', '.join(differing)}); not merged")
    have = {record["tag"] for record in mine["records"]}
    added = [record for record in theirs["records"] if record["tag"] not in have]
    for record in added:
        shutil.copyfile(other / f"similarity_{record['tag']}.npz", out / f"similarity_{record['tag']}.npz")
    merged = dict(mine, records=mine["records"] + added)
    merged["merged"] = mine.get("merged", []) + [{"folder": str(other), "seeds": theirs["args"]["seeds"],
                                                 "seconds": theirs["seconds"], "runs": [r["tag"] for r in added],
                                                 "environment": theirs["environment"]}]
    return merged


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.merge:
        write_json(out / "results.json", merge_study(out, Path(args.merge)))
        args.render_only = True
    if args.render_only:
        write_outputs(out, json.loads((out / "results.json").read_text()))
        print((out / "table.md").read_text())
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()
    started = time.perf_counter()
    try:
        train_images, train_labels = load_fashion_mnist("train")
        test_images, test_labels = load_fashion_mnist("test")
    except RdepthError as exc:
        print(f"error: {exc}")
        return 2
    held_out = slice(len(train_images) - args.n_probe, len(train_images))
    data = {"train": (train_images, train_labels), "test": (test_images, test_labels),
            "fit": (train_images[: args.n_fit], train_labels[: args.n_fit]),
            "probe": (train_images[held_out], train_labels[held_out]),
            "test_small": (test_images[: args.n_test], test_labels[: args.n_test])}
    data["floor"] = pixel_floor(*data["probe"], *data["test_small"], N_CLASSES)
    records = []
    base = VISION_TEACHERS["vit-fmnist"]
    for seed in (int(x) for x in args.seeds.split(",")):  # seed-major: a study cut short keeps whole seeds
        for drop_path in (float(x) for x in args.drop_paths.split(",")):
            config = dataclasses.replace(base, drop_path=drop_path, seed=seed, epochs=args.epochs, n_train=args.n_train)
            record = study_one(config, data, args, out)
            records.append(record)
            log.info("%s: test acc %.4f, k=2 contrast %.3f, raptor final rel MSE %.4f (%.0f s so far)", record["tag"],
                     record["test_acc"], record["structure"][2]["contrast"], record["models"]["raptor"]["final_rel_mse"],
                     time.perf_counter() - started)
            saved = {"k": args.k, "similarity": args.similarity, "args": vars(args), "environment": environment_info(),
                     "pixel_floor": data["floor"], "seconds": round(time.perf_counter() - started, 1),
                     "records": records}
            write_json(out / "results.json", saved)
    write_outputs(out, json.loads((out / "results.json").read_text()))
    print((out / "table.md").read_text())
    print(f"total {saved['seconds']:.0f} s; report: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
