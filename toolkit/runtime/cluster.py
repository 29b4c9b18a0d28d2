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

from .collectives import Protocol
from .efficiency import PEAK, Efficiency, Tile


@dataclass(frozen=True)
class GPU:
    """One accelerator: its datasheet peaks and what its kernels achieve of them (``efficiency``)."""

    name: str
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s (no sparsity): what MFU is reported against."""
    hbm_bytes_per_s: float
    """Memory bandwidth on the datasheet, bytes/s."""
    launch_s: float
    """Host cost of one CUDA launch call (``cudaLaunchKernel``, ``cudaGraphLaunch``): what a CUDA graph replay pays
    once for all its kernels. An eager PyTorch op costs the host ``efficiency.host_op_s`` instead."""
    memory_bytes: float
    """Device memory, bytes."""
    source: str = ""
    sms: int = 132
    """Streaming multiprocessors: a GEMM's tiles fill them in waves; a communication kernel takes some."""
    efficiency: Efficiency = PEAK
    """The achieved fractions of the peaks and the fixed costs (``toolkit.runtime.efficiency``)."""


@dataclass(frozen=True)
class Link:
    """One direction of a link, per GPU, as NCCL uses it (``toolkit.runtime.collectives``): its Simple protocol
    (``bytes_per_s``, ``latency_s``, ``hop_s`` per ring step) and the other protocols NCCL may pick."""

    name: str
    bytes_per_s: float
    """Bus bandwidth of large messages (NCCL's Simple protocol; nccl-tests' busbw): bytes/s one rank puts on it."""
    latency_s: float
    """Latency of one call on the Simple protocol, however small."""
    source: str = ""
    hop_s: float = 0.0
    """More latency per ring step (a collective of n ranks takes n−1 or 2(n−1) steps)."""
    protocols: tuple[Protocol, ...] = ()
    """The other protocols (LL, LL128 for small and mid-size messages; NVLS for all-reduce on NVSwitch)."""
    channels: int = 0
    """SMs NCCL's kernels take while a collective is on this link (one CTA per channel): compute beside it runs
    on the rest."""
    fill: float = 0.0
    fill_bytes: float = 0.0
    """The Simple protocol's pipeline fill (``Protocol.fill``)."""

    def all_protocols(self) -> tuple[Protocol, ...]:
        return (Protocol("Simple", self.bytes_per_s, self.latency_s, self.hop_s, (), self.fill, self.fill_bytes),
                *self.protocols)

    def seconds(self, nbytes: float) -> float:
        """One point-to-point transfer of ``nbytes`` (one step) at its fastest protocol."""
        return min(p.seconds("send", 2, nbytes) for p in self.all_protocols() if not p.ops or "send" in p.ops)

    def scaled(self, factor: float) -> "Link":
        """Every protocol's bandwidth times ``factor`` (latencies kept)."""
        return dataclasses.replace(self, bytes_per_s=self.bytes_per_s * factor, protocols=tuple(
            dataclasses.replace(p, bytes_per_s=p.bytes_per_s * factor) for p in self.protocols))


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
    nics_per_node: int | None = None
    """NICs of a node (``inter`` is one of them); None: one per GPU (rail-optimised)."""
    float_bytes: int = 2
    """Bytes per element of a float tensor on the target (bf16: 2), whatever the CPU run holds (usually fp32)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    # ---- placement -------------------------------------------------------------------------------------------
    def per_node(self, world_size: int) -> int:
        """Ranks per node for a launch of ``world_size`` ranks: ``ranks_per_node``, or as many as fit on one node."""
        return self.ranks_per_node or min(world_size, self.gpus_per_node)

    def node_of(self, rank: int, world_size: int) -> int:
        return rank // self.per_node(world_size)

    def link_between(self, ranks, world_size: int) -> Link:
        """The link a transfer among ``ranks`` (global ranks) uses: intra if they share a node, else inter."""
        return self.intra if len({self.node_of(r, world_size) for r in ranks}) <= 1 else self.inter

    @property
    def nics(self) -> int:
        """NICs per node."""
        return self.nics_per_node or self.gpus_per_node

    def perturbed(self, compute: float = 1.0, bandwidth: float = 1.0) -> "Cluster":
        """The same cluster with every achieved compute fraction times ``compute`` (``Efficiency.scaled``) and
        every link's bandwidth times ``bandwidth`` (latencies, fixed costs and peaks kept): the sensitivity band
        of an emulated result replays it on these."""
        name = self.name if compute == bandwidth == 1.0 else f"{self.name} (compute x{compute:g}, links x{bandwidth:g})"
        return dataclasses.replace(
            self, name=name, gpu=dataclasses.replace(self.gpu, efficiency=self.gpu.efficiency.scaled(compute)),
            intra=self.intra.scaled(bandwidth), inter=self.inter.scaled(bandwidth))

    def isolated(self) -> "Cluster":
        """The same cluster as a benchmark of one kernel at a time sees it (``Efficiency.step`` = 1): what the
        published GEMM and attention throughput tables are compared with."""
        return dataclasses.replace(self, name=f"{self.name} (kernels alone)",
                                   gpu=dataclasses.replace(self.gpu, efficiency=dataclasses.replace(
                                       self.gpu.efficiency, step=1.0)))

    # ---- serialisation (the launch spec carries it to every rank) --------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        def gpu(g: dict) -> GPU:
            e = dict(g.get("efficiency") or dataclasses.asdict(PEAK))
            e["tiles"] = tuple(Tile(**t) if isinstance(t, dict) else Tile(*t) for t in e["tiles"])
            return GPU(**{**g, "efficiency": Efficiency(**e)})

        def link(x: dict) -> Link:
            return Link(**{**x, "protocols": tuple(Protocol(**{**p, "ops": tuple(p.get("ops", ()))})
                                                   for p in x.get("protocols", ()))})
        return cls(name=d["name"], gpu=gpu(d["gpu"]), intra=link(d["intra"]), inter=link(d["inter"]),
                   host=link(d["host"]), disk=Disk(**d["disk"]), cpu=gpu(d["cpu"]), gpus_per_node=d["gpus_per_node"],
                   ranks_per_node=d["ranks_per_node"], nics_per_node=d.get("nics_per_node"),
                   float_bytes=d.get("float_bytes", 2), notes=tuple(d.get("notes", ())))

    def describe(self) -> str:
        """One line per part, with the figures and their sources."""
        g, e = self.gpu, self.gpu.efficiency
        lines = [f"{self.name}: {g.name} {g.bf16_flops / 1e12:.0f} TFLOP/s bf16 peak, {g.hbm_bytes_per_s / 1e12:.2f} "
                 f"TB/s HBM ({g.source})",
                 f"  achieved: GEMMs up to {e.gemm:.0%} of peak, attention {e.attention_causal:.0%} (causal forward) / "
                 f"{e.attention_backward:.0%} (backward), HBM {e.hbm:.0%}; {e.kernel_min_s * 1e6:.1f} µs per kernel, "
                 f"{e.host_op_s * 1e6:.0f} µs of host per eager op ({e.source})"]
        for part in (self.intra, self.inter, self.host):
            others = ", ".join(f"{p.name} {p.bytes_per_s / 1e9:.0f} GB/s α {p.latency_s * 1e6:.0f} µs"
                               for p in part.protocols)
            lines.append(f"  {part.name}: {part.bytes_per_s / 1e9:.0f} GB/s bus bandwidth, α {part.latency_s * 1e6:.0f} µs"
                         + (f"; {others}" if others else "") + f" ({part.source})")
        d, c = self.disk, self.cpu
        lines.append(f"  {d.name}: {d.read_bytes_per_s / 1e9:.1f} GB/s read, {d.write_bytes_per_s / 1e9:.1f} GB/s "
                     f"write ({d.source})")
        lines.append(f"  host CPU (per GPU): {c.name}, {c.bf16_flops / 1e12:.1f} TFLOP/s, {c.hbm_bytes_per_s / 1e9:.0f} "
                     f"GB/s memory ({c.source})")
        return "\n".join(lines)


# ---- presets ---------------------------------------------------------------------------------------------------
# Every figure below carries its source; data/published/ holds the measurements, and toolkit.runtime.calibration
# checks the presets against every row (tests/test_calibration.py). "fitted" means: chosen so that the model
# reproduces the named tables (scripts in the commit history; the fit is a few parameters per curve).
_DGX = "NVIDIA dgxc-benchmarking nccl/README.md, 8x H100 all_reduce 8 B-16 GiB"
_AZ = "Azure AI-benchmarking-guide ND_H100_v5 / ND_H200_v5 / ND_A100_v4 all_reduce sweeps"
_NCCL_CONST = "NCCL src/graph/tuning.cc (baseLat Ring Simple 8.4 µs, hwLat NVLink Ring Simple 3.4 µs)"
_H100_EFF = Efficiency(
    gemm=0.81, gemm_misaligned=0.72, gemm_k_half=128, tiles=(Tile(128, 256, 1.0), Tile(128, 128, 0.93), Tile(64, 128, 0.78), Tile(128, 128, 0.85, True)),
    attention=0.374, attention_causal=0.287, attention_backward=0.293, attention_half_seq=64, hbm=0.87,
    kernel_min_s=2.0e-6, host_op_s=12e-6, step=0.706,
    source="GEMMs: cuBLAS bf16 on H100 SXM, 797 TFLOP/s at 8192^3 (fast.cu README; zzc0721/torch-performance-test-"
           "data#79), 676 at 2048^3, 794 best (stas00/ml-engineering MAMF table); tiles of 128x256, 128x128, "
           "64x128 and a stream-K kernel, shares fitted to those rows; a dimension not a multiple of 8: x0.72, "
           "fitted to 1024x2145x1024 on A100 (132.8 TFLOP/s, Azure ND_A100_v4); attention: FlashAttention-2 on "
           "Hopper at s=8192, d=128, 370 / 284 TFLOP/s forward (no mask / causal), 291 / 287 backward (Dao-AILab/"
           "flash-attention#1791), SDPA forward flat from 1k to 16k (pytorch/benchmark#2296); HBM: BabelStream "
           "copy 2.90 TB/s (Azure ND_H100_v5); host per eager op: 8-17.7 µs measured back to back (NVIDIA "
           "dgxc-benchmarking cpu_overhead, flagos-ai/Torch-FL#27), 12 µs fitted to torch.matmul at 1024^3; "
           "kernel: a graph of no-op kernels replays at 0.58 µs each (ahrefs/ocannl#488), 2 µs assumed for a "
           "kernel that reads and writes memory; in a training step: 0.706 of those rates, the median of 70 "
           "llm-foundry FSDP runs on H100 SXM 80GB (MPT-760m to 70b, 512-65536 tokens; toolkit.models.throughput)")
_A100_EFF = Efficiency(
    gemm=0.86, gemm_misaligned=0.72, gemm_k_half=128, tiles=(Tile(128, 256, 1.0), Tile(128, 128, 0.93), Tile(64, 128, 0.78), Tile(128, 128, 0.85, True)),
    attention=0.62, attention_causal=0.55, attention_backward=0.55, attention_half_seq=64, hbm=0.81,
    kernel_min_s=2.0e-6, host_op_s=12e-6, step=0.786,
    source="GEMMs: cuBLASLt fp16 on A100 SXM 80GB, 253.7 TFLOP/s at 8192^3, 119.4 at 1024^3 (Azure ND_A100_v4), "
           "271 best (stas00/ml-engineering MAMF table); attention: FlashAttention-2 paper (Dao 2023: 50-73 % of "
           "peak forward, 225 TFLOP/s in training), 179.5 TFLOP/s at s=8192, d=64 (Azure ND_A100_v4); HBM: "
           "BabelStream copy 1.61-1.70 TB/s (Azure ND_A100_v4); fixed costs as the H100's; in a training step: "
           "0.786 of those rates, the median of 61 llm-foundry FSDP runs on A100 SXM 80GB (MPT-125m to 70b, "
           "512-65536 tokens; toolkit.models.throughput)")
_LAUNCH = "cudaLaunchKernel: 1.3-3 µs of host (meta-pytorch/tritonbench#1017); 3 µs"

_XEON = GPU("2x Xeon 8480+ (per GPU: 1/8)", 1.8e12, 77e9, 0.0, 256e9, "56 cores x 2 FMA x 16 fp32 lanes x 2 x 2.0 GHz "
            "= 7.2 TFLOP/s and 8 x DDR5-4800 = 307 GB/s per socket, two sockets shared by 8 GPUs: datasheet "
            "arithmetic, peaks, assumed", sms=1)
_EPYC = GPU("2x EPYC 7763 (per GPU: 1/8)", 1.0e12, 51e9, 0.0, 256e9, "64 cores x 2 FMA x 8 fp32 lanes x 2 x 2.45 GHz "
            "= 5.0 TFLOP/s and 8 x DDR4-3200 = 205 GB/s per socket, two sockets shared by 8 GPUs: datasheet "
            "arithmetic, peaks, assumed", sms=1)

PRESETS: dict[str, Cluster] = {
    "h100-ib400": Cluster(
        "h100-ib400",
        GPU("H100 SXM", 989e12, 3.35e12, 3e-6, 80e9, "H100 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 132 "
            "SMs; " + _LAUNCH, sms=132, efficiency=_H100_EFF),
        Link("NVLink 4 (NVSwitch)", 370e9, 8.4e-6,
             "Simple ring: 370 GB/s busbw for every op but all_reduce (NVIDIA's sjeaugey, NVIDIA/nccl-tests#212; "
             "361-363 for all_gather and reduce_scatter on 8x H200, stas00/ml-engineering); latency " + _NCCL_CONST
             + "; LL, LL128 and NVLS fitted to " + _DGX + " and, from 2 MB, " + _AZ + "; 16 channels (NVLS, "
             "stas00/ml-engineering) of 132 SMs",
             hop_s=3.4e-6,
             protocols=(Protocol("LL", 145e9, 9.7e-6, 0.50e-6), Protocol("LL128", 227e9, 7.8e-6, 1.33e-6),
                        Protocol("NVLS", 477e9, 30.6e-6, 0.0, ("all_reduce",), 0.62, 36e6)),
             channels=16, fill=0.62, fill_bytes=36e6),
        Link("InfiniBand NDR 400 Gb/s (one NIC)", 46e9, 20e-6,
             "46-48 GB/s per NDR NIC (NVIDIA's AddyLaddy, NVIDIA/nccl-tests#290); 48-49 for alltoall (NVIDIA/"
             "nccl-tests#267); α: all_reduce of 8 B across two nodes, 19-20 µs (NVIDIA/nccl-tests#150)",
             hop_s=2.0e-6, channels=16),
        Link("PCIe Gen5 x16", 51e9, 10e-6, "nvbandwidth host to device 51 GB/s, device to host 52 GB/s (Azure "
             "ND_H100_v5); α assumed"),
        Disk("NVMe Gen4 (per GPU)", 6.5e9, 3.5e9, 100e-6, "one Gen4 NVMe drive per GPU: 7 GB/s read, 3.5-5 GB/s write "
             "on datasheets; assumed"),
        _XEON),
    "a100-ib200": Cluster(
        "a100-ib200",
        GPU("A100 SXM 80GB", 312e12, 2.04e12, 3e-6, 80e9, "A100 datasheet: 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e, "
            "108 SMs; " + _LAUNCH, sms=108, efficiency=_A100_EFF),
        Link("NVLink 3 (NVSwitch)", 223e9, 11.3e-6,
             "Simple ring and LL fitted to " + _AZ.replace("ND_H100_v5 / ND_H200_v5 / ", "") + " (232 GB/s "
             "all_reduce busbw at 8 GB); hop " + _NCCL_CONST.split("; ")[0].split("(")[0] + "(hwLat NVLink Ring "
             "Simple 3.4 µs, LL 0.6 µs); 24 channels for all_reduce (NVIDIA/nccl#1225) of 108 SMs",
             hop_s=3.4e-6, protocols=(Protocol("LL", 126e9, 30.5e-6, 0.6e-6),), channels=24, fill=0.54,
             fill_bytes=67e6),
        Link("InfiniBand HDR 200 Gb/s (one NIC)", 24e9, 20e-6, "24 GB/s per HDR NIC reached in nccl-tests "
             "(NVIDIA/nccl#1048); α: all_reduce of 8 B across two nodes, 19-20 µs (NVIDIA/nccl-tests#150)",
             hop_s=2.0e-6, channels=16),
        Link("PCIe Gen4 x16", 26e9, 10e-6, "nvbandwidth host to device 26.3 GB/s (Azure ND_A100_v4); α assumed"),
        Disk("NVMe Gen4 (per GPU)", 6.5e9, 3.5e9, 100e-6, "one Gen4 NVMe drive per GPU; assumed"),
        _EPYC),
    "pcie-100gbe": Cluster(
        "pcie-100gbe",
        GPU("H100 PCIe", 756e12, 2.0e12, 3e-6, 80e9, "H100 PCIe datasheet: 756 TFLOP/s dense bf16, 2.0 TB/s HBM2e, "
            "114 SMs; " + _LAUNCH + "; efficiency taken from the H100 SXM (not calibrated for the PCIe card)",
            sms=114, efficiency=_H100_EFF),
        Link("PCIe Gen5 through the host (no NVLink)", 40e9, 10e-6, "nccl-tests all_reduce busbw 35-45 GB/s on 8x "
             "H100 PCIe without NVSwitch (alayanew NCCL-tests reference table); α assumed", hop_s=3.4e-6,
             channels=2),
        Link("100 GbE RoCE (one NIC)", 11e9, 30e-6, "100 Gb/s = 12.5 GB/s line rate; about 90 % of it assumed; "
             "α assumed", hop_s=2.0e-6, channels=2),
        Link("PCIe Gen5 x16", 50e9, 10e-6, "PCIe Gen5 x16: 64 GB/s line rate per direction; 50 GB/s achieved assumed"),
        Disk("NVMe Gen4 (per GPU)", 6.5e9, 3.5e9, 100e-6, "one Gen4 NVMe drive per GPU; assumed"),
        _XEON, nics_per_node=1),
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
