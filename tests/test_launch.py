"""mla.kernels.launch: the shared-memory fit and the device guard of the Triton ops (their GPU
side runs in the GPU tests and in tests/test_triton_compile.py's compile for a 99 KB GPU)."""

import pytest
import torch
import triton

import mla.kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU machine)
from mla.kernels import launch as launch_module
from mla.kernels.launch import launch_fitting, on_the_gpu_of_its_first_tensor, step_down

ORDER = (("num_stages", 1), ("BLOCK_N", 16), ("BLOCK_M", 16))


def test_step_down_lowers_stages_then_halves_tiles_in_order():
    config = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2, "num_warps": 8}
    seen = [config]
    while (config := step_down(config, ORDER)) is not None:
        seen.append(config)
    assert [(c["num_stages"], c["BLOCK_N"], c["BLOCK_M"]) for c in seen] == [(2, 32, 32), (1, 32, 32), (1, 16, 32),
                                                                            (1, 16, 16)]
    assert all(c["num_warps"] == 8 for c in seen)


class FakeGPU:
    """Refuses every configuration whose tile is above ``fits`` tokens, as Triton does for its
    shared memory: before anything runs."""

    def __init__(self, fits):
        self.fits, self.tried, self.ran = fits, [], []

    def __call__(self, config):
        self.tried.append(config)
        if config["BLOCK_N"] * config["num_stages"] > self.fits:
            raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        self.ran.append(config)


def test_launch_fitting_steps_down_once_then_remembers(monkeypatch):
    monkeypatch.setattr(launch_module, "_FITTED", {})
    default = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3}
    gpu = FakeGPU(fits=32)
    ran = launch_fitting(gpu, default, ("op", "cuda:0"), ORDER)
    assert ran == {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1} and gpu.ran == [ran] and len(gpu.tried) == 4
    # the same kind of call again: the fitted configuration first, nothing refused
    assert launch_fitting(gpu, default, ("op", "cuda:0"), ORDER) == ran and len(gpu.tried) == 5
    # another key starts from its own default
    launch_fitting(FakeGPU(fits=1000), default, ("op", "cuda:1"), ORDER)
    assert launch_module._FITTED[("op", "cuda:1", tuple(sorted(default.items())))] == default


def test_launch_fitting_raises_when_the_smallest_does_not_fit_and_passes_other_errors(monkeypatch):
    monkeypatch.setattr(launch_module, "_FITTED", {})
    with pytest.raises(triton.runtime.errors.OutOfResources):
        launch_fitting(FakeGPU(fits=8), {"BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 2}, ("op",), ORDER)

    def broken(config):
        raise ValueError("not a shared-memory refusal")
    with pytest.raises(ValueError, match="not a shared-memory refusal"):
        launch_fitting(broken, {"BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 2}, ("op",), ORDER)
    assert launch_module._FITTED == {}


def test_device_guard_passes_cpu_calls_through_by_position_and_by_name():
    @on_the_gpu_of_its_first_tensor
    def op(q, k, *, scale=1.0):
        """Doc."""
        return q * k * scale

    x = torch.ones(2)
    assert torch.equal(op(x, x, scale=2.0), 2 * x) and torch.equal(op(q=x, k=x), x)
    assert op.__doc__ == "Doc." and op.__wrapped__.__name__ == "op"
