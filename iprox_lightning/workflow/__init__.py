"""The pipeline's orchestration: its settings and their checks (``settings``), each stage run or reused by its
fingerprint (``stages``), the stages in order with the per-task selections (``pipeline``), ``pipeline --plan``
(``plan``) and the summary (``summary``). ``commands/pipeline.py`` parses the command's arguments and calls
:func:`~iprox_lightning.workflow.pipeline.run_pipeline`."""
