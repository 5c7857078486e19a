"""Hardware profiles as data: a device, its node, the network above it, and efficiency tables.

Profiles live in configs/hardware/<name>.yaml (gh200, h100, h200, cpu); `rpeg calibrate` writes a
fitted copy to ~/.cache/rpeg_jax/hardware/<name>.yaml (or $RPEG_CACHE). A run and `rpeg plan` use
the shipped profile unless the config asks for the fitted copy (costmodel.calibration=cached,
costmodel/devices.resolve), so what is in a user's cache never changes a plan unasked; every
loaded profile carries the file it came from (`source`), which plans record. Every number has a
unit in its comment; efficiencies are fractions of the peak and are looked up by size (the form
of Calculon, github.com/calculon-ai/calculon):

    time = work / (peak * eff(size)),  eff interpolated linearly in log(eff) over log(size)

Interpolating log-log keeps time = size / eff(size) monotone between table points whenever it is
monotone at the points (checked on load), which a linear-in-size table would not.

Callers: every module of rpeg_jax.costmodel, `rpeg plan`, `rpeg calibrate`. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import yaml

from rpeg_jax.config.base import ConfigError, build, check, key, to_dict

HARDWARE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "hardware"
)
GB = 1e9

Table = tuple[tuple[float, float], ...]


def check_table(table: Table, path: str) -> None:
    """Sizes strictly increasing and > 0, 0 < eff <= 1, and time = size/eff non-decreasing."""
    check(len(table) >= 1, path, list(table), "needs at least one [size, efficiency] row")
    for i, (size, eff) in enumerate(table):
        check(size > 0, f"{path}[{i}]", [size, eff], "size must be > 0")
        check(0.0 < eff <= 1.0, f"{path}[{i}]", [size, eff], "efficiency must be in (0, 1]")
        if i:
            s0, e0 = table[i - 1]
            check(size > s0, f"{path}[{i}]", [size, eff], f"sizes must increase (previous {s0:g})")
            check(
                eff / e0 <= size / s0 * (1 + 1e-9),
                f"{path}[{i}]",
                [size, eff],
                "efficiency grows faster than size here, so a larger message would take less time",
            )


def interp_eff(table: Table, size):
    """eff(size) for a scalar or array, log-log interpolation, clamped at both ends."""
    xs = np.log([r[0] for r in table])
    ys = np.log([r[1] for r in table])
    x = np.log(np.maximum(np.asarray(size, dtype=np.float64), 1.0))
    return np.exp(np.interp(x, xs, ys))


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    peak_flops: float  # dense bf16/f16 FLOP/s of one device (the host, when shared_host)
    peak_flops_fp32: float  # FLOP/s when the compute dtype is float32
    memory_gb: float  # device memory capacity, GB (1e9 bytes)
    usable_memory_gb: float  # what the allocator can hand out, GB
    memory_bw: float  # device memory bandwidth, bytes/s
    # bytes/s per direction between the device and host memory (train.offload's transfers);
    # None: on a CPU the same RAM (a copy at memory_bw / 2); a GPU profile that offloads must set it
    host_link_bw: float | None = None

    def validate(self, path: str) -> None:
        for name in ("peak_flops", "peak_flops_fp32", "memory_gb", "usable_memory_gb", "memory_bw"):
            v = getattr(self, name)
            check(v > 0, key(path, name), v, "must be > 0")
        if self.host_link_bw is not None:
            check(self.host_link_bw > 0, key(path, "host_link_bw"), self.host_link_bw, "must be > 0")
        check(
            self.usable_memory_gb <= self.memory_gb,
            key(path, "usable_memory_gb"),
            self.usable_memory_gb,
            f"must be <= memory_gb={self.memory_gb}",
        )


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    devices: int  # devices per node
    topology: Literal["mesh", "switch"] = "switch"  # mesh: a link per device pair; switch: NVSwitch-like
    link_bw: float  # bytes/s per direction: per pair (mesh) or per device into the switch
    latency_s: float  # α of one collective step inside the node, s

    def validate(self, path: str) -> None:
        check(self.devices >= 1, key(path, "devices"), self.devices, "must be >= 1")
        check(self.link_bw > 0, key(path, "link_bw"), self.link_bw, "must be > 0")
        check(self.latency_s >= 0, key(path, "latency_s"), self.latency_s, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    nic_bw: float  # bytes/s per device per direction into the network
    latency_s: float  # α of one collective step across nodes, s
    group_devices: int  # devices in one group (dragonfly group / leaf domain) above the node
    global_taper: float = 1.0  # ≥ 1: bandwidth divisor once a collective spans several groups

    def validate(self, path: str) -> None:
        check(self.nic_bw > 0, key(path, "nic_bw"), self.nic_bw, "must be > 0")
        check(self.latency_s >= 0, key(path, "latency_s"), self.latency_s, "must be >= 0")
        check(self.group_devices >= 1, key(path, "group_devices"), self.group_devices, "must be >= 1")
        check(self.global_taper >= 1.0, key(path, "global_taper"), self.global_taper, "must be >= 1")


ACCELERATOR_CONSTANTS = ("train_matmul_cap", "sync_fixed_s", "sync_bucket_bytes", "sync_bucket_s")


@dataclass(frozen=True, kw_only=True)
class EfficiencySpec:
    matmul: Table  # [FLOPs of one matmul, fraction of peak_flops]
    memory: Table  # [bytes of one streaming access, fraction of memory_bw]
    intra_node: Table  # [message bytes, busbw / node line rate]
    inter_node: Table  # [message bytes, busbw / nic_bw]
    overlap: float = 0.5  # fraction of overlappable collective time hidden behind compute
    dispatch_s: float = 1e-4  # host cost of one jitted call, s
    layer_s: float = 2e-5  # fixed cost per layer per pass (launches inside the layer scan), s
    decode_step_s: float = 3e-5  # fixed cost per decode step (host sync, sampling), s
    piece_s: float = 0.0  # runtime cost per streamed piece beyond the first (a generate call's host work,
    #   laying the piece out, moving it to the training group, concatenating), s; fitted on whole steps
    gen_seq_s: float = 0.0  # the sampler's host cost per generated sequence (admission, page allocation,
    #   block tables, stop checks, results), s; fitted on generation stage points
    host_seq_s: float = 0.0  # runtime host cost per sequence per step (rows, reward, bookkeeping), s
    admission_group_s: float = 4.7e-3  # host cost per group admitted under continuous admission (the
    #   engine's bookkeeping, runtime/rollout/continuous.py, and its own prefill call), s: the default config's
    #   step took 0.434 s with it against 0.359 s without (16 groups, bench/NOTES.md session 10); not fitted
    host_step_s: float = 0.0  # runtime host cost per step whatever its size (data, scheduling, metrics), s;
    #   fitted on whole steps of two batch sizes (with host_seq_s and piece_s)
    contention: float = 0.0  # shared host: throughput lost to device programs beyond the cores,
    #   total rate x (host_cores / busy)^contention (fitted)
    decode_layer_s: float | None = None  # fixed cost per layer per decode step (page-table gathers,
    #   KV writes, launches), s; None -> layer_s
    kv_read_factor: float = 2.0  # KV bytes moved per cached byte per step (gather attention copies pages)
    kv_attend_bw: float | None = None  # shared host (CPU): bytes/s at which a decode step's attention
    #   gets through its cached KV (calibrate.bench_kv_attend: the chunk attention's batched products
    #   over dense buffers, the slope of its time over key widths); None: the memory table. A decode
    #   step's K.q and p.V run at ~10 GB/s on the 2-core CPU where the memory table, page faults and
    #   all, said 3.8-9 GB/s from one day to the next (bench/NOTES.md session 17)
    decode_tp_factor: float = 1.0  # the sampler's tensor-parallel collective time per decode / prefill
    #   layer, in units of 2 all-reduces of the hidden state (fitted, >= 1; the CPU sampler's fused
    #   q/k/v and gate/up products also reshard their outputs every layer)
    matmul_size_exponent: float = 1.0  # how steeply matmul efficiency falls with size: eff(size)^this
    #   (1 = the table as written; 0 = size-independent); fitted on a shared CPU host, where the
    #   small per-device GEMMs lost less than the accelerator-shaped table says
    elementwise_factor: float = 1.0  # fitted multiplier on the elementwise kernels' activation traffic
    backward_factor: float = 1.0  # backward time / (2 x forward time) of the same layers (fitted)
    update_streams: float = 7.0  # parameter-sized arrays the optimizer step streams per parameter shard:
    #   AdamW reads params, grads, m, v and writes params, m, v (7); a compiler's extra copies
    #   (stacked-layer gradient assembly, guards, norms) add more (fitted)
    weight_copies: float = 0.0  # extra copies of a pass's weights (per device, in its layout) the compiler
    #   keeps, e.g. per-layer slices of the stacked weights (fitted; memory only)
    act_memory_factor: float = 1.0  # measured / counted activation and logits working set of a training
    #   step (fitted)
    fwd_act_memory_factor: float = 1.0  # the same for a forward-only pass: one layer's live set, which
    #   the compiler's fusion shrinks (fitted)
    gen_memory_factor: float = 1.0  # the sampler's decode working set / the KV it gathers to dense
    #   buffers (one layer's pages; on a CPU every layer's, the "chunk" attention), fitted on the
    #   compiled memory of the sampler's programs (bench/costmodel_validate.py --gen-memory)
    fsdp_gather: Literal["matrix", "layer", "model"] = "matrix"  # what an FSDP pass holds gathered at once:
    #   two weight matrices (gathered right before use), two layers, or every layer (the compiler
    #   hoists the gathers out of the layer scan; XLA:CPU does); fitted by calibration
    # Constants of a real RL trainer on accelerators (docs/costmodel.md, "Accelerator constants"):
    # set in every GPU preset (configs/hardware/*.yaml says where each number comes from), unset
    # (null) on the CPU profile, where they mean no cap and no cost. A GPU profile must set them.
    train_matmul_cap: float | None = None  # highest fraction of peak_flops a matmul of the trainer's
    #   passes (updates and scoring forwards) reaches: the matmul table's value is capped at it, so
    #   the trainer's end-to-end MFU lands where published RL and pretraining runs are; null: no cap
    sync_fixed_s: float | None = None  # fixed seconds of one weight sync (train -> rollout) whatever
    #   the model's size: the engine's pause, cache reset and resume, the controller's round trips
    sync_bucket_bytes: float | None = None  # bytes of one weight-sync bucket: the sync streams the
    #   rollout weights in ceil(weight bytes / this) buckets
    sync_bucket_s: float | None = None  # seconds per bucket beyond moving its bytes: packing it, the
    #   IPC handle or NCCL call, the engine's load_weights over its tensors

    def validate(self, path: str) -> None:
        for name in ("matmul", "memory", "intra_node", "inter_node"):
            check_table(getattr(self, name), key(path, name))
        check(0.0 <= self.overlap <= 1.0, key(path, "overlap"), self.overlap, "must be in [0, 1]")
        check(self.kv_read_factor >= 1.0, key(path, "kv_read_factor"), self.kv_read_factor, "must be >= 1")
        if self.kv_attend_bw is not None:
            check(self.kv_attend_bw > 0, key(path, "kv_attend_bw"), self.kv_attend_bw, "must be > 0 (or null)")
        check(self.decode_tp_factor >= 1.0, key(path, "decode_tp_factor"), self.decode_tp_factor, "must be >= 1")
        check(
            0.0 <= self.matmul_size_exponent <= 2.0,
            key(path, "matmul_size_exponent"),
            self.matmul_size_exponent,
            "must be in [0, 2]",
        )
        check(self.elementwise_factor > 0, key(path, "elementwise_factor"), self.elementwise_factor, "must be > 0")
        check(0.0 <= self.contention <= 4.0, key(path, "contention"), self.contention, "must be in [0, 4]")
        check(self.backward_factor > 0, key(path, "backward_factor"), self.backward_factor, "must be > 0")
        check(self.host_step_s >= 0, key(path, "host_step_s"), self.host_step_s, "must be >= 0")
        check(self.update_streams > 0, key(path, "update_streams"), self.update_streams, "must be > 0")
        check(self.weight_copies >= 0, key(path, "weight_copies"), self.weight_copies, "must be >= 0")
        check(self.act_memory_factor > 0, key(path, "act_memory_factor"), self.act_memory_factor, "must be > 0")
        check(self.gen_memory_factor > 0, key(path, "gen_memory_factor"), self.gen_memory_factor, "must be > 0")
        check(
            self.fwd_act_memory_factor > 0,
            key(path, "fwd_act_memory_factor"),
            self.fwd_act_memory_factor,
            "must be > 0",
        )
        check(
            self.fsdp_gather in ("matrix", "layer", "model"),
            key(path, "fsdp_gather"),
            self.fsdp_gather,
            "must be matrix | layer | model",
        )
        for name in (
            "dispatch_s",
            "layer_s",
            "decode_step_s",
            "piece_s",
            "host_seq_s",
            "gen_seq_s",
            "admission_group_s",
        ):
            v = getattr(self, name)
            check(v >= 0, key(path, name), v, "must be >= 0")
        if self.decode_layer_s is not None:
            check(self.decode_layer_s >= 0, key(path, "decode_layer_s"), self.decode_layer_s, "must be >= 0")
        if self.train_matmul_cap is not None:
            check(
                0.0 < self.train_matmul_cap <= 1.0,
                key(path, "train_matmul_cap"),
                self.train_matmul_cap,
                "must be in (0, 1] (a fraction of peak_flops)",
            )
        for name in ("sync_fixed_s", "sync_bucket_s"):
            v = getattr(self, name)
            if v is not None:
                check(v >= 0, key(path, name), v, "must be >= 0 (seconds)")
        if self.sync_bucket_bytes is not None:
            check(self.sync_bucket_bytes > 0, key(path, "sync_bucket_bytes"), self.sync_bucket_bytes, "must be > 0")

    def require_accelerator_constants(self, path: str) -> None:
        """An accelerator profile states every trainer constant (no silent 'free' weight sync)."""
        for name in ACCELERATOR_CONSTANTS:
            check(
                getattr(self, name) is not None,
                key(path, name),
                None,
                "missing: a gpu/tpu profile must set it (configs/hardware/h100.yaml shows the form)",
            )

    @property
    def matmul_cap(self) -> float:
        """train_matmul_cap, 1 (no cap) when unset."""
        return 1.0 if self.train_matmul_cap is None else self.train_matmul_cap

    @property
    def decode_layer(self) -> float:
        return self.layer_s if self.decode_layer_s is None else self.decode_layer_s


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    kind: Literal["gpu", "cpu", "tpu"] = "gpu"
    shared_host: bool = False  # devices are slices of one host sharing its cores and bandwidth
    host_cores: int = 1  # cores of that host (shared_host only)
    # shared_host only: each JAX process runs on cores of its own, `host_cores` of them (local processes
    # pinned with taskset, as bench R2-MP runs; a node per process), so a process's devices share its
    # cores only and device groups of different processes run side by side (false: every process shares
    # the one host's cores)
    process_hosts: bool = False
    local_devices: int = 0  # with process_hosts: devices per process (set by costmodel.context for the run)
    device: DeviceSpec
    node: NodeSpec
    network: NetworkSpec
    efficiency: EfficiencySpec
    calibrated: dict[str, float] = field(default_factory=dict)  # fit residuals etc. written by calibrate
    source: str = field(default="", compare=False)  # the file it was read from (load_hardware); not saved

    def validate(self, path: str) -> None:
        check(bool(self.name), key(path, "name"), self.name, "must not be empty")
        if self.kind != "cpu":
            self.efficiency.require_accelerator_constants(key(path, "efficiency"))
        check(self.host_cores >= 1, key(path, "host_cores"), self.host_cores, "must be >= 1")
        check(
            self.network.group_devices >= self.node.devices,
            key(path, "network.group_devices"),
            self.network.group_devices,
            f"must be >= node.devices={self.node.devices}",
        )

    # Convenience views used throughout the cost model.
    @property
    def hbm_bytes(self) -> float:
        return self.device.usable_memory_gb * GB

    def peak(self, dtype: str) -> float:
        return self.device.peak_flops_fp32 if dtype == "float32" else self.device.peak_flops

    def node_bw(self, k) -> np.ndarray:
        """Ring busbw ceiling of k devices of one node, bytes/s. On a pairwise mesh, k-1 disjoint
        rings can run at once (a 4-GPU GH200 node, fully connected,
        holds 3 edge-disjoint directed rings: 3 × 150 GB/s)."""
        k = np.asarray(k, dtype=np.float64)
        if self.node.topology == "mesh":
            return self.node.link_bw * np.maximum(k - 1.0, 1.0)
        return np.full_like(k, self.node.link_bw)

    def to_dict(self) -> dict:
        return to_dict(self)


def profile_path(name: str) -> str:
    return os.path.join(HARDWARE_DIR, f"{name}.yaml")


def calibrated_path(name: str) -> str:
    root = os.environ.get("RPEG_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rpeg_jax"))
    return os.path.join(root, "hardware", f"{name}.yaml")


def known_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".yaml"))


def from_dict(data: dict, path: str = "hardware") -> HardwareProfile:
    """Build and validate a profile from a plain dict (errors name the dotted key and value)."""
    if not isinstance(data, dict):
        raise ConfigError(path, data, "a hardware profile must be a mapping")
    if "source" in data:
        raise ConfigError(f"{path}.source", data["source"], "is the file a profile is read from, not a field of it")
    return build(HardwareProfile, data, path)


def is_path(name_or_path: str) -> bool:
    return name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path


def load_hardware(name_or_path: str, calibrated: bool = False) -> HardwareProfile:
    """A profile by preset name (configs/hardware/) or YAML path. `calibrated`: the fitted copy
    `rpeg calibrate` cached for that name (calibrated_path) instead, when there is one."""
    if is_path(name_or_path):
        path = name_or_path
    else:
        path = profile_path(name_or_path)
        if calibrated and os.path.isfile(calibrated_path(name_or_path)):
            path = calibrated_path(name_or_path)
        elif not os.path.isfile(path):
            raise ConfigError(
                "costmodel.hardware", name_or_path, f"unknown hardware profile; known: {', '.join(known_profiles())}"
            )
    if not os.path.isfile(path):
        raise ConfigError("costmodel.hardware", name_or_path, "file not found")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError("costmodel.hardware", path, f"invalid YAML: {str(e).splitlines()[0]}") from None
    out = from_dict(data, f"hardware[{os.path.basename(path)}]")
    return dataclasses.replace(out, source=os.path.abspath(path))


def describe_source(hw: HardwareProfile) -> str:
    """'cpu from /path/cpu.yaml (calibrated, written 2026-12-04 03:30)' for logs and plans."""
    if not hw.source:
        return f"{hw.name} (given as an object)"
    what = "shipped" if os.path.dirname(hw.source) == os.path.abspath(HARDWARE_DIR) else "file"
    if hw.calibrated or hw.source == os.path.abspath(calibrated_path(hw.name)):
        when = ""
        if os.path.isfile(hw.source):
            when = time.strftime(", written %Y-%m-%d %H:%M", time.localtime(os.path.getmtime(hw.source)))
        what = f"calibrated{when}"
    return f"{hw.name} from {hw.source} ({what})"


def save_hardware(profile: HardwareProfile, path: str) -> str:
    """Write a profile as YAML (atomically: a temp file renamed into place)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    data = _plain(to_dict(profile))
    data.pop("source")  # where it is read from is where it is
    with open(tmp, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    os.replace(tmp, path)
    return path


def _plain(x):
    """numpy scalars -> Python numbers (yaml.safe_dump writes plain types only)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def with_nodes(profile: HardwareProfile, **changes) -> HardwareProfile:
    """A copy with some top-level sections replaced (used by calibration and tests)."""
    out = dataclasses.replace(profile, **changes)
    out.validate("hardware")
    return out
