"""Does stochastic depth make a ViT more block-recurrent? (the Raptor paper's small-scale claim)

Trains tiny ViTs on Fashion-MNIST with and without stochastic depth (several seeds), then for
each: the layer-similarity matrices of the fit images, how block-structured they are under the
best k-phase segmentation (chosen on those same fit images), and how well a k-block Raptor
surrogate fits (state fidelity and linear-probe accuracy on the test images) beside the
truncated and equal-split baselines. Numbers go to JSON first; the table
and report page are drawn from them. Sized for < 20 minutes on 2 CPU cores.

    apt-get install -y dataset-fashion-mnist
    python scripts/vit_stochastic_depth.py --out runs/vit_sd
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.io import atomic_path, environment_info, write_json, write_text
from rdepth.report import Report
from rdepth.report.figures import save_report_figure
from rdepth.surrogate import plots
from rdepth.surrogate.bank import build_bank
from rdepth.surrogate.config import FitConfig
from rdepth.surrogate.evaluate import evaluate_vision, surrogate_fn, truncated_fn
from rdepth.surrogate.fit import fit_surrogate
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig
from rdepth.surrogate.phases import block_structure, dp_phases, equal_phases
from rdepth.surrogate.report import markdown_table
from rdepth.surrogate.similarity import SIMILARITIES, similarity_matrices
from rdepth.surrogate.vit import N_CLASSES, ViTConfig, accuracy, image_batches, load_fashion_mnist, train_vit

log = logging.getLogger("vit_stochastic_depth")

TABLE_COLUMNS = ["drop_path", "seed", "test_acc", "contrast_k2", "var_expl_k2", "contrast_k3", "phases",
                 "raptor_final_cos", "raptor_rel_mse", "raptor_probe_ret", "equal_rel_mse", "equal_probe_ret",
                 "truncated_rel_mse", "truncated_probe_ret"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/vit_sd", help="output folder")
    parser.add_argument("--drop-paths", default="0.0,0.5", help="stochastic-depth rates to compare (comma list)")
    parser.add_argument("--seeds", default="0,1", help="training seeds (comma list)")
    parser.add_argument("--k", type=int, default=2, help="surrogate blocks")
    parser.add_argument("--similarity", default="token_cosine", choices=sorted(SIMILARITIES),
                        help="similarity measure used for the phases")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=10000, help="ViT training images")
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-fit", type=int, default=1024, help="images whose states the surrogate fits")
    parser.add_argument("--n-probe", type=int, default=2000, help="images to train the linear probes on")
    parser.add_argument("--n-test", type=int, default=2000, help="test images for probes and fidelity")
    parser.add_argument("--steps-block", type=int, default=40)
    parser.add_argument("--steps-joint", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def study_one(config: ViTConfig, data: dict, args: argparse.Namespace, out: Path) -> dict:
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
    with atomic_path(out / f"similarity_{tag}.npz") as tmp:
        with open(tmp, "wb") as handle:
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
            "raptor_probe_ret": m["raptor"]["probe_retention"],
            "equal_rel_mse": m["equal_split"]["final_rel_mse"], "equal_probe_ret": m["equal_split"]["probe_retention"],
            "truncated_rel_mse": m["truncated"]["final_rel_mse"],
            "truncated_probe_ret": m["truncated"]["probe_retention"],
        })
    return rows


def mean_rows(rows: list[dict]) -> list[dict]:
    """Per stochastic-depth rate, the mean over seeds of every numeric column."""
    by_rate: dict[float, list[dict]] = {}
    for row in rows:
        by_rate.setdefault(row["drop_path"], []).append(row)
    means = []
    for rate, group in sorted(by_rate.items()):
        mean = {"drop_path": rate, "seed": f"mean of {len(group)}", "phases": ""}
        for column in TABLE_COLUMNS:
            if isinstance(group[0].get(column), float) and column != "drop_path":
                mean[column] = float(np.mean([g[column] for g in group]))
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
                          "Probe retention = "
                          "ridge linear-probe accuracy on the model's final [CLS] state / the teacher's.")
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


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
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
    records = []
    for drop_path in (float(x) for x in args.drop_paths.split(",")):
        for seed in (int(x) for x in args.seeds.split(",")):
            config = ViTConfig(drop_path=drop_path, seed=seed, epochs=args.epochs, n_train=args.n_train,
                               n_layers=args.n_layers)
            record = study_one(config, data, args, out)
            records.append(record)
            log.info("%s: test acc %.4f, k=2 contrast %.3f, raptor final rel MSE %.4f (%.0f s so far)", record["tag"],
                     record["test_acc"], record["structure"][2]["contrast"], record["models"]["raptor"]["final_rel_mse"],
                     time.perf_counter() - started)
    saved = {"k": args.k, "similarity": args.similarity, "args": vars(args), "environment": environment_info(),
             "seconds": round(time.perf_counter() - started, 1), "records": records}
    write_json(out / "results.json", saved)
    write_outputs(out, json.loads((out / "results.json").read_text()))
    print((out / "table.md").read_text())
    print(f"total {saved['seconds']:.0f} s; report: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
