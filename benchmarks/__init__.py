"""Benchmarks of ckptd against the machine's limits and against its peers.

Run ``make bench`` (``python -m benchmarks``) from the repository root; see
``python -m benchmarks --help`` for sizes, repetitions, ranks and sections.
One run measures, on the same transformer-plus-AdamW state dict:

* machine limits for the same number of bytes (memcpy into a reused buffer,
  memcpy into fresh shared memory, O_DIRECT and buffered sequential writes,
  sequential reads);
* the peers a trainer would otherwise use: ``torch.save`` + ``fsync`` and
  PyTorch DCP (``save``, ``async_save`` with the THREAD and PROCESS
  checkpointers, and PROCESS with a reused ``DefaultStager``);
* ckptd with synchronous and background staging, in steady state, through a
  dedicated daemon started for the run; several clients at once; sizes from
  64 MiB to 4 GiB;
* loading: ``ckptd.load`` (zero-copy, ``map_location``, without
  verification), ``ckptd.load_into``, ``torch.load``, DCP ``load``, cold and
  warm; and several ranks loading at once, with and without a load lease.

Each measurement runs in its own worker process (``worker.py``) while the
orchestrator samples memory and the machine's CPU (``measure.py``), waits
for quiet windows, and writes ``RESULTS.md`` with the issue's targets
(``targets.py``) and a chart (``chart.py``). The point is ratios, not
absolute numbers. No timing is ever asserted.

``gpu_check.py`` is a separate, self-contained script for a CUDA machine.
"""
