"""Each rank's random number generators in a checkpoint: Python, numpy, torch, and its own GPU's only."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from clustertrain.distributed.collectives import rank_device


class CudaRng:
    """The CUDA calls of rng_state() and set_rng_state(): one device's generator. A CPU test stands in its own."""

    def get(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set(self, state: torch.Tensor, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)


cuda_rng = CudaRng()


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states of this rank, as JSON: the CUDA one of its own device only."""
    np_state = np.random.get_state()
    device = rank_device()
    return {
        "python": _to_lists(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [cuda_rng.get(device).tolist()] if device.type == "cuda" else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() saved, into this rank's own device.

    The resuming rank may see fewer GPUs than the saving one (srun --gpus-per-task=1 after torchrun, a smaller
    node). Checkpoints from before one entry per rank hold every GPU the rank saw: the entry of this rank's
    device index is taken where there is one, else the first.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    saved, device = state["cuda"], rank_device()
    if saved and device.type == "cuda":
        index = device.index or 0
        own = saved[index] if index < len(saved) else saved[0]
        cuda_rng.set(torch.tensor(own, dtype=torch.uint8), device)


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value
