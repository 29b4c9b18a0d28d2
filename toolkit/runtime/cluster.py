"""The hardware vocabulary of the project: a GPU, its links, how ranks sit on nodes — and named presets.

One description serves every cost model and the emulated cluster (``toolkit.runtime.emulator``)::

    Cluster "h100-ib400"
      gpu      H100 SXM     989 TFLOP/s dense bf16 · 3.35 TB/s HBM · 4 µs per kernel launch
      node     8 GPUs       ──── intra link (NVLink 4 through NVSwitch): 450 GB/s, α 5 µs per direction
      network  1 NIC / GPU  ──── inter link (InfiniBand NDR 400 Gb/s):     46 GB/s, α 20 µs per direction
      host     PCIe Gen5 x16 ─── device <-> host copies: 50 GB/s, α 10 µs
      disk     NVMe          ─── 6.5 GB/s read, 3.5 GB/s write per GPU's share
      cpu      the host's share per GPU: 1.8 TFLOP/s fp32, 77 GB/s of DDR5 (a CPU-side optimizer step)

    ranks_per_node  how a launch places its ranks (default: all ranks on one node, up to gpus_per_node)

Every link figure is **per direction and per GPU**, as nccl-tests reports bus bandwidth (``busbw``): the bytes one
rank puts on its link per second, which is what ``toolkit.runtime.ledger`` counts as ``sent_bytes``. A transfer
of ``S`` sent bytes takes the Hockney time ``α + S / β`` (``Link.seconds``). Spec sheets quote bidirectional
totals (NVLink 4: "900 GB/s"); those are twice the figure used here. Each number carries its source: where it
is a measurement (nccl-tests) it says which; where it is a line rate or an assumption, it says so.

A preset is hardware only. A launch decides the placement: ``cluster("h100-ib400", ranks_per_node=2)`` puts a
4-rank job on two nodes of two GPUs, so that a group spanning both pays the inter-node link.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPU:
    """One accelerator, as the roofline sees it."""

    name: str
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s (no sparsity)."""
    hbm_bytes_per_s: float
    """Memory bandwidth, bytes/s."""
    launch_s: float
    """Host cost of one kernel launch, seconds; a CUDA graph replay pays it once for the whole graph."""
    memory_bytes: float
    """Device memory, bytes."""
    source: str = ""


@dataclass(frozen=True)
class Link:
    """One direction of a link, per GPU: Hockney's α (latency per message) and β (bytes/s)."""

    name: str
    bytes_per_s: float
    """β: bytes per second one rank puts on this link (nccl-tests' bus bandwidth)."""
    latency_s: float
    """α: seconds per message or collective call, however small."""
    source: str = ""

    def seconds(self, nbytes: float) -> float:
        """Hockney time of one transfer of ``nbytes`` sent bytes: ``α + nbytes / β``."""
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Disk:
    """An NVMe drive, per GPU's share of the node's drives."""

    name: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    latency_s: float = 100e-6
    source: str = ""

    def seconds(self, nbytes: float, write: bool) -> float:
        return self.latency_s + nbytes / (self.write_bytes_per_s if write else self.read_bytes_per_s)


