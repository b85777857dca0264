"""Benchmarks of ckptd against the machine's limits and its peers, side by side in one run.

``make bench`` runs every case of the registry (``cases.py``) in its own process, and ``report.py`` turns their JSON
lines into ``RESULTS.md``, the targets as data rows. ``--smoke``: tiny sizes (in ``make test``); ``--device cuda``:
from CUDA tensors. No timing is ever asserted.
"""
