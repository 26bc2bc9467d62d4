"""What runs stage after stage: the pipeline (its settings and their checks in ``settings``, each stage run or reused
by its fingerprint in ``stages``, the stages in order with the per-task selections in ``pipeline``, ``pipeline
--plan`` in ``plan``, the summary in ``summary``) and the proxy check (``check``). The commands
(``commands/pipeline.py``, ``commands/check.py``) parse their arguments and call :func:`.pipeline.run_pipeline` and
:func:`.check.run_check`."""
