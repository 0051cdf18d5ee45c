"""Registers, spills and shared memory of slamb_comm's CUDA kernels, from ``ptxas -v``, without a GPU.

A kernel bound by device memory needs enough warps in flight to cover the latency of its loads;
at :data:`slamb_comm.device.kernels.THREADS` threads per block, the registers per thread set how many
blocks an SM holds (on sm_90: 56 registers -> 4 blocks, 50% occupancy; 48 -> 62.5%; 40 -> 75%;
32 -> 100%). This compiles :data:`slamb_comm.device.kernels.SOURCE` to PTX with NVRTC for
``compute_90`` exactly as ``tests/test_kernels_nvrtc.py`` does, assembles it with ``ptxas
-arch=sm_90 -v`` (the ``nvidia-cuda-nvcc-cu12`` wheel, which ``scripts/setup.sh`` installs), and
holds every ``.entry`` of the PTX to :data:`REGISTERS` (else :data:`DEFAULT_REGISTERS`) and to no
spills. ``pytest -s tests/test_kernels_ptxas.py`` prints the table of every kernel (the assertion
messages carry it too). The register counts of a given PTX depend on the ptxas version; the
table names the one used. Skipped, with the reason, only where NVRTC or ptxas cannot be found.
"""

import math
import os
import re
import shutil
import subprocess

import pytest

from slamb_comm.device import kernels
from tests.test_kernels_nvrtc import _ptx

ARCH = "sm_90"

#: The register budget per thread, kernel by kernel (tighten it here). The float32 instances of
#: the moments and update kernels carry SLAMB's two passes over the model: <= 40 registers is 75%
#: occupancy at 256 threads (issue 43: 48 and 56 on the 2026-11-28 kernels, 32 and 40 since, with
#: ptxas 12.9). The update's instance for the first cycle after a ratio change (the masks before it
#: derived element by element, in 64 bits) runs a few steps per change: float64's may use more.
REGISTERS = {
    "slamb_moments_f4h2": 36,
    "slamb_moments_f4f4": 36,
    "slamb_moments_f4f8": 36,
    "slamb_update_f4": 40,
    "slamb_update_levels_f8": 80,
}
#: The budget of every kernel not in :data:`REGISTERS` (new kernels included).
DEFAULT_REGISTERS = 64
#: Registers per SM, warps per SM and blocks per SM on sm_90, and the allocation unit (registers
#: per warp) of the occupancy column.
SM90_REGISTERS, SM90_WARPS, SM90_BLOCKS, SM90_SHARED, REG_UNIT = 65536, 64, 32, 228 * 1024, 256


