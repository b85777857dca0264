"""Benchmark of ckptd against the machine's limits and against ``torch.save``.

Run ``python -m benchmarks --size-gib 1 --repeat 3`` from the repository root.
One run measures, on the same transformer-plus-AdamW state dict:

* machine limits for the same number of bytes (memcpy into a reused buffer,
  memcpy into fresh shared memory, O_DIRECT and buffered sequential writes);
* the peer a trainer would otherwise use (``torch.save`` + ``fsync``);
* ckptd with synchronous and with background staging, in steady state,
  through a dedicated daemon started for the run.

The point is ratios, not absolute numbers: how many memcpys ``save_async``
blocks for, and how many raw O_DIRECT writes a save takes to become durable.
No timing is ever asserted; the numbers are reported in ``RESULTS.md``.
"""
