"""GPUs the plan knows: memory, memory bandwidth, host link (vendor spec pages; the sources
are listed in docs/plan.md). ``tflops`` is a rough dense FP16 tensor figure, used only by the
compute term, which Clover's steps rarely hit (they are bandwidth bound)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    vram_gib: float  # as sold (GB on the box, converted below)
    bandwidth_gbs: float  # GB/s, vendor figure
    pcie_gen: int
    pcie_lanes: int
    tflops: float  # approximate dense FP16 tensor TFLOPS

    @property
    def vram_bytes(self) -> int:
        return int(self.vram_gib * 2**30)

    @property
    def pcie_gbs(self) -> float:
        """Usable host-to-device GB/s: about 80 % of the link's raw rate (gen4 ~2 GB/s/lane)."""
        per_lane = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}[self.pcie_gen]
        return 0.8 * per_lane * self.pcie_lanes


def _gb(n_gb: float) -> float:
    """Marketing GB (10^9) to GiB."""
    return n_gb * 1e9 / 2**30


GPUS: dict[str, GPU] = {
    g.key: g
    for g in [
        GPU("rtx4060ti-16gb", "GeForce RTX 4060 Ti 16GB", 16, 288, 4, 8, 44),
        GPU("rtx4080", "GeForce RTX 4080", 16, 716.8, 4, 16, 97),
        GPU("rtx5060ti-16gb", "GeForce RTX 5060 Ti 16GB", 16, 448, 5, 8, 47),
        GPU("rtx5070ti", "GeForce RTX 5070 Ti", 16, 896, 5, 16, 88),
        GPU("rtx5080", "GeForce RTX 5080", 16, 960, 5, 16, 113),
        GPU("rtx5090", "GeForce RTX 5090", 32, 1792, 5, 16, 209),
        GPU("rtx6000ada", "RTX 6000 Ada Generation", 48, 960, 4, 16, 182),
        GPU("rtxpro6000", "RTX PRO 6000 Blackwell", 96, 1792, 5, 16, 250),
        GPU("a100-80gb", "A100 80GB SXM", _gb(80), 2039, 4, 16, 312),
        GPU("h100-sxm", "H100 SXM", _gb(80), 3350, 5, 16, 989),
        GPU("h200", "H200 SXM", _gb(141), 4800, 5, 16, 989),
        GPU("b200", "B200 (HGX)", _gb(180), 8000, 5, 16, 2250),
    ]
}
# GeForce/RTX cards are sold in GiB-sized packages (16 GB = 16 GiB of GDDR); the data-centre
# parts quote decimal GB for HBM, hence _gb above.


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
        f"{'key':<16} {'GPU':<26} {'VRAM GiB':>8} {'GB/s':>7} {'PCIe':>9} {'~TFLOPS':>8}",
    ]
    for g in GPUS.values():
        lines.append(
            f"{g.key:<16} {g.name:<26} {g.vram_gib:8.1f} {g.bandwidth_gbs:7.0f} "
            f"{f'{g.pcie_gen}.0 x{g.pcie_lanes}':>9} {g.tflops:8.0f}"
        )
    return "\n".join(lines)
