"""Stage 1, IPSVD: probes, factors, ranks, the plan, applying it to a model, and the ``IPSVDCallback``."""