@dataclass(frozen=True)
class Cluster:
    """GPUs, links and placement. Build one with :func:`cluster` (a preset by name, or fields replaced)."""

    name: str
    gpu: GPU
    intra: Link
    """Between two GPUs of one node."""
    inter: Link
    """Between GPUs of different nodes (one NIC per GPU)."""
    host: Link
    """Between a GPU and its host's memory (PCIe): what offloading pays (a copy engine each way)."""
    disk: Disk
    cpu: GPU
    """The host processor's share per GPU, as the roofline sees it (``bf16_flops``: its fp32 peak, ``hbm_bytes_per_s``:
    its DRAM bandwidth, no launch cost): what a CPU-side optimizer step takes."""
    gpus_per_node: int = 8
    ranks_per_node: int | None = None
    """Ranks of a launch on each node; None: every rank on one node (at most ``gpus_per_node``)."""
    float_bytes: int = 2
    """Bytes per element of a float tensor on the target (bf16: 2), whatever the CPU run holds (usually fp32)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    # ---- placement -------------------------------------------------------------------------------------------
    def per_node(self, world_size: int) -> int:
        """Ranks per node for a launch of ``world_size`` ranks."""
        return self.ranks_per_node or world_size

    def node_of(self, rank: int, world_size: int) -> int:
        return rank // self.per_node(world_size)

    def link_between(self, ranks, world_size: int) -> Link:
        """The link a transfer among ``ranks`` (global ranks) uses: intra if they share a node, else inter."""
        return self.intra if len({self.node_of(r, world_size) for r in ranks}) <= 1 else self.inter

    # ---- serialisation (the launch spec carries it to every rank) --------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        return cls(name=d["name"], gpu=GPU(**d["gpu"]), intra=Link(**d["intra"]), inter=Link(**d["inter"]),
                   host=Link(**d["host"]), disk=Disk(**d["disk"]), cpu=GPU(**d["cpu"]), gpus_per_node=d["gpus_per_node"],
                   ranks_per_node=d["ranks_per_node"], float_bytes=d.get("float_bytes", 2),
                   notes=tuple(d.get("notes", ())))

    def describe(self) -> str:
        """One line per part, with the figures and their sources."""
        g = self.gpu
        lines = [f"{self.name}: {g.name} {g.bf16_flops / 1e12:.0f} TFLOP/s bf16, {g.hbm_bytes_per_s / 1e12:.2f} TB/s "
                 f"HBM, {g.launch_s * 1e6:.0f} µs per launch ({g.source})"]
        for part in (self.intra, self.inter, self.host):
            lines.append(f"  {part.name}: {part.bytes_per_s / 1e9:.0f} GB/s per direction, α {part.latency_s * 1e6:.0f} µs "
                         f"({part.source})")
        d, c = self.disk, self.cpu
        lines.append(f"  {d.name}: {d.read_bytes_per_s / 1e9:.1f} GB/s read, {d.write_bytes_per_s / 1e9:.1f} GB/s "
                     f"write ({d.source})")
        lines.append(f"  host CPU (per GPU): {c.name}, {c.bf16_flops / 1e12:.1f} TFLOP/s, {c.hbm_bytes_per_s / 1e9:.0f} "
                     f"GB/s memory ({c.source})")
        return "\n".join(lines)


# ---- presets ---------------------------------------------------------------------------------------------------
_NCCL_H100 = ("nccl-tests all_reduce busbw on 8x H100 SXM: 476 GB/s with NVLink SHARP (NVIDIA/nccl-tests#290); "
              "NVLink 4 carries 450 GB/s per direction (18 links x 25 GB/s)")
_NCCL_LAT = ("nccl-tests: 3.5 µs all_reduce of 1 KB on 4 NVLink GPUs without CUDA graphs (NVIDIA/nccl#1984), "
             "about 6 µs with NVLS on 2 H100 (NVIDIA/nccl#1259)")
_IB_LAT = "nccl-tests all_reduce of 8 B across two nodes, one GPU each: 19-20 µs (NVIDIA/nccl-tests#150)"
_LAUNCH = ("a kernel launch costs the host microseconds (3.5 µs vs 0.5 µs per all_reduce without and with CUDA "
           "graphs, NVIDIA/nccl#1984); 4 µs assumed")

_XEON = GPU("2x Xeon 8480+ (per GPU: 1/8)", 1.8e12, 77e9, 0.0, 256e9, "56 cores x 2 FMA x 16 fp32 lanes x 2 x 2.0 GHz "
            "= 7.2 TFLOP/s and 8 x DDR5-4800 = 307 GB/s per socket, two sockets shared by 8 GPUs: datasheet "
            "arithmetic, peaks, assumed")
_EPYC = GPU("2x EPYC 7763 (per GPU: 1/8)", 1.0e12, 51e9, 0.0, 256e9, "64 cores x 2 FMA x 8 fp32 lanes x 2 x 2.45 GHz "
            "= 5.0 TFLOP/s and 8 x DDR4-3200 = 205 GB/s per socket, two sockets shared by 8 GPUs: datasheet "
            "arithmetic, peaks, assumed")

PRESETS: dict[str, Cluster] = {
    "h100-ib400": Cluster(
        "h100-ib400",
        GPU("H100 SXM", 989e12, 3.35e12, 4e-6, 80e9, "H100 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; "
            + _LAUNCH),
        Link("NVLink 4 (NVSwitch)", 450e9, 5e-6, _NCCL_H100 + "; α: " + _NCCL_LAT),
        Link("InfiniBand NDR 400 Gb/s", 46e9, 20e-6, "46-48 GB/s per NDR NIC in nccl-tests (NVIDIA/nccl-tests#290, "
             "NVIDIA's maintainer); α: " + _IB_LAT),
        Link("PCIe Gen5 x16", 50e9, 10e-6, "PCIe Gen5 x16: 64 GB/s line rate per direction; 50 GB/s achieved assumed"),
        Disk("NVMe Gen4 (per GPU)", 6.5e9, 3.5e9, 100e-6, "one Gen4 NVMe drive per GPU: 7 GB/s read, 3.5-5 GB/s write "
             "on datasheets; assumed"),
        _XEON),
    "a100-ib200": Cluster(
        "a100-ib200",
        GPU("A100 SXM 80GB", 312e12, 2.04e12, 4e-6, 80e9, "A100 datasheet: 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e; "
            + _LAUNCH),
        Link("NVLink 3 (NVSwitch)", 232e9, 5e-6, "nccl-tests all_reduce busbw 232.5 GB/s on 8x A100 (NVIDIA/nccl#1048); "
             "NVLink 3: 300 GB/s per direction; α: " + _NCCL_LAT),
        Link("InfiniBand HDR 200 Gb/s", 24e9, 20e-6, "24 GB/s per HDR NIC reached in nccl-tests (NVIDIA/nccl#1048); "
             "α: " + _IB_LAT),
        Link("PCIe Gen4 x16", 25e9, 10e-6, "PCIe Gen4 x16: 32 GB/s line rate per direction; 25 GB/s achieved assumed"),
        Disk("NVMe Gen4 (per GPU)", 6.5e9, 3.5e9, 100e-6, "one Gen4 NVMe drive per GPU; assumed"),
        _EPYC),
    "pcie-100gbe": Cluster(
        "pcie-100gbe",
        GPU("H100 PCIe", 756e12, 2.0e12, 4e-6, 80e9, "H100 PCIe datasheet: 756 TFLOP/s dense bf16, 2.0 TB/s HBM2e; "
            + _LAUNCH),
        Link("PCIe Gen5 through the host (no NVLink)", 40e9, 10e-6, "nccl-tests all_reduce busbw 35-45 GB/s on 8x "
             "H100 PCIe without NVSwitch (alayanew NCCL-tests reference table); α assumed"),
        Link("100 GbE RoCE", 11e9, 30e-6, "100 Gb/s = 12.5 GB/s line rate; about 90 % of it assumed; α assumed"),
        Link("PCIe Gen5 x16", 50e9, 10e-6, "PCIe Gen5 x16: 64 GB/s line rate per direction; 50 GB/s achieved assumed"),
        Disk("NVMe Gen4 (per GPU)", 6.5e9, 3.5e9, 100e-6, "one Gen4 NVMe drive per GPU; assumed"),
        _XEON),
}


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise ValueError(f"cluster {name} must be a finite number > 0, got {value!r}")


def check(c: Cluster, world_size: int | None = None) -> Cluster:
    """Every figure > 0 and the placement possible; ValueError naming the field otherwise."""
    if not isinstance(c, Cluster):
        raise ValueError(f"cluster must be a preset name or a Cluster, got {type(c).__name__}")
    _positive("gpu.bf16_flops", c.gpu.bf16_flops)
    _positive("gpu.hbm_bytes_per_s", c.gpu.hbm_bytes_per_s)
    if not c.gpu.launch_s >= 0:
        raise ValueError(f"cluster gpu.launch_s must be >= 0, got {c.gpu.launch_s!r}")
    for part in ("intra", "inter", "host"):
        link = getattr(c, part)
        _positive(f"{part}.bytes_per_s", link.bytes_per_s)
        _positive(f"{part}.latency_s", link.latency_s)
    _positive("disk.read_bytes_per_s", c.disk.read_bytes_per_s)
    _positive("disk.write_bytes_per_s", c.disk.write_bytes_per_s)
    _positive("cpu.bf16_flops", c.cpu.bf16_flops)
    _positive("cpu.hbm_bytes_per_s", c.cpu.hbm_bytes_per_s)
    if isinstance(c.gpus_per_node, bool) or not isinstance(c.gpus_per_node, int) or c.gpus_per_node < 1:
        raise ValueError(f"cluster gpus_per_node must be an int >= 1, got {c.gpus_per_node!r}")
    rpn = c.ranks_per_node
    if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or not 1 <= rpn <= c.gpus_per_node):
        raise ValueError(f"cluster ranks_per_node must be None or an int in 1..gpus_per_node={c.gpus_per_node}, "
                         f"got {rpn!r}")
    if c.float_bytes not in (1, 2, 4):
        raise ValueError(f"cluster float_bytes must be 1, 2 or 4, got {c.float_bytes!r}")
    if world_size is not None:
        per = c.per_node(world_size)
        if world_size % per:
            raise ValueError(f"cluster ranks_per_node={per} does not divide world_size={world_size}")
        if per > c.gpus_per_node:
            raise ValueError(f"cluster {c.name!r}: {world_size} ranks on one node exceed its gpus_per_node="
                             f"{c.gpus_per_node}; give ranks_per_node")
    return c


def cluster(spec: str | Cluster, **replace) -> Cluster:
    """A preset by name (``PRESETS``: "h100-ib400", "a100-ib200", "pcie-100gbe") or a ``Cluster``, with fields
    replaced (``ranks_per_node=2``, ``intra=Link(...)``); checked. An unknown name lists the presets."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"cluster={spec!r} is not a preset; presets: {sorted(PRESETS)}")
        spec = PRESETS[spec]
    if not isinstance(spec, Cluster):
        raise ValueError(f"cluster must be a preset name or a Cluster, got {type(spec).__name__}")
    return check(dataclasses.replace(spec, **replace) if replace else spec)
