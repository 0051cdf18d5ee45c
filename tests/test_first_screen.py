"""The README's first screens as a newcomer meets them (issue 46): every command there runs under
its own launcher, at fewer steps, and prints the lines the README shows under it.

The README's first screens are its text up to "## Recipes between"; each command of their
```bash blocks is followed by a ```text block of the lines it printed on the machine the README
names. A run here must print its bytes lines as shown there (``step N ... sent B B, R of dense``:
the bytes depend on neither the CPU nor the data, so a step of both has the same bytes and
ratio, and a later step than the run's the same ratio at every step after the first, which
also syncs the parameters; these runs stop before the next sync), a loss that goes down, a
last line of the README's shape (its numbers aside), and no warning on stderr.

Which test runs which command (each under an outer timeout, tests/support/launch.py):
``bash scripts/main.sh`` and the DDP and FSDP2 examples here; the Horovod example under
``horovodrun`` and under ``scripts/mpirun.sh`` in test_examples_smoke.py, which runs that
example anyway and checks it with :func:`check_against_readme`; ``bash scripts/test.sh`` is
the suite that runs these tests. ``test_every_first_screen_command_is_run`` fails when the
README gains a command that no test runs.
"""

import csv
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.support.launch import ROOT

README = os.path.join(ROOT, "README.md")
END_OF_FIRST_SCREENS = "## Recipes between"

# Every command of the first screens, and the test that runs it (or why none does).
RUN_BY = {
    "bash scripts/main.sh": "test_main_job",
    "bash scripts/test.sh": None,  # the whole suite, this file included
    "torchrun --standalone --nproc_per_node 2 examples/ddp_slamb.py --steps 50": "test_ddp_example",
    "horovodrun -np 4 python examples/horovod_slamb.py":
        "test_examples_smoke.py::test_horovod_slamb_example_under_horovodrun",
    "bash scripts/mpirun.sh 4 300 python3 examples/horovod_slamb.py":
        "test_examples_smoke.py::test_horovod_slamb_example_under_mpirun",
    "torchrun --standalone --nproc_per_node 4 examples/fsdp_slamb.py --replicas 2 --steps 20": "test_fsdp_example",
}

# "step 10  loss 0.02793  sent 131948 B, 0.116 of dense" (the main job: "... val loss 2.4 ... sent ...")
STEP = re.compile(r"^step +(\d+) .*loss ([\d.]+) .*\bsent (\d+) B, ([\d.]+) of dense\b")
NUMBER = r"\d+(?:\.\d+)?"
TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")  # horovodrun's --tag-output


def promised_output():
    """{command: the lines of the README's ```text block after it ([] if none; horovodrun's tags
    dropped)} for every command in a ```bash block of the first screens (a trailing ``# comment``
    dropped)."""
    text = open(README).read()
    text = text[:text.index(END_OF_FIRST_SCREENS)]
    out, pending = {}, []
    for kind, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if kind == "bash":
            pending = [line.split(" #")[0].strip() for line in body.splitlines() if line.strip()]
            out.update({c: [] for c in pending})
        elif kind == "text":
            out.update({c: [TAG.sub("", line) for line in body.splitlines()] for c in pending})
            pending = []
        else:
            pending = []
    return out


def _lines(out):
    return [TAG.sub("", line).rstrip() for line in out.splitlines() if TAG.sub("", line).strip()]


def _steps(lines):
    """{step: (loss, bytes, ratio)} of the bytes lines."""
    return {int(m[1]): (float(m[2]), int(m[3]), m[4]) for m in map(STEP.match, lines) if m}


def _shape(line):
    """A pattern for ``line`` with each of its numbers free."""
    parts = re.split(f"({NUMBER})", line)
    return "".join(NUMBER if k % 2 else re.escape(p) for k, p in enumerate(parts))


