#!/usr/bin/env python
"""Entry point: ``python train.py <command> ...`` (``python train.py --help`` lists every command).

See ``iprox_lightning/commands/`` (one module per command) and ``configs/`` (one YAML per stage).
"""
from iprox_lightning.cli import main

if __name__ == "__main__":
    main()
