"""What the planner knows about a device and the links between devices.

    device = device_spec("H100")                     # by name (datasheet figures)
    device = device_spec("cpu")                      # this machine's CPU, measured
    cluster = Cluster(device, devices=64, nodes=8)   # 8 devices per node
    cluster = with_overrides(cluster, memory="80GB", link="intra=450GB/s,inter=50GB/s")

Sizes are binary: "80GB" means 80 x 2^30 bytes, the unit torch and nvidia-smi report
memory in (so an "80GB" H100 shows 79.2 GB usable: `total_memory` is 85.0e9 bytes).
Bandwidths are decimal, per direction, per device: "450GB/s" = 450e9 bytes a second
leaving each device, the figure datasheets quote for NVLink and InfiniBand.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from polytrain.errors import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator as the estimates see it."""

    name: str
    memory_bytes: float
    """Memory a process can allocate on one device."""
    peak_flops: dict[str, float]
    """Dense matmul FLOP/s by compute precision: 'fp32' (what fp32 training runs at) and 'bf16'/'fp16'."""
    intra_node_bw: float
    """Bytes/s one device sends to the others of its node (NVLink, Infinity Fabric, shared memory)."""
    inter_node_bw: float
    """Bytes/s one device sends off its node (its share of the node's network)."""
    host_memory_bytes: float
    """Host memory per node (where parallel.offload = cpu puts optimizer state)."""
    memory_bw: float = 3e12
    """Bytes/s of the device's own memory (the optimizer step is bound by it)."""
    host_link_bw: float = 25e9
    """Bytes/s between a device and host memory (PCIe); offload's transfers."""
    host_adam_params_per_s: float = 2e9
    """Parameters a node's CPUs step with Adam per second (offload: the optimizer runs there)."""
    context_bytes: float = 1.0 * GiB
    """Per-process memory before the model exists: runtime, communicator buffers, allocator slack."""
    efficiency: float = 0.42
    """Share of peak FLOP/s large training matmuls reach: the MFU of a well-sized model (torchtitan's
    8B FSDP on 8 H100 reaches 34-39%, nanotron's 1-9B 44-47%)."""
    gemm_knee: float = 128.0
    """Matmul size (rows, or columns) at which a dimension costs half the efficiency: thin matmuls are slow."""
    comm_efficiency: float = 0.8
    """Share of the link bandwidth a ring collective reaches."""
    cores_per_node: int = 0
    """CPU only: cores the ranks of one node share (0 = not a CPU: each rank has its own device)."""

    def flops(self, precision: str) -> float:
        """Peak FLOP/s of this device's matmuls at `precision` (fp16 falls back to bf16's rate)."""
        table = self.peak_flops
        return table.get(precision) or table.get("bf16" if precision == "fp16" else "fp32") or table["fp32"]


# Datasheet figures: dense peaks (no sparsity), memory as torch reports it, NVLink /
# Infinity Fabric per direction, one 400 Gb/s (NDR) or 200 Gb/s (HDR) NIC per device.
_TABLE = {
    "H100": Device("H100 SXM 80GB", 79.2 * GiB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                   intra_node_bw=450e9, inter_node_bw=50e9, host_memory_bytes=2048 * GiB, memory_bw=3.35e12),
    "H200": Device("H200 SXM 141GB", 139.8 * GiB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                   intra_node_bw=450e9, inter_node_bw=50e9, host_memory_bytes=2048 * GiB, memory_bw=4.8e12),
    "A100": Device("A100 SXM 80GB", 79.2 * GiB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                   intra_node_bw=300e9, inter_node_bw=25e9, host_memory_bytes=1024 * GiB, memory_bw=2.0e12),
    "A100-40GB": Device("A100 SXM 40GB", 39.4 * GiB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                        intra_node_bw=300e9, inter_node_bw=25e9, host_memory_bytes=1024 * GiB, memory_bw=1.55e12),
    "MI300X": Device("MI300X 192GB", 191.5 * GiB, {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163.4e12},
                     intra_node_bw=448e9, inter_node_bw=50e9, host_memory_bytes=2048 * GiB, memory_bw=5.3e12),
}
ALIASES = {"H100-80GB": "H100", "H100-SXM": "H100", "H200-141GB": "H200", "A100-80GB": "A100",
           "MI300": "MI300X"}

# The CPU: measured, not looked up. Ranks on one host share its cores and its memory;
# gloo moves about this much per rank and second between processes of one host
# (benchmarks/plan_validation.py measures it; --link overrides).
CPU_LOOPBACK_BW = 1.0e9
CPU_EFFICIENCY = 0.5
CPU_MEMORY_BW = 10e9


def device_names() -> list[str]:
    """Names `device_spec` accepts, for messages."""
    return [*_TABLE, "cpu"]


def device_spec(name: str) -> Device:
    """The Device called `name` (case-insensitive; 'cpu' measures this machine)."""
    key = name.strip().upper().replace(" ", "-")
    key = ALIASES.get(key, key)
    if key == "CPU":
        return measured_cpu()
    if key not in _TABLE:
        raise ConfigError(f"unknown device '{name}'; known: {', '.join(device_names())}, or give "
                          f"--device-memory, --device-flops and --link for another")
    return _TABLE[key]


