"""The ViT teacher's dynamics beside two null models, over seeds (issue 40, item 5).

Per seed s (of ``seeds``): a seeded half of the held-out images and a seeded perturbation draw, on

* ``trained``: the teacher;
* ``random_init``: a ViT of the teacher's shape, freshly initialised with seed s (what an untrained
  residual stream of this shape does on its own);
* ``shuffled_depth``: the teacher's own layers applied in an order permuted with seed s (the same
  weights, without the order training gave them).

Each run is measured exactly as the teacher is (:func:`rdepth.surrogate.vision.vision_dynamics`) and
the findings are judged against the nulls by :func:`rdepth.surrogate.measure.null.judge`.
"""

from __future__ import annotations

import torch

from rdepth.surrogate.measure.basins import findings
from rdepth.surrogate.measure.null import judge
from rdepth.surrogate.teachers.vit import ViTClassifier, ViTConfig


def shuffled_order(n_layers: int, seed: int) -> list[int]:
    """A permutation of the layers that moves at least one (seeded; the identity is redrawn)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n_layers, generator=generator).tolist()
        if n_layers < 2 or order != list(range(n_layers)):
            return order


@torch.no_grad()
def ordered_states(backbone, layers: list, images: torch.Tensor) -> torch.Tensor:
    """Residual states (L+1, N, T, D): the backbone's embedding of ``images``, then ``layers`` in turn."""
    state = backbone.embedding(images)
    states = [state]
    for layer in layers:
        state = layer(state)
        states.append(state)
    return torch.stack(states)


def random_init_like(vit_config: dict, seed: int) -> ViTClassifier:
    """A ViT of the teacher's shape (``vit_config``: the saved ``vit`` record), initialised with ``seed``."""
    torch.manual_seed(seed)
    model = ViTClassifier(ViTConfig(**vit_config))
    return model.eval()


@torch.no_grad()
def null_dynamics(model: ViTClassifier, vit_config: dict, images: torch.Tensor, labels: torch.Tensor, seeds: int,
                  relative: float, measure) -> dict:
    """The dynamics of the trained model and of both nulls for seeds 0..seeds-1, and the judged findings.

    ``images`` (N, 1, H, W), ``labels`` (N,): the held-out set; ``measure(step, states, mask, labels, seed)``
    returns one model's dynamics dict (the vision pipeline's measurement). Returns {"seeds", "images_per_seed",
    "trained", "random_init", "shuffled_depth" (lists of dynamics, one per seed), "orders" (the shuffled layer
    orders), "verdicts" (:func:`judge`)}.
    """
    backbone = model.backbone.eval()
    per_seed = max(2, len(images) // 2)
    runs: dict[str, list] = {"trained": [], "random_init": [], "shuffled_depth": []}
    orders = []
    for seed in range(seeds):
        pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:per_seed]
        x, y = images[pick], labels[pick]
        layers = list(backbone.layers)
        states = ordered_states(backbone, layers, x)
        mask = torch.ones(states.shape[1:3], dtype=torch.bool)
        runs["trained"].append(measure(lambda s, d, layers=layers: layers[d](s), states, mask, y, seed))
        fresh = random_init_like(vit_config, seed).backbone
        fresh_layers = list(fresh.layers)
        runs["random_init"].append(measure(lambda s, d, f=fresh_layers: f[d](s), ordered_states(fresh, fresh_layers, x),
                                           mask, y, seed))
        order = shuffled_order(len(layers), seed)
        orders.append(order)
        shuffled = [layers[i] for i in order]
        runs["shuffled_depth"].append(measure(lambda s, d, f=shuffled: f[d](s), ordered_states(backbone, shuffled, x),
                                              mask, y, seed))
    own = [findings({"trained": d}, "trained") for d in runs["trained"]]
    verdicts = judge(runs["trained"], {"random_init": runs["random_init"], "shuffled_depth": runs["shuffled_depth"]},
                     own)
    return {"seeds": seeds, "images_per_seed": per_seed, **runs, "orders": orders, "verdicts": verdicts}
