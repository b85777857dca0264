"""Benchmarks of ckptd against the machine's limits and its peers, side by side in one run.

``make bench`` (``python -m benchmarks``) runs every case of the registry
(``cases.py``: state builder, method, device) in its own process; each
sends one JSON line, and ``report.py`` turns the lines into ``RESULTS.md``
with the targets as data rows. ``--smoke`` runs the same registry at tiny
sizes in seconds (part of ``make test``); ``--device cuda`` measures from
CUDA tensors. No timing is ever asserted.
"""
