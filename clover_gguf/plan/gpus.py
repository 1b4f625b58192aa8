"""GPUs the plan knows: memory, memory bandwidth, host link, SM count and boost clock (vendor
spec pages; the sources are listed in docs/plan.md). The quantized matmuls of a Clover step run
llama.cpp's MMQ kernels, whose rate scales with SMs x clock (plan/kernels.py); the bandwidth
sets the float and small-batch kernels. ``tflops`` is a rough dense FP16 tensor figure (a
compute floor only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    vram_gib: float  # total memory as the driver reports it (GiB)
    bandwidth_gbs: float  # GB/s, vendor figure
    pcie_gen: int
    pcie_lanes: int
    tflops: float  # approximate dense FP16 tensor TFLOPS
    sms: int  # streaming multiprocessors
    boost_ghz: float  # vendor boost clock
    arch: str  # which public anchors apply (kernels.Term.archs): the kernels differ by architecture

    @property
    def vram_bytes(self) -> int:
        return int(self.vram_gib * 2**30)

    @property
    def pcie_raw_gbs(self) -> float:
        """The link's raw rate in GB/s per direction (PCIe: 8/16/32/64 GT/s a lane, 128b/130b)."""
        return PCIE_LANE_GBS[self.pcie_gen] * self.pcie_lanes

    @property
    def sm_ghz(self) -> float:
        return self.sms * self.boost_ghz


PCIE_LANE_GBS = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def _mib(n: int) -> float:
    """A total nvidia-smi reports in MiB, as GiB."""
    return n / 1024


GPUS: dict[str, GPU] = {
    g.key: g
    for g in [
        GPU("rtx3090", "GeForce RTX 3090", 24, 936, 4, 16, 71, 82, 1.695, "ampere"),
        GPU("rtx4060ti-16gb", "GeForce RTX 4060 Ti 16GB", 16, 288, 4, 8, 44, 34, 2.535, "ada"),
        GPU("rtx4080", "GeForce RTX 4080", 16, 716.8, 4, 16, 97, 76, 2.505, "ada"),
        GPU("rtx4090", "GeForce RTX 4090", 24, 1008, 4, 16, 165, 128, 2.52, "ada"),
        GPU("rtx5060ti-16gb", "GeForce RTX 5060 Ti 16GB", 16, 448, 5, 8, 47, 36, 2.572, "blackwell"),
        GPU("rtx5070ti", "GeForce RTX 5070 Ti", 16, 896, 5, 16, 88, 70, 2.452, "blackwell"),
        GPU("rtx5080", "GeForce RTX 5080", 16, 960, 5, 16, 113, 84, 2.617, "blackwell"),
        GPU("rtx5090", "GeForce RTX 5090", 32, 1792, 5, 16, 209, 170, 2.407, "blackwell"),
        GPU("rtx6000ada", "RTX 6000 Ada Generation", 48, 960, 4, 16, 182, 142, 2.505, "ada"),
        GPU("rtxpro6000", "RTX PRO 6000 Blackwell", 96, 1792, 5, 16, 250, 188, 2.617, "blackwell"),
        GPU("a100-80gb", "A100 80GB SXM", _mib(81920), 2039, 4, 16, 312, 108, 1.41, "ampere-dc"),
        GPU("h100-sxm", "H100 SXM", _mib(81559), 3350, 5, 16, 989, 132, 1.98, "hopper"),
        GPU("h200", "H200 SXM", _mib(143771), 4800, 5, 16, 989, 132, 1.98, "hopper"),
        GPU("b200", "B200 (HGX)", _mib(183359), 8000, 5, 16, 2250, 148, 1.965, "blackwell-dc"),
    ]
}
# arch: GeForce/RTX Ampere (sm_86), Ada (sm_89), Blackwell (sm_120); the data-centre parts (A100
# sm_80, Hopper sm_90, B200 sm_100) have other tensor cores, so GeForce anchors do not carry to them.
# GeForce/RTX cards: 16 GB of GDDR is 16 GiB and the driver reports nearly all of it (an RTX
# 4080 reports 16376 MiB); the data-centre totals are what nvidia-smi reports for them.


def find_gpu(name: str) -> GPU:
    """A GPU by key or by a unique part of its name ('5070 ti', 'h100')."""
    k = name.strip().lower().replace(" ", "").replace("-", "").replace("_", "")
    hits = [g for g in GPUS.values() if k in g.key.replace("-", "") or k in g.name.lower().replace(" ", "")]
    exact = [g for g in hits if g.key.replace("-", "") == k]
    if exact:
        return exact[0]
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(GPUS)
    if not hits:
        raise ValueError(f"--gpu {name!r}: unknown GPU; known: {known}")
    raise ValueError(f"--gpu {name!r}: ambiguous ({', '.join(g.key for g in hits)})")


def table() -> str:
    lines = [
        f"{'key':<16} {'GPU':<26} {'VRAM GiB':>8} {'GB/s':>7} {'PCIe':>9} {'SMs':>5} {'GHz':>6} {'~TFLOPS':>8}",
    ]
    for g in GPUS.values():
        lines.append(
            f"{g.key:<16} {g.name:<26} {g.vram_gib:8.1f} {g.bandwidth_gbs:7.0f} "
            f"{f'{g.pcie_gen}.0 x{g.pcie_lanes}':>9} {g.sms:5d} {g.boost_ghz:6.3f} {g.tflops:8.0f}"
        )
    return "\n".join(lines)
