"""Stage 2, alignment: the losses, the task terms (``task``), ``ProxyAlignModule``, the FSDP helper, and the
keep-best and ranking-fidelity callbacks."""
