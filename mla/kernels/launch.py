"""How the Triton kernels are launched on a GPU that is not the one their defaults are tuned on.

Two things Triton leaves to its caller:

- **The device.** Triton compiles for and launches on the current CUDA device, not on its
  arguments' (``on_the_gpu_of_its_first_tensor``); a model spread over several GPUs in one
  process would launch on the wrong one. The CUDA ops guard their device themselves.
- **Shared memory.** The default tiles are tuned on an H100 / H200 (227 KB a block); an RTX 4090,
  L40 or A10 has 99 KB. Triton refuses a kernel that needs more before it launches, so
  ``launch_fitting`` tries smaller configurations until one fits, and remembers it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import triton

# the configuration that fitted, for each (kernel's key, default configuration) that did not
_FITTED: dict[tuple, dict] = {}


def on_the_gpu_of_its_first_tensor(op):
    """``op`` run with its first argument's GPU as the current device."""
    name = next(iter(inspect.signature(op).parameters))

    @functools.wraps(op)
    def on_its_gpu(*args, **kwargs):
        first = args[0] if args else kwargs.get(name)
        if isinstance(first, torch.Tensor) and first.device.type == "cuda":
            with torch.cuda.device(first.device):
                return op(*args, **kwargs)
        return op(*args, **kwargs)
    return on_its_gpu


def launch_fitting(launch: Callable[[dict], None], config: dict, key: tuple,
                   order: tuple[tuple[str, int], ...]) -> dict:
    """``launch(config)``, or the configurations ``step_down`` makes of it in ``order``, one
    after the other, while the GPU refuses them for their shared memory; returns the
    configuration that ran. A refused try writes nothing (Triton checks before it launches).
    ``key`` names the call's kind (its device, sizes and dtypes): the configuration that fits
    it is remembered, so the steps down are compiled once. Past the smallest, the refusal is
    raised."""
    key = (*key, tuple(sorted(config.items())))
    config = _FITTED.get(key, config)
    while True:
        try:
            launch(config)
        except triton.runtime.errors.OutOfResources:
            config = step_down(config, order)
            if config is None:
                raise
            continue
        _FITTED[key] = config
        return config


def step_down(config: dict, order: tuple[tuple[str, int], ...]) -> dict | None:
    """The next configuration down: the first of ``order``'s (key, floor) pairs above its floor
    is lowered (``num_stages`` by one, a tile size halved); None when all are at their floors."""
    for name, floor in order:
        if config[name] > floor:
            return dict(config, **{name: config[name] - 1 if name == "num_stages" else config[name] // 2})
    return None
