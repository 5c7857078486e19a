"""Pricing of host offload (`train.offload`, runtime/offload.py): the bytes it takes off the
device, the device memory the update still needs, and the transfer time it adds.

What the runtime does, and so what is priced (per device, with the state sharded over f·t):
  - between steps the offloaded state is not in device memory: the optimizer state of each
    trained model (Adam m and v, 2·N·p bytes, `opt_state_bytes`) and with `+reference` the
    reference's weights leave the resident set, so generation and the scoring passes have it free;
  - an update that takes one optimizer step (rl.ppo_epochs · rl.minibatches = 1) fetches the state
    after its backward pass: its peak is the larger of the backward window (the plain update's
    transients without the guarded new m, v) and the optimizer-step window (gradients, the
    float32 accumulator when micro-batching, the fetched m, v and the new m, v beside them; under
    mixed precision ModelShape.update_state_bytes has no guarded copies and no accumulator, so
    the window is gradients + m, v). An update of several optimizer steps holds the state for the
    whole update (its peak is the plain one's). Never above the plain peak;
  - the reference forward holds the fetched weights while it runs (priced as a weight copy);
  - transfers: 2·S / host_link (in and out, S = the state's bytes on the device) per update call,
    and the reference's bytes / host_link (in only: it is frozen) per reference forward. They are
    priced as NOT overlapped with compute: the copy-in of a one-step update waits for its
    gradients (XLA may start it during the backward's tail, unmeasured), and the copy-out ends the
    program. This is an upper bound on the exposed time.

The link is the hardware profile's `device.host_link_bw` (bytes/s per direction per device;
configs/hardware: GH200 NVLink-C2C 450e9 per direction (900 GB/s total, CSCS node schematic); H100
and H200 SXM on PCIe Gen5 x16, 64e9 nominal, ~55e9 effective). On a CPU without it the "host"
memory is the device's own RAM and a transfer is a copy at half the memory bandwidth (read +
write); a GPU profile without it cannot price offload (an error naming the field).

Callers: costmodel/candidates.py (memory and stage times of each candidate row).
"""

from __future__ import annotations

import numpy as np

from rpeg_jax.costmodel.shape import UPDATE_COPIES, ModelShape

GB = 1e9
OFFLOADS = ("none", "optimizer", "optimizer+reference")


def check_offload(offload: str) -> str:
    if offload not in OFFLOADS:
        raise ValueError(f"train.offload={offload!r}: must be one of {', '.join(OFFLOADS)}")
    return offload


def offloads_optimizer(offload: str) -> bool:
    return check_offload(offload) != "none"


def offloads_reference(offload: str) -> bool:
    return check_offload(offload) == "optimizer+reference"


def host_link_bw(hw) -> float:
    """Bytes/s per direction between one device and host memory."""
    v = getattr(hw.device, "host_link_bw", None)
    if v is not None:
        return float(v)
    if hw.kind == "cpu":
        return hw.device.memory_bw / 2.0
    raise ValueError(f"hardware profile {hw.name!r}: device.host_link_bw is not set (needed to price train.offload)")


def transfer_seconds(nbytes, bw):
    """Seconds to move `nbytes` (per device) over a link of `bw` bytes/s per direction."""
    return np.asarray(nbytes, np.float64) / float(bw)


def opt_state_bytes(ms: ModelShape) -> float:
    """Adam m and v of a model, whole (the cost model keeps them in the parameter dtype, as
    ModelShape.resident_state_bytes does)."""
    return 2.0 * ms.trained_params * ms.param_bytes_per


def resident_bytes(offload: str, ms: ModelShape) -> float:
    """What a trained model keeps in device memory between steps (whole model, before sharding)."""
    return ms.resident_state_bytes() - (opt_state_bytes(ms) if offloads_optimizer(offload) else 0.0)


def offloaded_bytes_per_device(offload: str, trained, ref: ModelShape | None, ft, ft_ref) -> np.ndarray:
    """Bytes per device that `offload` keeps in host memory: the trained models' optimizer states
    over their f·t shards, and the reference's weights over its forward layout's f'·t'."""
    ft, ft_ref = np.asarray(ft, np.float64), np.asarray(ft_ref, np.float64)
    out = np.zeros(np.broadcast(ft, ft_ref).shape)
    if offloads_optimizer(offload):
        out = out + sum(opt_state_bytes(m) for m in trained) / ft
    if ref is not None and offloads_reference(offload):
        out = out + ref.weight_bytes() / ft_ref
    return out


def update_transient(offload: str, ms: ModelShape, plain, f, t, micro, steps: int):
    """Device bytes an update needs beyond the offloaded resident set, from `plain` (the plain
    update's transients beyond its resident state: train_memory - resident_state_bytes / (f·t)).
    `steps`: optimizer steps per update call (rl.ppo_epochs · rl.minibatches)."""
    plain = np.asarray(plain, np.float64)
    if not offloads_optimizer(offload):
        return plain
    ft = np.asarray(f, np.float64) * np.asarray(t, np.float64)
    state = opt_state_bytes(ms) / ft
    if steps != 1:
        return plain + state  # fetched at the start, held to the end
    n = ms.trained_params / ft  # with LoRA the adapters only
    if ms.mixed_precision:  # ModelShape.update_state_bytes: gradients (compute dtype), no guarded copies
        new, acc = 0.0, 0.0
    else:  # the guarded new m, v beside the old ones; the float32 accumulator when micro-batching
        new = UPDATE_COPIES * n * ms.param_bytes_per
        acc = np.where(np.asarray(micro) > 1, 4.0 * n, 0.0)
    grads = n * ms.grad_bytes_per
    return np.maximum(plain - new, grads + acc + state + new)


def update_transfer_seconds(offload: str, hw, ms: ModelShape, f, t):
    """Seconds an update call spends moving its optimizer state in and out (not overlapped)."""
    if not offloads_optimizer(offload):
        return np.zeros(np.broadcast(np.asarray(f), np.asarray(t)).shape)
    ft = np.asarray(f, np.float64) * np.asarray(t, np.float64)
    return transfer_seconds(2.0 * opt_state_bytes(ms) / ft, host_link_bw(hw))


def reference_transfer_seconds(offload: str, hw, ref: ModelShape | None, ff, ft):
    """Seconds a reference forward spends fetching the offloaded weights (in only)."""
    shards = np.asarray(ff, np.float64) * np.asarray(ft, np.float64)
    if ref is None or not offloads_reference(offload):
        return np.zeros(shards.shape)
    return transfer_seconds(ref.weight_bytes() / shards, host_link_bw(hw))
