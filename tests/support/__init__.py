"""What the tests share: helpers, dense references and the job scripts that tests launch.

Every test module (in tests/ and in mpi_tests/) imports them as ``from tests.support import ...``;
none edits the import path. pytest puts the repository's root on the path (tests/ and mpi_tests/ are
packages); a job runs as a module, from the repository's root:
``python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.support.hf_job CASE OUT``
or ``bash scripts/mpirun.sh 2 120 python3 -m tests.support.averaging_job horovod OUT``
(``tests.support.launch`` does both, under an outer timeout).

Helpers:

- ``strict_cupy``: the strict CuPy double (docs/testing.md section 2), with ``host_kernels``, the
  host build of the device kernels it executes;
- ``mpi_checks``: ``Checks`` (failures collected on every rank, asserted together after the last
  collective), ``call``, and the transports of device buffers by name;
- ``launch``: ``torchrun`` and ``mpirun`` under an outer timeout, ``script_module`` (a script of
  examples/ or benchmarks/ imported as a module, without editing the import path);
- dense references: ``slamb_reference`` (SLAMB, docs/algorithm.md section 1, in float64 NumPy),
  ``torch_reference`` (sections 1 and 2 on a torch model), ``adamw_reference`` (AdamW in float64),
  ``onebit_reference`` (docs/onebit_lamb.md), ``demo_reference`` (DeMo);
- ``state_compare``: state dicts compared, replicas averaged in float64.

Jobs (each launched by one test module): ``averaging_job``, ``fsdp_job``, ``fsdp_framework_job``,
``fsdp_overlap_job``, ``fsdp_resize_job``, ``fsdp_topk_job``, ``hf_job``, ``lightning_job``.
"""
