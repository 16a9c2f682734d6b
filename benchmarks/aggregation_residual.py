"""How much exact aggregation changes: the residual against the round's update, per side.

Runs one quality-bench run (default: ``noniid`` under ``exact``, the default size) and, at every
aggregation (the devices' adapters in the ServerApp's rounds, the server's in its bank), prints

- ``residual/update``: ``||s (mean(BA) - mean(B) mean(A))|| / ||s mean(BA) - s B0 A0||`` over all
  layers (Frobenius), ``B0 A0`` the global product before the round: how much of the round's
  update separate averaging drops;
- ``update cosine``: the mean pairwise cosine of the devices' own updates ``s (B_i A_i - B0 A0)``:
  1 when every device moves the same way (IID-like), lower when the partitions pull apart.

``--bf16`` also saves the last residuals so that ``bf16_fold_loss`` can say how much of them a
bfloat16 base weight keeps. Usage::

    python benchmarks/aggregation_residual.py [--partition iid] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from typing import Any

import fedpipe_bench.quality as quality
import torch

import fedpipe.lora.aggregation as aggregation
from fedpipe.config import FedpipeConfig, parse_overrides
from fedpipe.lora.aggregation import aggregate_adapters

_A, _B = ".lora_A.weight", ".lora_B.weight"
ROWS: list[dict[str, Any]] = []
_PREV: dict[str, dict[str, torch.Tensor]] = {}
LAST_RESIDUALS: dict[str, torch.Tensor] = {}


def _products(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    layers = [k[: -len(_A)] for k in state if k.endswith(_A)]
    return {n: scale * (state[n + _B].float() @ state[n + _A].float()) for n in layers}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(float(t.pow(2).sum()) for t in tensors.values()) ** 0.5)


def _measured(
    states: list[dict[str, torch.Tensor]],
    weights: list[float],
    mode: str,
    *,
    scale: float,
    initial: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """aggregate_adapters, plus a row of statistics about this aggregation."""
    # the side, named by its first LoRA layer (the device's and the server's differ)
    side = sorted(k for k in states[0] if k.endswith(_A))[0][: -len(_A)]
    prev = _products(_PREV.get(side, initial), scale)
    total = sum(weights)
    norm = [w / total for w in weights]
    own = [_products(s, scale) for s in states]
    mean_ba = {n: sum(w * p[n] for w, p in zip(norm, own, strict=True)) for n in prev}
    update = {n: mean_ba[n] - prev[n] for n in prev}
    merged, _ = aggregate_adapters(states, weights, "separate", scale=scale, initial=initial)
    separate = _products(merged, scale)
    residual = {n: mean_ba[n] - separate[n] for n in prev}
    moves = [torch.cat([(p[n] - prev[n]).flatten() for n in sorted(prev)]) for p in own]
    cosines = [
        float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        for a, b in itertools.combinations(moves, 2)
    ]
    ROWS.append(
        {
            "side": side,
            "aggregation": mode,
            "residual_over_update": _norm(residual) / max(_norm(update), 1e-30),
            "update_norm": _norm(update),
            "residual_norm": _norm(residual),
            "update_cosine_mean": sum(cosines) / max(len(cosines), 1),
        }
    )
    print(json.dumps(ROWS[-1]), file=sys.stderr, flush=True)
    LAST_RESIDUALS.update(residual)
    out = aggregate_adapters(states, weights, mode, scale=scale, initial=initial)
    _PREV[side] = out[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partition", default="by-source", help="iid | by-source | dirichlet")
    parser.add_argument("--aggregation", default="exact")
    parser.add_argument("--save", help="save the last residuals (torch.save) here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # Both sides aggregate through aggregate_held, which calls aggregate_adapters per layer
    # group: the ServerApp's exact/stack rules for the devices, the StageServer's bank for its
    # sessions (under `separate` the devices' average is Flower's strategy, not measured here).
    aggregation.aggregate_adapters = _measured  # type: ignore[assignment]
    cfg = FedpipeConfig().with_overrides(
        {
            **quality.COMMON,
            **quality.DEFAULT_SIZE,
            "federated.partition": args.partition,
            "federated.aggregation": args.aggregation,
            **parse_overrides(args.set),
        }
    )
    row = quality._federated(cfg)
    if args.save:
        torch.save(LAST_RESIDUALS, args.save)
    print(json.dumps({"eval_loss": row["eval_loss"], "aggregations": ROWS}, indent=2))


if __name__ == "__main__":
    main()