def measured_cpu() -> Device:
    """This machine's CPU: matmul FLOP/s measured (and cached), host memory, one 'device' per rank."""
    import torch

    from polytrain.backend import host_gemm
    from polytrain.backend.flops import cpu_model, cpu_peak_flops
    from polytrain.backend.host_device import host_memory_info

    # Peaks are measured with torch's current thread count; the estimate hands each rank
    # its share of the node's cores, so store the per-core rate times the cores.
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    scale = cores / threads
    peaks = {key: cpu_peak_flops(dtype) * scale for key, dtype in
             (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    # Where the CPU emulates a 16-bit GEMM, training in that precision runs its products as fp32
    # GEMMs (train.matmul_fp32 auto): fp32's rate, not the emulation's.
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if host_gemm.emulates(dtype):
            peaks[key] = peaks["fp32"]
    _, total = host_memory_info()
    return Device(f"CPU {cpu_model()} ({cores} cores)", float(total), peaks,
                  intra_node_bw=CPU_LOOPBACK_BW, inter_node_bw=CPU_LOOPBACK_BW / 4,
                  host_memory_bytes=float(total), host_link_bw=0.0, memory_bw=CPU_MEMORY_BW,
                  context_bytes=CPU_CONTEXT_BYTES, efficiency=CPU_EFFICIENCY, gemm_knee=16.0,
                  cores_per_node=cores)


def device_for_accelerator(acc) -> Device:
    """The Device this process runs on: the measured CPU, a known GPU by its name, else the accelerator's
    own peak (datasheet or measured) with an H100's memory and links (an elastic restart's planner needs
    some figure)."""
    if acc.device_type == "cpu":
        return measured_cpu()
    name = acc.device_name().upper()
    for key in sorted(_TABLE, key=len, reverse=True):  # "A100-40GB" before "A100"
        if key.replace("-", " ") in name.replace("-", " "):
            return _TABLE[key]
    import torch

    peaks = {"bf16": acc.peak(torch.bfloat16).flops, "fp32": acc.peak(torch.float32).flops}
    return replace(_TABLE["H100"], name=acc.device_name(), peak_flops=peaks)


CPU_CONTEXT_BYTES = 0.35 * GiB
"""Resident memory of a CPU rank before its model exists (torch, gloo, the data, Python)."""


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str, what: str = "--device-memory") -> float:
    """'80GB', '80G', '80GiB' or '85899345920' -> bytes (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{what} = {text!r} is not a size; write e.g. 80GB")
    unit = (match.group(2) or "").lower()[:1]
    return float(match.group(1)) * _BINARY[unit]


def parse_rate(text: str, what: str) -> float:
    """'450GB/s' (bytes), '400Gb/s' (bits) or a plain number of bytes/s -> bytes/s (decimal units)."""
    match = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)([bB]?)(?:/s|ps)?\s*$", str(text))
    if not match:
        raise ConfigError(f"{what} = {text!r} is not a bandwidth; write e.g. 450GB/s or 400Gb/s")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2).lower()]
    return value / 8 if match.group(3) == "b" else value


def parse_flops(text: str) -> float:
    """'989T', '989e12' or '989TFLOPS' -> FLOP/s."""
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]?)(?:flops?(?:/s)?)?\s*$", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"--device-flops = {text!r} is not a rate; write e.g. 989T")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[match.group(2).lower()]


LINK_PRESETS = {"nvlink": 450e9, "nvlink3": 300e9, "xgmi": 448e9, "pcie": 25e9, "ib": 50e9,
                "ndr": 50e9, "hdr": 25e9, "ethernet": 12.5e9}


def parse_link(text: str) -> dict[str, float]:
    """'--link' values: 'nvlink', '450GB/s' (inside a node), or 'intra=450GB/s,inter=ib'."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key, value = (key.strip().lower(), value.strip()) if sep else ("intra", key.strip())
        if key not in ("intra", "inter"):
            raise ConfigError(f"--link part {part!r}: name 'intra' (inside a node) or 'inter' (between nodes)")
        out[key] = LINK_PRESETS.get(value.lower()) or parse_rate(value, f"--link {key}")
    return out


@dataclass(frozen=True)
class Cluster:
    """`devices` devices of one kind on `nodes` nodes (the same number on each)."""

    device: Device
    devices: int
    nodes: int = 1

    def __post_init__(self):
        if self.devices < 1 or self.nodes < 1:
            raise ConfigError(f"--devices = {self.devices} and --nodes = {self.nodes} must be positive")
        if self.devices % self.nodes:
            raise ConfigError(f"--devices = {self.devices} does not split evenly over --nodes = {self.nodes}; "
                              f"use a multiple of {self.nodes}")

    @property
    def per_node(self) -> int:
        return self.devices // self.nodes

    def group_bandwidth(self, span: int) -> float:
        """Bytes/s per device for a collective over `span` consecutive ranks (inside a node if it fits)."""
        d = self.device
        return (d.intra_node_bw if span <= self.per_node else d.inter_node_bw) * d.comm_efficiency

    def rank_share(self) -> float:
        """Share of one device's peak a rank gets: 1 on accelerators; a CPU's cores split over its ranks."""
        cores = self.device.cores_per_node
        return 1.0 if not cores else 1.0 / self.per_node


def with_overrides(cluster: Cluster, memory: str | None = None, link: str | None = None,
                   flops: str | None = None) -> Cluster:
    """`cluster` with the device's memory, bandwidths or peak replaced by command-line values."""
    device = cluster.device
    if memory:
        device = replace(device, memory_bytes=parse_size(memory))
    if link:
        links = parse_link(link)
        device = replace(device, intra_node_bw=links.get("intra", device.intra_node_bw),
                         inter_node_bw=links.get("inter", device.inter_node_bw))
    if flops:
        rate = parse_flops(flops)
        device = replace(device, peak_flops={"fp32": rate, "bf16": rate, "fp16": rate})
    return replace(cluster, device=device)
