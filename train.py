#!/usr/bin/env python
"""Entry point: ``python train.py {fit,validate,test,predict,select,pipeline,report,check} ...``.

See ``iprox_lightning/cli.py`` and ``configs/`` (one YAML per stage).
"""
from iprox_lightning.cli import main

if __name__ == "__main__":
    main()