def check_against_readme(command, stdout, stderr):
    """Assert that a run of the README's ``command`` (at fewer steps) printed what the README
    shows under it: the bytes and ratio of step 1 and of the later steps, a loss that went down,
    the last line's shape; and that its stderr has no warning."""
    promised = promised_output()[command]
    want, got = _steps(promised), _steps(_lines(stdout))
    assert want, f"the README shows no bytes lines under {command!r}: {promised}"
    assert len(got) >= 2 and (1 in got or 1 not in want), stdout[-3000:]
    for step, (_, b, r) in want.items():
        if step in got:  # the same step: the same bytes
            ok = got[step][1:] == (b, r)
        else:  # a later step than this run's: the ratio, and the bytes but for the mask's rounding (a cyclic
            # mask's count per tensor, k n rounded, moves by one element from step to step)
            ok = step > 1 and all(sr == r and abs(sb - b) <= 1e-3 * b for s, (_, sb, sr) in got.items() if s > 1)
        assert ok, (f"the README shows step {step} sending {b} B, {r} of dense; this run: "
                    f"{[(s, v[1], v[2]) for s, v in sorted(got.items())]}")
    losses = [v[0] for _, v in sorted(got.items())]
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    last = _lines(stdout)[-1]
    assert re.fullmatch(_shape(promised[-1]), last), f"the last line {last!r} is not the README's {promised[-1]!r}"
    warned = [line for line in stderr.splitlines() if re.search(r"warn", line, re.I)]
    assert not warned, "\n".join(warned)


def run_readme_command(command, *more, timeout=240, env=None):
    """Run the README's ``command`` as written, plus ``more`` arguments (a later ``--steps`` wins
    in argparse), from the repository's root under an outer timeout; ``torchrun`` and ``python``
    are this interpreter's."""
    argv = shlex.split(command) + list(more)
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    argv = [sys.executable if a in ("python", "python3") else a for a in argv]
    return subprocess.run(["timeout", "--kill-after=30", str(timeout), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout + 60, env=env)


def _ok(proc):
    assert proc.returncode == 0, f"rc {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"


def test_every_first_screen_command_is_run():
    promised = promised_output()
    assert set(promised) == set(RUN_BY), f"README's first screens: {sorted(promised)}; run here: {sorted(RUN_BY)}"
    for command, test in RUN_BY.items():
        if test is not None:
            assert _steps(promised[command]), f"no expected bytes lines under {command!r} in the README"
    with open(os.path.join(ROOT, "scripts", "test.sh")) as fh:  # the line the README promises
        assert 'echo "ALL TESTS PASSED"' in fh.read()


def test_main_job(tmp_path):
    """``bash scripts/main.sh`` (its idempotent set-up, then the language model at 4 ranks under
    mpirun) for 4 steps: the README's bytes, its summary line, and the CSV of the two evaluations."""
    pytest.importorskip("horovod")
    out_csv = tmp_path / "lm.csv"
    proc = run_readme_command("bash scripts/main.sh", "--steps", "4", "--eval-every", "2", "--eval-batches", "1",
                              "--files", "20", "--no-progress", "--csv", str(out_csv), timeout=300)
    _ok(proc)
    # setup.sh's pip, run as root, warns about root (scripts/setup.sh): not the example's
    stderr = "\n".join(l for l in proc.stderr.splitlines() if "Running pip as the 'root' user" not in l)
    check_against_readme("bash scripts/main.sh", proc.stdout, stderr)
    rows = list(csv.DictReader(open(out_csv)))
    assert [int(r["step"]) for r in rows] == [2, 4] and all(int(r["ranks"]) == 4 for r in rows), rows
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"]), rows
    assert float(rows[-1]["bytes_vs_dense"]) < 0.6, rows[-1]  # sparse: well under dense even with step 1's sync


def test_ddp_example():
    command = "torchrun --standalone --nproc_per_node 2 examples/ddp_slamb.py --steps 50"
    proc = run_readme_command(command, "--steps", "12")
    _ok(proc)
    check_against_readme(command, proc.stdout, proc.stderr)


def test_fsdp_example():
    """FSDP2 on a 2 x 2 mesh: the README's bytes, and none of FSDP2's warnings (the example's
    model returns its logits as a tensor of its own, not a view)."""
    command = "torchrun --standalone --nproc_per_node 4 examples/fsdp_slamb.py --replicas 2 --steps 20"
    proc = run_readme_command(command, "--steps", "5", "--files", "10", timeout=300)
    _ok(proc)
    check_against_readme(command, proc.stdout, proc.stderr)
