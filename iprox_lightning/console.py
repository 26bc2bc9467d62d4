"""Console hygiene for the command line: what Lightning prints that is not about this run.

Lightning (>= 2.6) prints two advertising tips on every ``Trainer`` ("💡 Tip: ... litlogger" and
"... litmodels"). They are logged at INFO level through ``lightning.pytorch.utilities.rank_zero``;
:func:`quiet_lightning_tips` drops exactly those records (everything else that logger says is kept).
"""
from __future__ import annotations

import logging

_TIP_PREFIX = "💡 Tip:"
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP_PREFIX)


_FILTER = _DropTips()


def quiet_lightning_tips() -> None:
    """Drop Lightning's advertising tips (idempotent)."""
    for name in _LOGGERS:
        lg = logging.getLogger(name)
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)