def _ptxas_candidates():
    """ptxas executables, the wheel's first (it matches the NVRTC that setup.sh installs)."""
    found = []
    try:
        import nvidia

        found += [os.path.join(p, "cuda_nvcc", "bin", "ptxas") for p in nvidia.__path__]
    except ImportError:
        pass
    found += [os.path.join(os.environ[v], "bin", "ptxas") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    found.append(shutil.which("ptxas"))
    return [p for p in dict.fromkeys(found) if p and os.path.isfile(p) and os.access(p, os.X_OK)]


def _assemble(ptx, tmp_path):
    """(ptxas path, its version line, its ``-v`` report) for ``ptx``; skips where none can read it."""
    src = tmp_path / "slamb.ptx"
    src.write_text(ptx)
    tried = []
    for exe in _ptxas_candidates():
        r = subprocess.run([exe, f"-arch={ARCH}", "-v", str(src), "-o", os.devnull],
                           capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
            return exe, (ver.strip().splitlines() or ["?"])[-1], r.stdout + r.stderr
        if "Unsupported .version" in r.stderr:  # PTX newer than this ptxas: try the next one
            tried.append(f"{exe}: {r.stderr.strip().splitlines()[0]}")
            continue
        raise AssertionError(f"{exe} -arch={ARCH} failed (rc {r.returncode}):\n{r.stderr}")
    why = "; ".join(tried) or "no ptxas found (the nvidia-cuda-nvcc-cu12 wheel, $CUDA_HOME/bin, PATH)"
    pytest.skip(f"{why}: pip install nvidia-cuda-nvcc-cu12 (scripts/setup.sh does)")


def parse(report):
    """``ptxas -v``'s report as ``(entries, functions)``: ``entries`` maps each entry function to
    its ``registers`` and static ``smem`` bytes; ``functions`` maps every function whose
    properties are given (entries and the device functions they call) to its ``stack``,
    ``spill_stores`` and ``spill_loads`` bytes."""
    functions = {
        m[1]: {"stack": int(m[2]), "spill_stores": int(m[3]), "spill_loads": int(m[4])}
        for m in re.finditer(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
                             r"stores, (\d+) bytes spill loads", report)
    }
    entries = {}
    parts = re.split(r"Compiling entry function '(\w+)' for '\w+'", report)
    for name, body in zip(parts[1::2], parts[2::2]):
        used = re.search(r"Used (\d+) registers(.*)", body)
        assert used, f"ptxas reported no register count for {name}:\n{body}"
        smem = re.search(r"(\d+) bytes smem", used[2])
        entries[name] = {"registers": int(used[1]), "smem": int(smem[1]) if smem else 0}
    return entries, functions


def occupancy(registers, smem, threads=kernels.THREADS):
    """The fraction of sm_90's warp slots that blocks of ``threads`` can fill, given the registers
    per thread (allocated per warp in units of :data:`REG_UNIT`) and the static shared memory."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / REG_UNIT) * REG_UNIT
    blocks = min(SM90_REGISTERS // per_warp // warps, SM90_WARPS // warps, SM90_BLOCKS)
    if smem:
        blocks = min(blocks, SM90_SHARED // smem)
    return blocks * warps / SM90_WARPS


def budget(name):
    return REGISTERS.get(name, DEFAULT_REGISTERS)


def table(entries, functions, exe, version):
    lines = [f"ptxas -arch={ARCH} -v ({exe}; {version}), {kernels.THREADS} threads per block",
             f"{'kernel':28s} {'regs':>5s} {'budget':>6s} {'spill st':>8s} {'spill ld':>8s} {'stack':>6s} "
             f"{'smem':>6s} {'occupancy':>9s}"]
    for name in sorted(entries):
        e, f = entries[name], functions.get(name, {})
        flag = "  OVER" if e["registers"] > budget(name) else ""
        lines.append(f"{name:28s} {e['registers']:5d} {budget(name):6d} {f.get('spill_stores', 0):8d} "
                     f"{f.get('spill_loads', 0):8d} {f.get('stack', 0):6d} {e['smem']:6d} "
                     f"{occupancy(e['registers'], e['smem']):9.1%}{flag}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def assembled(tmp_path_factory):
    ptx = _ptx("compute_90")  # skips where NVRTC cannot be loaded
    exe, version, report = _assemble(ptx, tmp_path_factory.mktemp("ptxas"))
    entries, functions = parse(report)
    names = set(re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\(", ptx))
    text = table(entries, functions, exe, version)
    print("\n" + text)
    return names, entries, functions, text


def test_ptxas_reports_every_entry_of_the_ptx(assembled):
    names, entries, _, text = assembled
    assert names and names == set(entries), f"in the PTX only: {sorted(names - set(entries))}, in ptxas's report " \
                                            f"only: {sorted(set(entries) - names)}\n{text}"
    assert set(REGISTERS) <= names, f"REGISTERS names kernels the source no longer has: " \
                                    f"{sorted(set(REGISTERS) - names)}; update the table\n{text}"


def test_no_kernel_spills(assembled):
    _, _, functions, text = assembled
    spilled = {n: f for n, f in functions.items() if f["spill_stores"] or f["spill_loads"]}
    assert not spilled, f"spills (bytes per thread): {spilled}\n{text}"


def test_register_budget(assembled):
    _, entries, _, text = assembled
    over = {n: f"{e['registers']} > {budget(n)}" for n, e in entries.items() if e["registers"] > budget(n)}
    assert not over, f"registers per thread over budget: {over}\n{text}"


def test_parse_and_occupancy_on_a_known_report():
    report = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_a' for 'sm_90'
ptxas info    : Function properties for k_a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 56 registers, used 1 barriers, 8192 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for helper
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'k_b' for 'sm_90'
ptxas info    : Function properties for k_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""
    entries, functions = parse(report)
    assert entries == {"k_a": {"registers": 56, "smem": 8192}, "k_b": {"registers": 32, "smem": 0}}
    assert functions["helper"] == {"stack": 16, "spill_stores": 8, "spill_loads": 4}
    assert [occupancy(r, 0, 256) for r in (56, 48, 40, 32)] == [0.5, 0.625, 0.75, 1.0]
